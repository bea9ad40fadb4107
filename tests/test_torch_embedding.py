"""zmqflow.torch.embedding: EmbeddingBag and Embedding over tables on the ps shards.

Every result is checked against torch's own modules loaded with the same table (forward), and
trained beside torch.nn.EmbeddingBag(sparse=True) + torch.optim.SGD (backward and the server's SGD).
"""

from __future__ import annotations

import asyncio
import textwrap
import threading
import types

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint, errors
from zmqflow.bridge import runtime
from zmqflow.testing import make_spec, wait_until

from .conftest import launch_script

torch = pytest.importorskip("torch")
emb_mod = pytest.importorskip("zmqflow.torch.embedding")
EmbeddingBag, Embedding = emb_mod.EmbeddingBag, emb_mod.Embedding


@pytest.fixture
def cluster(tmp_path):
    yield from two_shards(tmp_path)


def two_shards(tmp_path):
    """Two ps shards and a worker, each a task server on tcp, and a session on the worker."""
    spec = make_spec({"worker": 1, "ps": 2}, "tcp")
    started = []
    try:
        for i in range(2):
            started.append(zf.Server(spec, f"ps:{i}", checkpoint_roots=[str(tmp_path)]))
        started.append(zf.Server(spec, "worker:0"))
        sess = zf.Session(started[-1].target, timeout=30)
        try:
            sess.wait_for_cluster(30)
            yield types.SimpleNamespace(sess=sess, servers={str(s.task): s for s in started})
        finally:
            sess.close()
    finally:
        for s in started:
            s.stop()


def torch_bag(module, mode: str):
    """torch's own EmbeddingBag holding a copy of the module's table."""
    return torch.nn.EmbeddingBag.from_pretrained(module.weight.clone(), freeze=False, mode=mode, sparse=mode != "max")


class Recorder:
    """What the session sends to each task: (task, op, part-local ids), by wrapping its public call_task."""

    def __init__(self, sess: zf.Session):
        self.calls: list[tuple[str, str, list[int]]] = []
        self.inner = sess.async_session.call_task
        self.gate: threading.Event | None = None  # when set up: emb_push waits for it
        self.fail: list[BaseException] = []  # errors the next emb_push calls raise
        sess.async_session.call_task = self.call_task

    async def call_task(self, task, service, op, body=None, **kwargs):
        if op == "emb_push":
            if self.fail:
                raise self.fail.pop(0)
            if self.gate is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, 30)
        result = await self.inner(task, service, op, body, **kwargs)
        if op in ("emb_lookup", "emb_push"):
            self.calls.append((str(task), op, body.ids.tolist()))
        return result


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_forward_equals_torch_embedding_bag(cluster, mode):
    m = EmbeddingBag("t", 23, 5, mode=mode, session=cluster.sess)
    ref = torch_bag(m, mode)
    assert m.weight.shape == (23, 5) and m.weight.std() > 0.5  # N(0, 1), not zeros
    two_d = torch.tensor([[1, 2, 2, 22], [0, 0, 0, 0], [7, 13, 1, 2]])
    torch.testing.assert_close(m(two_d), ref(two_d), rtol=0, atol=0)
    flat = torch.tensor([4, 4, 9, 17, 3, 22, 0])
    for offsets in ([0, 2, 2, 5], [0], [0, 7]):  # an empty bag, one bag, an empty bag at the end
        off = torch.tensor(offsets)
        torch.testing.assert_close(m(flat, off), ref(flat, off), rtol=0, atol=1e-6)
    empty = torch.zeros(3, 0, dtype=torch.long)
    torch.testing.assert_close(m(empty), torch.zeros(3, 5))
    if mode == "sum":
        w1 = torch.linspace(-2, 2, 7)
        torch.testing.assert_close(m(flat, torch.tensor([0, 3]), w1), ref(flat, torch.tensor([0, 3]), w1))
        w2 = torch.rand(two_d.shape)
        torch.testing.assert_close(m(two_d, per_sample_weights=w2), ref(two_d, per_sample_weights=w2))
    last = EmbeddingBag("t", 23, 5, mode=mode, include_last_offset=True, session=cluster.sess)
    ref_last = torch.nn.EmbeddingBag.from_pretrained(m.weight, mode=mode, include_last_offset=True)
    torch.testing.assert_close(last(flat, torch.tensor([0, 2, 7])), ref_last(flat, torch.tensor([0, 2, 7])))
    assert [p.numel() for p in m.parameters()] == [0] and m.state_dict() == {}  # nothing an optimizer could move


