"""Tables that push at the step (``push="step"``): gradient accumulation over several backward
passes reads the rows the last step left, and the shards apply their optimizer once, to the sum,
as a local table under accumulation would."""

from __future__ import annotations

import types

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.errors import InvalidArgument
from zmqflow.testing import make_spec

torch = pytest.importorskip("torch")
emb_mod = pytest.importorskip("zmqflow.torch.embedding")
EmbeddingBag = emb_mod.EmbeddingBag


@pytest.fixture
def cluster():
    """Two ps shards and a worker, each a task server on tcp, and a session on the worker."""
    spec = make_spec({"worker": 1, "ps": 2}, "tcp")
    started = []
    try:
        for i in range(2):
            started.append(zf.Server(spec, f"ps:{i}"))
        started.append(zf.Server(spec, "worker:0"))
        sess = zf.Session(started[-1].target, timeout=30)
        try:
            sess.wait_for_cluster(30)
            yield types.SimpleNamespace(sess=sess)
        finally:
            sess.close()
    finally:
        for s in started:
            s.stop()


BATCHES = [torch.tensor([[1, 2, 3], [3, 4, 1]]), torch.tensor([[1, 5, 5], [2, 6, 7]])]
WEIGHTS = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])]


def _loss(table, i: int) -> torch.Tensor:
    return (table(BATCHES[i]).sum(dim=1) * WEIGHTS[i]).sum()


def test_held_passes_push_once_as_the_sum_and_read_the_step_s_rows(cluster):
    """Adam on the shards is not linear in its gradients: one push of the sum differs from two
    pushes, so the rows tell which happened. The reference is one forward and backward of both
    batches together."""
    ids = torch.arange(8)
    made = {name: EmbeddingBag(name, 8, 3, mode="sum", optimizer=zf.optim.Adam(0.1), session=cluster.sess,
                               initializer=zf.init.normal(stddev=1.0, seed=7), push="step" if name == "held" else "backward")
            for name in ("held", "ref", "each")}
    held, ref, each = made["held"], made["ref"], made["each"]
    start = ref.read(ids).clone()
    assert torch.equal(held.read(ids), start) and torch.equal(each.read(ids), start)  # one seed: the same rows
    outputs = []
    for i in range(2):
        outputs.append(held(BATCHES[i]).detach().clone())
        _loss(held, i).backward()
        _loss(each, i).backward()
    assert held.held_passes == 2 and held.counters["pushes"] == 0  # nothing left this process yet
    assert torch.equal(outputs[1], torch.nn.functional.embedding_bag(BATCHES[1], start, mode="sum"))
    # one forward over both batches: one push of the summed gradient (two calls would push twice)
    (ref(torch.cat(BATCHES)).sum(dim=1) * torch.cat(WEIGHTS)).sum().backward()
    assert held.push_held() == 2 and held.held_passes == 0 and held.push_held() == 0
    for table in (held, ref, each):
        table.flush()
    assert held.counters["pushes"] == 1
    torch.testing.assert_close(held.read(ids), ref.read(ids), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(each.read(ids), ref.read(ids))  # two Adam steps: the test can tell


def test_zero_grad_drops_what_is_held_and_flush_pushes_nothing(cluster):
    table = EmbeddingBag("t", 8, 2, mode="sum", optimizer=zf.optim.SGD(1.0), session=cluster.sess, push="step")
    ids = torch.arange(8)
    before = table.read(ids).clone()
    _loss(table, 0).backward()
    assert table.held_passes == 1
    table.zero_grad()
    assert table.held_passes == 0
    table.flush()
    assert table.counters["pushes"] == 0 and torch.equal(table.read(ids), before)
    _loss(table, 1).backward()
    table.flush()  # pushes what is held, then waits
    moved = (table.read(ids) != before).any(dim=1)
    assert table.counters["pushes"] == 1 and moved.tolist() == [i in (1, 2, 5, 6, 7) for i in range(8)]


def test_push_mode_is_checked(cluster):
    with pytest.raises(InvalidArgument, match="push must be one of backward, step, got 'later'"):
        EmbeddingBag("t", 8, 2, session=cluster.sess, push="later")


def test_a_frozen_held_table_holds_nothing(cluster):
    table = EmbeddingBag("t", 8, 2, mode="sum", session=cluster.sess, push="step").requires_grad_(False)
    out = table(BATCHES[0])
    assert not out.requires_grad and table.held_passes == 0
    assert np.array_equal(table.read(torch.arange(8)).numpy(), table.read(torch.arange(8)).numpy())


def test_the_model_s_zero_grad_drops_what_is_held_and_a_copy_holds_its_own(cluster):
    """torch's Module.zero_grad never calls its children's: the table sees the switch's gradient
    gone at its next forward. A deep copy shares the rows, not what the original holds."""
    import copy

    table = EmbeddingBag("t", 8, 2, mode="sum", optimizer=zf.optim.SGD(1.0), session=cluster.sess, push="step")
    model = torch.nn.Sequential(table)
    ids = torch.arange(8)
    before = table.read(ids).clone()
    _loss(table, 0).backward()
    model.zero_grad()  # the pass is discarded
    _loss(table, 1).backward()  # the next forward dropped pass 0's held gradient
    assert table.held_passes == 1
    twin = copy.deepcopy(model)
    twin.zero_grad()
    twin[0].push_held()
    assert table.held_passes == 1 and twin[0].held_passes == 0  # the twin dropped only its own
    table.flush()
    moved = (table.read(ids) != before).any(dim=1)
    assert moved.tolist() == [i in (1, 2, 5, 6, 7) for i in range(8)]  # batch 1's ids only
    assert torch.equal(twin[0].read(ids), table.read(ids))  # the same rows
