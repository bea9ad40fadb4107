"""Limits of dynamic table parts: a finite default capacity, bounded pending admission, the
shard's byte budget over every part, and step counts kept only where an optimizer reads them."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.server.limits import ServerLimits
from zmqflow.state.limits import StateLimits, table_capacity
from zmqflow.state.store import ShardStore
from zmqflow.state.tables import HashTable
from zmqflow.testing import local_cluster

from .conftest import arun


def cluster(ps: int = 1, **kw):
    return local_cluster({"ps": ps, "worker": 1}, timeout=10, transport="inproc", **kw)


def test_dynamic_tables_have_a_finite_default_capacity():
    async def main():
        async with cluster(limits=ServerLimits(table_capacity=8, max_table_capacity=100)) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("dyn", None, 4)  # no capacity named
                await emb.lookup(np.arange(50))
                table = servers["ps:0"].service("ps").tables[("dyn", 0)]
                assert table.capacity == 8 and len(table) == 8 and len(table.ids) == 8
                with pytest.raises(errors.ResourceExhausted, match="capacity 101 rows of 48 bytes is over the limit of 100 rows"):
                    await sess.embedding("wide", None, 4, capacity=101)
                assert "wide" not in servers["ps:0"].service("catalog").catalog.records
                await sess.embedding("wide", None, 4, capacity=100)

    arun(main())


def test_pending_admission_is_bounded():
    table = HashTable(2, np.dtype("float32"), min_frequency=2, max_pending=100)
    for start in range(0, 1000, 10):
        table.lookup(np.arange(start, start + 10))
    assert len(table.sightings) <= 100 and table.stats()["pending_pruned"] >= 900 - 100
    assert len(table) == 0
    table.lookup(np.array([5000]))
    table.lookup(np.array([5000]))  # seen twice while pending: admitted
    assert len(table) == 1 and 5000 not in table.sightings
    with pytest.raises(errors.InvalidArgument, match="max_pending"):
        HashTable(2, np.dtype("float32"), max_pending=0)


def test_a_dynamic_tables_capacity_fits_the_shards_budget():
    lim = StateLimits(max_shard_bytes=10 << 20)
    row = HashTable.row_size(64, np.dtype("float32"), zf.optim.Adagrad(0.1).spec())
    assert row == 64 * 4 * 2 + HashTable.ROW_OVERHEAD
    assert table_capacity("t", None, row, lim) == (10 << 20) // row  # the default, lowered to fit
    assert table_capacity("t", None, row, StateLimits()) == StateLimits().table_capacity
    assert table_capacity("t", (10 << 20) // row, row, lim) == (10 << 20) // row
    with pytest.raises(errors.ResourceExhausted, match=r"'t': capacity \d+ rows of 544 bytes"):
        table_capacity("t", (10 << 20) // row + 1, row, lim)


def test_dynamic_tables_that_would_fill_together_stop_at_the_shards_budget():
    """Each part's capacity fits the shard alone; two full ones would not. Rows past the budget
    make way as they do at a capacity (least recently used first), so the shard never holds more
    than its limit, and a variable later created beside them is refused by the same count."""
    row = HashTable.row_size(8, np.dtype("float32"))
    budget = 1000 * row  # 64000 bytes
    lim = ServerLimits(max_shard_bytes=budget)

    async def main():
        async with cluster(limits=lim) as servers:
            ps = servers["ps:0"].service("ps")
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                a = await sess.embedding("a", None, 8, capacity=900)
                b = await sess.embedding("b", None, 8, capacity=900, initializer=zf.init.ones())
                await a.lookup(np.arange(800))
                await b.lookup(np.arange(800))  # 200 fit beside a's 800
                assert (await a.size(), await b.size()) == (800, 200)
                await b.lookup(np.arange(1000, 1100))  # room only by b's least recently used
                assert (await a.size(), await b.size()) == (800, 200)
                assert sum(t.nbytes for t in ps.tables.values()) <= budget
                got = await b.lookup(np.arange(1000, 1100), create=False)
                assert np.count_nonzero(got.any(axis=1)) == 100  # the new rows are the ones kept
                with pytest.raises(errors.ResourceExhausted, match=r"variable v: .* over its limit of 64000"):
                    await sess.variable("v", shape=[16])

    arun(main())


@contextlib.asynccontextmanager
async def a_beside_b(budget: int):
    """A session, and two dynamic tables of 8 float32 (``a``, and ``b`` of ones) on one shard
    whose byte budget is ``budget``."""
    async with cluster(limits=ServerLimits(max_shard_bytes=budget)) as servers:
        async with zf.AsyncSession(servers["worker:0"].target) as sess:
            a = await sess.embedding("a", None, 8)
            yield sess, a, await sess.embedding("b", None, 8, initializer=zf.init.ones())


def test_a_dynamic_table_the_budget_leaves_no_row_says_so_instead_of_reading_zeros():
    """One table filled the shard's budget; a second, empty, could never hold a row: its lookups
    read zeros and its pushes were dropped, with nothing said. Now a creating lookup names the
    table and the budget; eval lookups read zeros as before, and the table works once the first
    has made room."""
    row = HashTable.row_size(8, np.dtype("float32"))

    async def main():
        async with a_beside_b(100 * row) as (sess, a, b):
            await a.lookup(np.arange(1000))  # a's least recently used make way: a holds the whole budget
            assert await a.size() == 100
            with pytest.raises(errors.ResourceExhausted, match=r"embedding 'b' \(part 0\): .* budget of "
                                                               rf"{100 * row} bytes .* cannot hold a row"):
                await b.lookup(np.arange(3))
            assert await b.size() == 0 and not (await b.lookup(np.arange(3), create=False)).any()
            assert await a.evict(older_than_seconds=0) == 100  # a gives its rows back
            np.testing.assert_array_equal(await b.lookup(np.arange(3)), np.ones((3, 8), np.float32))

    arun(main())


def test_a_grouped_lookup_refuses_a_table_an_earlier_item_left_without_room():
    """In one request, the first table's new rows take the shard's whole budget: the second, empty,
    is refused when its turn comes, as its own lookup after the first's would be, not left to read
    zeros by a check made before the first had run."""
    async def main():
        async with a_beside_b(100 * HashTable.row_size(8, np.dtype("float32"))) as (sess, a, b):
            with pytest.raises(errors.ResourceExhausted, match=r"embedding 'b' \(part 0\): .* cannot hold"):
                await sess.lookup_many([a, b], [np.arange(1000), np.arange(3)])
            assert await b.size() == 0

    arun(main())


def test_a_dynamic_table_keeps_step_counts_only_for_an_optimizer_that_reads_them():
    """8 B a row (the 4 x float32 row's 16 B is smaller): SGD and Adagrad tables keep none and
    count none; an Adam table keeps, counts and advances one per row."""
    f32 = np.dtype("float32")
    for opt in (None, zf.optim.SGD(0.1).spec(), zf.optim.Adagrad(0.1).spec()):
        t = HashTable(4, f32, optimizer=opt)
        t.lookup(np.arange(10))
        t.push(np.arange(5), np.ones((5, 4), np.float32))
        assert t.steps is None and t.row_bytes == HashTable.row_size(4, f32, opt)
        assert t.nbytes == 10 * (4 * 4 * (1 + len(t.slots)) + HashTable.ROW_OVERHEAD)
    adam = HashTable(4, f32, optimizer=zf.optim.Adam().spec())
    adam.lookup(np.arange(10))
    adam.push(np.arange(5), np.ones((5, 4), np.float32))
    adam.push(np.arange(3), np.ones((3, 4), np.float32))
    at = adam.index.find(np.arange(10), adam.ids)
    assert adam.steps[at].tolist() == [2, 2, 2, 1, 1, 0, 0, 0, 0, 0]
    assert adam.row_bytes == HashTable.row_size(4, f32, zf.optim.Adam().spec()) == 4 * 4 * 3 + HashTable.ROW_OVERHEAD + 8


def test_step_counts_are_kept_and_budgeted_only_for_an_optimizer_that_reads_them():
    """Adam's per-row steps (int64) count towards the shard's byte limit; SGD's part keeps none:
    a 1-D float32 variable would otherwise carry twice its bytes in counters nothing reads."""
    n = 1000
    sgd = ShardStore(StateLimits(max_shard_bytes=4 * n))
    assert sgd.create("w", 0, [n], [0, n], "float32", optimizer=zf.optim.SGD(0.1).spec())
    assert sgd.get("w").steps is None and sgd.nbytes == 4 * n
    budget = 4 * n * 3 + 8 * n  # value, m and v, and one step count a row
    adam = ShardStore(StateLimits(max_shard_bytes=budget - 1))
    with pytest.raises(errors.ResourceExhausted, match=f"its {budget} bytes .value, optimizer slots, step counts."):
        adam.create("w", 0, [n], [0, n], "float32", optimizer=zf.optim.Adam().spec())
    assert not adam.parts
    adam = ShardStore(StateLimits(max_shard_bytes=budget))
    assert adam.create("w", 0, [n], [0, n], "float32", optimizer=zf.optim.Adam().spec())
    assert adam.get("w").steps.shape == (n,) and adam.nbytes == budget


def test_saved_step_counts_load_into_a_table_whose_optimizer_reads_none():
    """A checkpoint written with step counts restores into an SGD table: rows and values back,
    the counts not kept."""
    t = HashTable(2, np.dtype("float32"), optimizer=zf.optim.SGD(0.1).spec())
    assert t.load(np.array([7, 9]), np.ones((2, 2), np.float32), {}, np.array([3, 4])) == 2
    assert t.steps is None and len(t) == 2
    assert (t.values[t.index.find(np.array([7, 9]), t.ids)] == 1).all()