def test_embedding_forward_has_the_ids_shape(cluster):
    e = Embedding("e", 11, 3, session=cluster.sess, initializer=zf.init.uniform(-1, 1, seed=4))
    ids = torch.tensor([[[1, 10], [10, 10]], [[0, 5], [2, 1]]])
    out = e(ids)
    assert out.shape == (2, 2, 2, 3)
    torch.testing.assert_close(out, torch.nn.functional.embedding(ids, e.weight))
    assert e(torch.tensor(4)).shape == (3,)


@pytest.mark.parametrize("mode, weighted", [("sum", True), ("mean", False)])
def test_training_equals_torch_sparse_sgd(cluster, mode, weighted):
    """Backward + the shards' SGD(lr) step for step equals torch.nn.EmbeddingBag(sparse=True) +
    torch.optim.SGD on the same data; a torch optimizer on a dense layer after it is unaffected."""
    lr = 0.3
    m = EmbeddingBag("t", 30, 4, mode=mode, optimizer=zf.optim.SGD(lr), session=cluster.sess)
    ref = torch_bag(m, mode)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(6, 4, generator=gen)
    for step in range(6):
        ids = torch.randint(0, 30, (20,), generator=gen)
        ids[:5] = 7  # a hot id repeated within and across bags
        offsets = torch.tensor([0, 3, 3, 9, 14, 15])
        weights = torch.rand(20, generator=gen) if weighted else None
        out, expected = m(ids, offsets, weights), ref(ids, offsets, weights)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        ((out - target) ** 2).sum().backward()
        ref_opt.zero_grad()
        ((expected - target) ** 2).sum().backward()
        assert ref.weight.grad.is_sparse
        ref_opt.step()
    m.flush()
    torch.testing.assert_close(m.weight, ref.weight.detach(), rtol=1e-5, atol=1e-5)
    assert m.counters["pushes"] == 6 and m.pending_pushes == 0


