"""Tables under mixed precision's loss scaling (``torch.amp.GradScaler``): the shards get the
unscaled gradient, a step that overflowed changes neither the tables nor the dense parameters,
as it changes nothing in a local model, and no gradient holding inf or NaN ever reaches them."""

from __future__ import annotations

import copy
import json

import pytest

import zmqflow as zf
from zmqflow.errors import InvalidArgument

torch = pytest.importorskip("torch")

from zmqflow.torch.embedding import EmbeddingBag  # noqa: E402
from zmqflow.torch.hybrid import HybridStrategy  # noqa: E402

from .conftest import launch_script  # noqa: E402

IDS = torch.tensor([[1, 2], [3, 1]])
LR = 0.1
BIG = 1e36  # times the loss scale (1024) past float32's largest value: the step overflows


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)


def _loss(table: torch.nn.Module, dense: torch.nn.Linear, overflow: str | None) -> torch.Tensor:
    """A loss whose gradient overflows nowhere, everywhere, in the table only or in the dense layer only."""
    bags = table(IDS)
    loss = dense(bags).sum()
    if overflow == "both":
        loss = loss * BIG
    elif overflow == "table":
        loss = loss + BIG * bags[:, 0].sum()
    elif overflow == "dense":
        loss = loss + BIG * dense.bias.sum()
    return loss


def _reference(rows: torch.Tensor,
               dense: torch.nn.Linear) -> tuple[torch.nn.EmbeddingBag, torch.nn.Linear, torch.optim.SGD]:
    """torch's own table holding the same rows, beside a copy of the dense layer, one optimizer over both."""
    table = torch.nn.EmbeddingBag.from_pretrained(rows.clone(), freeze=False, mode="sum")
    twin = copy.deepcopy(dense)
    return table, twin, torch.optim.SGD([*table.parameters(), *twin.parameters()], lr=LR)


def _close(table: EmbeddingBag, dense: torch.nn.Linear, ref: torch.nn.EmbeddingBag, ref_dense: torch.nn.Linear) -> None:
    torch.testing.assert_close(table.weight, ref.weight.detach())
    torch.testing.assert_close(dense.weight.detach(), ref_dense.weight.detach())
    torch.testing.assert_close(dense.bias.detach(), ref_dense.bias.detach())


