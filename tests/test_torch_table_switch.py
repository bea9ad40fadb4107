"""A sharded table inside a torch model: its ``trainable`` switch (every way torch freezes a model
reaches the table, DDP and optimizers over ``model.parameters()`` take it, state dicts are as they
were), a model cast to bfloat16, ``torch.compile``, deep copies and pickling."""

from __future__ import annotations

import pytest

import zmqflow as zf

torch = pytest.importorskip("torch")

import zmqflow.torch as zt  # noqa: E402
from zmqflow.torch.embedding import EmbeddingBag  # noqa: E402
from zmqflow.torch.hybrid import HybridStrategy  # noqa: E402

from .conftest import launch_script  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.table = EmbeddingBag(name, 20, 4, mode="sum", optimizer=zf.optim.SGD(0.5))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


IDS = torch.tensor([[1, 2], [3, 1]])


def _train_step(model: torch.nn.Module) -> None:
    model(IDS).sum().backward()
    model.table.synchronize()


@pytest.mark.parametrize("freeze", ["module", "parameters"])
def test_freezing_the_model_freezes_its_tables(local, freeze):
    model = Model(f"switch/{freeze}")
    before = model.table.read(IDS).clone()
    if freeze == "module":
        model.requires_grad_(False)
    else:
        for p in model.parameters():
            p.requires_grad = False
    out = model(IDS)
    assert not out.requires_grad  # nothing in the graph: no backward, no push
    assert model.table.counters["pushes"] == 0 and torch.equal(model.table.read(IDS), before)
    model.table.requires_grad_(True)  # the table alone trains again
    model(IDS).sum().backward()
    model.table.synchronize()
    assert model.table.counters["pushes"] == 1 and not torch.equal(model.table.read(IDS), before)
    assert model.head.weight.grad is None


def test_the_switch_gets_an_empty_gradient_and_optimizers_step_over_it(local):
    model = Model("switch/opt")
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model)
    assert model.table.trainable.grad is not None and model.table.trainable.grad.numel() == 0
    opt.step()
    assert model.table.trainable.numel() == 0 and model.table.counters["pushes"] == 1


def test_state_dicts_hold_no_switch_and_load_without_one(local):
    model = Model("switch/state")
    state = model.state_dict()
    assert "table.trainable" not in state and set(state) == {"head.weight", "head.bias"}
    model.load_state_dict(state, strict=True)  # a state dict saved before tables had a switch loads too


@pytest.mark.parametrize("backend", ["ring", "ps"])
def test_distributed_optimizers_take_the_switch(local, backend):
    model = Model(f"switch/dist-{backend}")
    head = model.head.weight.detach().clone()
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  backend=backend)
    _train_step(model)
    opt.step()
    assert not torch.equal(model.head.weight.detach(), head) and model.table.trainable.numel() == 0


DDP_SWITCH = '''
import os
import torch
import torch.distributed as dist
import zmqflow as zf
from zmqflow.torch.embedding import EmbeddingBag


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = EmbeddingBag("switch/ddp", 20, 4, mode="sum", optimizer=zf.optim.SGD(0.5))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table(ids))


IDS = torch.tensor([[1, 2], [3, 1]])
dist.init_process_group("gloo")  # launch gives RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
ddp = torch.nn.parallel.DistributedDataParallel(Model())
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for ids in (IDS, IDS, torch.empty(2, 0, dtype=torch.long), IDS):  # a batch of empty bags too
    opt.zero_grad()
    ddp(ids).sum().backward()
    opt.step()
ddp.module.table.synchronize()
print(f"pushes {ddp.module.table.counters['pushes']}", flush=True)
# No teardown: torch's ProcessGroupGloo destructor joins its run loop while holding the GIL, and
# the run loop may still need the GIL to free the last work's thread-local state (a deadlock that
# depends on timing). This process's part is done; launch stops the ps.
os._exit(0)
'''


def test_ddp_sees_the_switch_used_at_every_step(procs, tmp_path):
    """DDP fails a step whose parameters needing a gradient did not all get one (unless told to
    look for unused ones): the switch must get one whenever the table trains. In a process of its
    own, so that torch's gloo teardown never runs inside the test process."""
    p = launch_script(procs, tmp_path / "ddp_switch.py", DDP_SWITCH, workers=1, ps=1)
    p.wait_for_line("[worker:0] pushes 3", 100)
    assert p.wait(60) == 0, p.output


def test_hybrid_keeps_a_frozen_table_frozen_on_the_shards(local):
    frozen = torch.nn.EmbeddingBag(10, 4, mode="sum")
    frozen.weight.requires_grad_(False)
    model = torch.nn.Sequential(frozen, torch.nn.Linear(4, 1))
    hybrid = HybridStrategy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                            prefix="switch/hybrid/")
    table = model[0]
    before = table.read(IDS).clone()
    hybrid.zero_grad()
    model(IDS).sum().backward()
    hybrid.step()
    table.synchronize()
    assert not table.push_gradients and table.counters["pushes"] == 0 and torch.equal(table.read(IDS), before)


def test_a_model_cast_to_bfloat16_computes_in_it_and_pushes_in_the_tables_dtype(local):
    model = Model("switch/bf16").to(torch.bfloat16)
    before = model.table.read(IDS).clone()
    out = model(IDS)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    model.table.synchronize()
    after = model.table.read(IDS)
    assert after.dtype == torch.float32 and model.table.counters["pushes"] == 1 and not torch.equal(after, before)


def test_a_compiled_model_runs_the_tables_eagerly_and_pushes(local):
    model = Model("switch/compiled")
    before = model.table.read(IDS).clone()
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(compiled(IDS), model(IDS))
    compiled(IDS).sum().backward()
    model.table.synchronize()
    assert model.table.counters["pushes"] == 1 and not torch.equal(model.table.read(IDS), before)


def test_a_deep_copy_shares_the_table_and_pickling_says_how_to_save(local):
    import copy
    import io

    model = Model("switch/copy")
    twin = copy.deepcopy(model)  # an EMA or teacher copy: its dense layers are its own
    # the same rows on the shards and the same pushes to wait for; what it holds for a push is its own
    assert twin.table.table.handle is model.table.table.handle and twin.head.weight is not model.head.weight
    assert twin.table.table.pending is model.table.table.pending and twin.table.table is not model.table.table
    torch.testing.assert_close(twin(IDS), model(IDS))
    with pytest.raises(zf.errors.InvalidArgument, match="cannot be pickled .* zmqflow.checkpoint"):
        torch.save(model, io.BytesIO())