def test_embedding_training_equals_torch_embedding(cluster):
    lr = 0.5
    e = Embedding("e", 12, 3, optimizer=zf.optim.SGD(lr), session=cluster.sess, dtype=torch.float64)
    ref = torch.nn.Embedding.from_pretrained(e.weight.clone(), freeze=False, sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(4):
        ids = torch.tensor([[step, 3, 3], [11, step + 1, 3]])
        (e(ids) ** 3).sum().backward()
        opt.zero_grad()
        (ref(ids) ** 3).sum().backward()
        opt.step()
    torch.testing.assert_close(e.weight, ref.weight.detach(), rtol=1e-12, atol=1e-12)


def test_only_unique_ids_are_requested_from_the_shards_that_own_them(cluster):
    m = EmbeddingBag("t", 40, 2, mode="sum", optimizer=zf.optim.SGD(1.0), session=cluster.sess)
    rec = Recorder(cluster.sess)
    owner = {p: part["task"] for p, part in enumerate(m.partitions)}  # mod: even ids on part 0
    msgs = {t: s.async_server.counters.msgs_in for t, s in cluster.servers.items()}
    ids = torch.tensor([[6, 2, 6, 6], [2, 2, 38, 6]])
    m(ids).sum().backward()
    m.flush()
    assert rec.calls == [(owner[0], "emb_lookup", [1, 3, 19]), (owner[0], "emb_push", [1, 3, 19])]
    other = owner[1]
    assert cluster.servers[other].async_server.counters.msgs_in == msgs[other]  # not contacted at all
    assert cluster.servers[owner[0]].async_server.counters.msgs_in - msgs[owner[0]] == 2
    assert m.counters["ids_looked_up"] == 3 and m.counters["ids_pushed"] == 3 and m.counters["rows_updated"] == 3
    rec.calls.clear()
    m(torch.tensor([[5, 4, 5, 1], [4, 4, 4, 4]]))  # both shards, one request each, no backward: no push
    assert sorted(rec.calls) == sorted([(owner[0], "emb_lookup", [2]), (owner[1], "emb_lookup", [0, 2])])
    with torch.no_grad():
        rec.calls.clear()
        m(ids)
    m.flush()
    assert [c[1] for c in rec.calls] == ["emb_lookup"]


def test_a_dynamic_table_admits_ids_and_grows(cluster):
    m = EmbeddingBag("dyn", None, 3, mode="sum", optimizer=zf.optim.SGD(1.0), min_frequency=2,
                     initializer=zf.init.ones(), session=cluster.sess)
    big = torch.tensor([[2**40, -5, 12]])
    assert m.size() == 0
    first = m(big)  # each id seen once: none admitted, each reads the default zero row
    torch.testing.assert_close(first, torch.zeros(1, 3))
    first.sum().backward()
    m.flush()
    assert m.size() == 0 and m.counters["rows_updated"] == 0  # pushes to rows not admitted are dropped
    torch.testing.assert_close(m(big), torch.full((1, 3), 3.0))  # the second sighting admits them
    assert m.size() == 3
    m(torch.tensor([[2**40, 7, 7]])).sum().backward()  # 7 is new (pending), 2**40 gets its one update
    ids, rows = (torch.cat(x) for x in zip(*m.export()))
    got = dict(zip(ids.tolist(), rows.tolist()))
    assert got == {2**40: [0.0] * 3, -5: [1.0] * 3, 12: [1.0] * 3}
    m.eval()  # eval mode reads without creating rows
    m(torch.tensor([[99, 98]]))
    m(torch.tensor([[99, 98]]))
    assert m.size() == 3
    m.train()
    for _ in range(2):
        m(torch.tensor([[100 + i for i in range(50)]]))
    assert m.size() == 53
    torch.testing.assert_close(m.read(torch.tensor([2**40, 99])), torch.zeros(2, 3))
    with pytest.raises(errors.InvalidArgument, match="dynamic"):
        m.weight
    assert m.evict(older_than_seconds=0) == 53 and m.size() == 0


def test_a_push_does_not_block_and_the_next_forward_reads_it(cluster):
    m = EmbeddingBag("t", 10, 2, mode="sum", optimizer=zf.optim.SGD(1.0), session=cluster.sess,
                     initializer=zf.init.zeros())
    rec = Recorder(cluster.sess)
    rec.gate = threading.Event()
    ids = torch.tensor([[4, 4, 6]])  # both on part 0
    got: list = []
    reader = threading.Thread(target=lambda: got.append(m(ids)))
    try:
        m(ids).sum().backward()  # returns while its push is held on the way to the shard
        assert m.pending_pushes == 1 and [c[1] for c in rec.calls] == ["emb_lookup"]
        rec.calls.clear()
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and rec.calls == []  # the next lookup waits for the push
    finally:
        rec.gate.set()
        if reader.ident is not None:
            reader.join(30)
    torch.testing.assert_close(got[0], torch.tensor([[-5.0, -5.0]]))  # 4 updated by -2, 6 by -1
    assert [c[1] for c in rec.calls] == ["emb_push", "emb_lookup"]


def test_a_failed_background_push_surfaces_on_the_next_forward_and_flush(cluster):
    m = EmbeddingBag("t", 10, 2, mode="sum", session=cluster.sess)
    rec = Recorder(cluster.sess)
    rec.fail = [errors.Unavailable("shard ps:1 went away"), errors.DeadlineExceeded("too slow")]
    ids = torch.tensor([[2, 4]])  # both on part 0: one request per push
    out = m(ids)
    out.sum().backward(retain_graph=True)
    out.sum().backward()  # two pushes, both failing, and backward raised nothing
    with pytest.raises(errors.Unavailable, match="went away") as info:
        m(ids)
    assert any("too slow" in note for note in getattr(info.value, "__notes__", []))
    before = m.weight
    rec.fail = [errors.Unavailable("again")]
    m(ids).sum().backward()
    with pytest.raises(errors.Unavailable, match="again"):
        m.flush()
    m.flush()  # reported once, then gone
    torch.testing.assert_close(m.weight, before)


def test_bad_ids_and_shapes_are_refused_and_change_nothing(cluster):
    m = EmbeddingBag("tab", 8, 2, mode="sum", session=cluster.sess)
    e = Embedding("tab", 8, 2, session=cluster.sess)
    before = m.weight
    rec = Recorder(cluster.sess)
    with pytest.raises(errors.InvalidArgument, match=r"'tab': id 8 out of range \[0, 8\)"):
        m(torch.tensor([[1, 8]]))
    with pytest.raises(errors.InvalidArgument, match=r"'tab': id -1 out of range"):
        e(torch.tensor([-1, 3]))
    bad = [
        (lambda: m(torch.tensor([[[1]]])), "2-D .* or 1-D with offsets, got shape \\[1, 1, 1\\]"),
        (lambda: m(torch.tensor([1, 2])), "1-D input needs offsets"),
        (lambda: m(torch.tensor([[1, 2]]), torch.tensor([0])), "offsets must be None when input is 2-D"),
        (lambda: m(torch.tensor([1, 2]), torch.tensor([1])), "offsets\\[0\\] must be 0"),
        (lambda: m(torch.tensor([1, 2]), torch.tensor([0, 3])), "non-decreasing and at most"),
        (lambda: m(torch.tensor([1.0, 2.0]), torch.tensor([0])), "ids must be integers"),
        (lambda: m(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(2)), "the input's shape \\[1, 2\\]"),
        (lambda: m(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2, dtype=torch.float64)), "torch.float32"),
        (lambda: e([1, 2]), "ids must be a torch.Tensor"),
    ]
    for call, message in bad:
        with pytest.raises(errors.InvalidArgument, match=message):
            call()
    mean = EmbeddingBag("tab", 8, 2, mode="mean", session=cluster.sess)
    with pytest.raises(errors.InvalidArgument, match="per_sample_weights need mode='sum'"):
        mean(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))
    with pytest.raises(errors.InvalidArgument, match="mode must be one of"):
        EmbeddingBag("tab", 8, 2, mode="median", session=cluster.sess)
    assert rec.calls == [] and m.pending_pushes == 0
    torch.testing.assert_close(m.weight, before)