def test_push_held_with_the_scale_matches_torch_and_skips_an_overflow(local):
    """``push_held(scale=scaler.get_scale())`` beside torch's EmbeddingBag under the same scaler (an
    overflow the dense gradients share: the dense step is the scaler's to skip)."""
    torch.manual_seed(0)
    table = EmbeddingBag("amp/held", 10, 4, mode="sum", optimizer=zf.optim.SGD(LR), push="step")
    dense = torch.nn.Linear(4, 1)
    ref, ref_dense, ref_opt = _reference(table.weight, dense)
    opt = torch.optim.SGD(dense.parameters(), lr=LR)
    scaler, ref_scaler = _scaler(), _scaler()
    for overflow in (None, "both", None):
        before = table.weight
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(_loss(table, dense, overflow)).backward()
        carried = table.push_held(scale=scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        ref_scaler.scale(_loss(ref, ref_dense, overflow)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        table.synchronize()
        assert carried == (0 if overflow else 1) and table.held_passes == 0
        assert torch.isfinite(table.weight).all() and scaler.get_scale() == ref_scaler.get_scale()
        if overflow:
            assert torch.equal(table.weight, before)  # skipped: not even a finite part of the step went
        torch.testing.assert_close(table.weight, ref.weight.detach())
    assert table.counters["pushes"] == 2 and table.counters["pushes_skipped"] == 1
    with pytest.raises(InvalidArgument, match="'amp/held': scale must be a positive finite number, got 0"):
        table.push_held(scale=0)


@pytest.mark.parametrize("overflow", ["table", "dense"])
def test_hybrid_step_with_a_scaler_steps_as_torch_does(local, overflow):
    """The common loop ``scaler.scale(loss).backward(); hybrid.step(scaler=scaler); scaler.update()``
    beside a local model under the same scaler: an overflow in the table alone skips the dense step
    too, one in the dense layer alone skips the table too, and the scale backs off either way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum"), torch.nn.Linear(4, 1))
    dense = copy.deepcopy(model[1])
    hybrid = HybridStrategy(model, torch.optim.SGD(model.parameters(), lr=LR), zf.optim.SGD(LR), prefix="amp/")
    table = model[0]
    ref, ref_dense, ref_opt = _reference(table.weight, dense)
    scaler, ref_scaler = _scaler(), _scaler()
    for step in (None, overflow, None):
        hybrid.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(_loss(table, model[1], step)).backward()
        hybrid.step(scaler=scaler)
        scaler.update()
        ref_scaler.scale(_loss(ref, ref_dense, step)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        hybrid.flush()
        assert scaler.get_scale() == ref_scaler.get_scale()
        _close(table, model[1], ref, ref_dense)
    assert scaler.get_scale() == 2048.0  # 1024 grown, halved, grown: the overflow reached the scaler
    assert table.counters["pushes"] == 2 and table.counters["pushes_skipped"] == 1


def test_hybrid_step_refuses_a_scaler_for_a_table_that_pushed_at_backward(local):
    kept = EmbeddingBag("amp/kept", 10, 4, mode="sum", optimizer=zf.optim.SGD(LR))  # push="backward"
    model = torch.nn.Sequential(kept, torch.nn.Linear(4, 1))
    hybrid = HybridStrategy(model, torch.optim.SGD(model[1].parameters(), lr=LR), prefix="amp/")
    scaler = _scaler()
    scaler.scale(model(IDS).sum()).backward()
    with pytest.raises(InvalidArgument, match="'amp/kept' push at backward.*push=\"step\""):
        hybrid.step(scaler=scaler)


@pytest.mark.parametrize("push", ["backward", "step"])
def test_a_gradient_holding_inf_never_reaches_the_shards(local, push):
    """Without a scale to skip by, a non-finite gradient is dropped and raised where a background
    push's error is: at the table's next forward (``push="backward"``) or flush."""
    table = EmbeddingBag("amp/inf", 10, 4, mode="sum", optimizer=zf.optim.SGD(LR), push=push)
    before = table.read(IDS).clone()
    (table(IDS) * torch.tensor([1.0, float("inf"), 1.0, 1.0])).sum().backward()
    with pytest.raises(InvalidArgument, match="embedding 'amp/inf' holds inf or NaN.*push=\"step\""):
        table(IDS) if push == "backward" else table.flush()
    assert torch.equal(table.read(IDS), before) and torch.isfinite(table.weight).all()
    assert table.counters["pushes"] == 0 and table.counters["pushes_skipped"] == 1
    table(IDS).sum().backward()  # the error was raised once; the table trains on
    table.flush()
    assert table.counters["pushes"] == 1 and not torch.equal(table.read(IDS), before)


# Two ranks, one table on two shards: rank 1's gradient for the table overflows, rank 0's does not.
OVERFLOW_ON_ONE_RANK = '''
import json, sys
import torch
import zmqflow as zf
import zmqflow.torch as zt
from zmqflow.torch.hybrid import HybridStrategy

zt.init()
rank = zt.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum"), torch.nn.Linear(4, 1))
hybrid = HybridStrategy(model, torch.optim.SGD(model.parameters(), lr=0.1), zf.optim.SGD(0.1), prefix="amp2/")
table, dense = model[0], model[1]
rows, params = table.weight, [p.detach().clone() for p in dense.parameters()]
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
zt.barrier()  # both ranks read the rows before either steps
hybrid.zero_grad()
bags = table(torch.tensor([[1, 2], [3, 1]]))
loss = dense(bags).sum()
if rank == 1:
    loss = loss + 1e36 * bags[:, 0].sum()  # times the scale: inf in the table's gradient, the dense ones finite
scaler.scale(loss).backward()
hybrid.step(scaler=scaler)
scaler.update()
hybrid.flush()
zt.barrier()  # whatever either rank pushed has landed
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as fh:
    json.dump({"rows_kept": torch.equal(table.weight, rows), "scale": scaler.get_scale(),
               "dense_kept": all(torch.equal(p, q) for p, q in zip(dense.parameters(), params)),
               "pushes": table.counters["pushes"], "skipped": table.counters["pushes_skipped"]}, fh)
zt.shutdown()
'''


def test_a_table_overflow_on_one_rank_skips_the_step_on_every_rank(procs, tmp_path):
    """Rank 0's gradients are finite, rank 1's table gradient is not: the ranks agree (a max over
    the ring) that the step overflowed, so neither pushes its table gradient nor steps its dense
    layer, and both scalers back off, as they would had both overflowed. Without that agreement
    rank 0 would push and step alone: its dense replica would part from rank 1's."""
    p = launch_script(procs, tmp_path / "overflow.py", OVERFLOW_ON_ONE_RANK, tmp_path, workers=2, ps=2)
    assert p.wait(110) == 0, p.output
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"rows_kept": True, "dense_kept": True, "scale": 512.0, "pushes": 0, "skipped": 1}, (rank, got)
