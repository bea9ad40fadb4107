"""Several sharded tables at once from torch: ``zmqflow.torch.prefetch`` sends their lookups in
one request a shard, and ``push_held_many`` (``HybridStrategy.step``) their pushes; each table
sees what its own calls would give."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.embedding import AsyncEmbedding

from .test_torch_embedding import two_shards

torch = pytest.importorskip("torch")
emb_mod = pytest.importorskip("zmqflow.torch.embedding")
grouped = pytest.importorskip("zmqflow.torch.grouped")
EmbeddingBag = emb_mod.EmbeddingBag


@pytest.fixture
def cluster(tmp_path):
    yield from two_shards(tmp_path)


class Ops:
    """The ops the session sends, by wrapping its public call_task."""

    def __init__(self, sess):
        self.sent: list[tuple[str, str]] = []
        self.inner = sess.async_session.call_task
        sess.async_session.call_task = self.call_task

    async def call_task(self, task, service, op, body=None, **kwargs):
        if op.startswith("emb_"):
            self.sent.append((str(task), op))
        return await self.inner(task, service, op, body, **kwargs)

    def take(self) -> list[tuple[str, str]]:
        sent, self.sent = sorted(self.sent), []
        return sent


def bags(sess, prefix: str, push: str = "step"):
    return [EmbeddingBag(f"{prefix}{i}", 40, 4, mode="sum", session=sess, push=push,
                         optimizer=zf.optim.Adagrad(0.1), initializer=zf.init.normal(seed=i)) for i in range(3)]


def test_prefetch_groups_lookups_and_gives_each_table_its_rows(cluster):
    tables = bags(cluster.sess, "g")
    tables[2].eval()  # a table in eval mode is looked up without create, in a request of its own
    inputs = [torch.tensor([[1, 2], [3, 1]]) + 7 * i for i in range(3)]
    with torch.no_grad():
        expected = [t(x) for t, x in zip(tables, inputs)]
    ops = Ops(cluster.sess)
    emb_mod.prefetch(zip(tables, inputs))
    got = [t(x) for t, x in zip(tables, inputs)]  # takes the prefetched rows: no request of its own
    assert ops.take() == sorted([("ps:0", "emb_lookup_many"), ("ps:1", "emb_lookup_many"),
                                 ("ps:0", "emb_lookup"), ("ps:1", "emb_lookup")])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.detach(), e)
    assert [t.counters["lookups"] for t in tables] == [2, 2, 2]
    with pytest.raises(errors.InvalidArgument, match="not a table on the ps shards"):
        emb_mod.prefetch([(torch.nn.EmbeddingBag(4, 2), inputs[0])])


def test_grouped_pushes_update_rows_as_pushes_one_by_one(cluster):
    one, many = bags(cluster.sess, "a"), bags(cluster.sess, "b")
    rng = np.random.default_rng(0)
    ops = Ops(cluster.sess)
    for _ in range(3):
        inputs = [torch.from_numpy(rng.integers(0, 40, (5, 3))) for _ in range(3)]
        for tables in (one, many):
            loss = sum((t(x) ** 2).sum() for t, x in zip(tables, inputs))
            loss.backward()
        for t in one:
            t.push_held()
        for t in one:
            t.synchronize()
        ops.take()
        assert grouped.push_held_many([t.table for t in many]) == [1, 1, 1]
        for t in many:
            t.synchronize()
        assert ops.take() == [("ps:0", "emb_push_many"), ("ps:1", "emb_push_many")]
    for a, b in zip(one, many):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
        assert a.counters == b.counters


def test_a_table_holding_inf_fails_alone_in_a_grouped_push(cluster):
    tables = bags(cluster.sess, "inf")
    before = [t.weight for t in tables]
    x = torch.tensor([[1, 2]])
    for k, t in enumerate(tables):
        rows = t(x)
        (rows * (float("inf") if k == 1 else 1.0)).sum().backward()
    grouped.push_held_many([t.table for t in tables])
    with pytest.raises(errors.InvalidArgument, match="holds inf or NaN"):
        tables[1].synchronize()
    for t in (tables[0], tables[2]):
        t.synchronize()
        assert t.counters["rows_updated"] == 2
    torch.testing.assert_close(tables[1].weight, before[1], rtol=0, atol=0)
    assert not torch.equal(tables[0].weight, before[0])
    assert tables[1].counters["pushes_skipped"] == 1


def test_a_table_a_shard_refuses_fails_alone_in_a_grouped_push(cluster):
    tables = bags(cluster.sess, "refused")
    x = torch.tensor([[1, 2], [3, 4]])
    before = [tables[k].weight for k in (0, 2)]
    for t in tables:
        t(x).sum().backward()
    # the middle table's handle now names a table no shard holds (as if dropped there)
    tables[1].table.handle = AsyncEmbedding(cluster.sess.async_session,
                                            dataclasses.replace(tables[1].table.handle.info, name="gone"))
    grouped.push_held_many([t.table for t in tables])
    with pytest.raises(errors.NotFound, match="gone"):
        tables[1].synchronize()
    for k, b in zip((0, 2), before):
        tables[k].synchronize()
        assert tables[k].counters["rows_updated"] == 4
        assert not torch.equal(tables[k].weight, b)


def test_each_table_s_future_is_settled_whatever_its_siblings_waiters_did():
    """A waiter that gave up (cancelled its table's future) leaves the others to be settled, each
    with its own answer or error; a parent cancelled (its loop gone) cancels them all."""
    parent = concurrent.futures.Future()
    kids = grouped._share(parent, 3)
    kids[1].cancel()
    refused = errors.NotFound("gone")
    parent.set_result([np.ones(2), np.zeros(2), refused])
    np.testing.assert_array_equal(kids[0].result(0), np.ones(2))
    assert kids[1].cancelled() and kids[2].exception(0) is refused
    failed = concurrent.futures.Future()
    kids = grouped._share(failed, 2)
    failed.set_exception(errors.Unavailable("down"))
    assert all(isinstance(k.exception(0), errors.Unavailable) for k in kids)
    gone = concurrent.futures.Future()
    kids = grouped._share(gone, 2)
    gone.cancel()
    assert all(k.cancelled() for k in kids)