def test_one_name_is_one_table_and_conflicts_are_refused(cluster):
    a = EmbeddingBag("t", 10, 2, optimizer=zf.optim.Adagrad(0.5), session=cluster.sess)
    b = EmbeddingBag("t", 10, 2, session=cluster.sess)  # no optimizer named: the table's
    assert b.optimizer == a.optimizer == zf.optim.Adagrad(0.5).spec()
    with pytest.raises(errors.VariableConflict, match="optimizer"):
        EmbeddingBag("t", 10, 2, optimizer=zf.optim.SGD(0.5), session=cluster.sess)
    with pytest.raises(errors.VariableConflict):
        EmbeddingBag("t", 10, 3, session=cluster.sess)
    with pytest.raises(errors.InvalidArgument, match="server-side zmqflow.optim optimizer"):
        EmbeddingBag("u", 10, 2, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                     session=cluster.sess)
    created = EmbeddingBag("v", 10, 2, session=cluster.sess)
    assert created.optimizer == zf.optim.SGD(0.01).spec()


def test_several_threads_construct_one_table_at_once(cluster):
    made: list = []
    threads = [threading.Thread(target=lambda: made.append(EmbeddingBag("race", 50, 3, session=cluster.sess)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(made) == 4
    torch.testing.assert_close(made[0].weight, made[3].weight)


def test_the_default_session_is_the_runtime_s():
    try:
        m = EmbeddingBag("t", 6, 2, mode="sum")
        assert m.session is runtime.current().session
        m(torch.tensor([[1, 2]])).sum().backward()
        m.flush()
        assert m.counters["rows_updated"] == 2
    finally:
        runtime.shutdown()


def test_checkpoints_save_and_restore_the_module_s_tables(cluster, tmp_path):
    m = EmbeddingBag("t", 12, 3, mode="sum", optimizer=zf.optim.Adagrad(0.5), session=cluster.sess)
    dyn = Embedding("d", None, 3, optimizer=zf.optim.SGD(1.0), session=cluster.sess)
    ids, dyn_ids = torch.tensor([[1, 5, 5]]), torch.tensor([2**33, 4])
    m(ids).sum().backward()
    dyn(dyn_ids).sum().backward()
    m.flush()
    dyn.flush()
    saved, saved_dyn = m.weight, dyn.read(dyn_ids)
    path = checkpoint.save(cluster.sess, str(tmp_path / "ckpt"))
    for _ in range(3):
        m(ids).sum().backward()
        dyn(dyn_ids).sum().backward()
    m.flush()
    assert not torch.equal(m.weight, saved)
    checkpoint.restore(cluster.sess, path)
    torch.testing.assert_close(m.weight, saved, rtol=0, atol=0)
    torch.testing.assert_close(m(ids), saved[ids].sum(1), rtol=0, atol=0)
    torch.testing.assert_close(dyn(dyn_ids), saved_dyn, rtol=0, atol=0)


RANKS = textwrap.dedent(
    """
    import sys, numpy as np, torch
    import zmqflow as zf
    from zmqflow.bridge import runtime
    from zmqflow.torch.embedding import EmbeddingBag
    out = sys.argv[1]
    rt = runtime.init()
    rank = rt.rank
    m = EmbeddingBag("shared", 40, 4, mode="sum", optimizer=zf.optim.SGD(0.25))  # both ranks at once
    init = m.weight.numpy()
    rt.ring.barrier()  # every rank read the table before anyone pushes
    gen = torch.Generator().manual_seed(rank)
    grads = np.zeros((40, 4), np.float32)
    for step in range(5):
        ids = torch.randint(0, 40, (8, 3), generator=gen)
        w = torch.randn(8, 4, generator=gen)
        (m(ids) * w).sum().backward()  # linear: the gradient does not depend on what the other rank did
        np.add.at(grads, ids.numpy().reshape(-1), np.repeat(w.numpy(), 3, axis=0))
    m.flush()
    rt.ring.barrier()
    np.savez(f"{out}/rank{rank}.npz", init=init, grads=grads, final=m.weight.numpy())
    print("rank done", rank, flush=True)
    runtime.shutdown()
    """
)


def test_two_ranks_push_to_one_table_under_launch(tmp_path, procs):
    p = launch_script(procs, tmp_path / "ranks.py", RANKS, tmp_path, workers=2, ps=2)
    assert p.wait(100) == 0, p.output
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    np.testing.assert_array_equal(r0["init"], r1["init"])
    np.testing.assert_array_equal(r0["final"], r1["final"])
    assert r0["grads"].any() and r1["grads"].any() and not np.allclose(r0["grads"], r1["grads"])
    expected = r0["init"] - 0.25 * (r0["grads"] + r1["grads"])  # each rank's update applied as pushed
    np.testing.assert_allclose(r0["final"], expected, rtol=1e-5, atol=1e-5)


def test_bench_quick_reports_both_rates():
    bench = pytest.importorskip("zmqflow.bench.torch_embedding")
    row = bench.embedding_rows(quick=True)
    for key in ("zmqflow_rows_per_s", "torch_rows_per_s"):
        assert row[key] > 0
    assert row["ratio"] == pytest.approx(row["zmqflow_rows_per_s"] / row["torch_rows_per_s"])
    assert row["shards"] == 2 and row["batch_ids"] > 0 and 0 < row["unique_ids_per_batch"] <= row["batch_ids"]
    assert "zmqflow" in bench.format_table([row])


def test_prefetched_lookups_of_several_tables_travel_at_once_and_give_the_same_rows(cluster):
    tables = [EmbeddingBag(f"pre{i}", 50, 4, mode="sum", session=cluster.sess) for i in range(3)]
    inputs = [torch.tensor([[1, 2], [3, 1]]) + 10 * i for i in range(3)]
    expected = [t(x).detach() for t, x in zip(tables, inputs)]
    inner = cluster.sess.async_session.call_task
    entered: list[str] = []
    gate = threading.Event()

    async def held(task, service, op, body=None, **kwargs):  # lookups wait at the gate, once entered
        if op == "emb_lookup":
            entered.append(str(task))
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        return await inner(task, service, op, body, **kwargs)

    cluster.sess.async_session.call_task = held
    try:
        starter = threading.Thread(target=lambda: [t.prefetch(x) for t, x in zip(tables, inputs)])
        starter.start()
        starter.join(10)
        assert not starter.is_alive()  # prefetch only starts: a lookup waited for would hang at the gate
        wait_until(lambda: len(entered) == 6, 10, what="every table's lookups in flight at once (3 tables x 2 shards)")
    finally:
        gate.set()
        cluster.sess.async_session.call_task = inner
    got = [t(x) for t, x in zip(tables, inputs)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.detach(), e)
    got[0].sum().backward()  # a prefetched lookup's rows push their gradient like any other
    tables[0].flush()
    assert tables[0].counters["pushes"] == 1
    other = torch.tensor([[4, 5]])
    tables[1].prefetch(inputs[1])  # then called on another tensor: looked up anew
    torch.testing.assert_close(tables[1](other).detach(), tables[1].read(other).sum(1))
