"""Embedding tables: static (mod/div) and dynamic, lookups, sparse pushes, admission, eviction."""

from __future__ import annotations

import asyncio
import datetime

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.testing import local_cluster

from .conftest import arun


def tf_owner(i: int, n: int, parts: int, strategy: str) -> tuple[int, int]:
    """TF's embedding_lookup assignment, written out id by id."""
    if strategy == "mod":
        return i % parts, i // parts
    ids_per, extras = divmod(n, parts)
    if i < extras * (ids_per + 1):
        return i // (ids_per + 1), i % (ids_per + 1)
    j = i - extras * (ids_per + 1)
    return extras + j // ids_per, j % ids_per


def cluster(ps: int = 3, **kw):
    return local_cluster({"ps": ps, "worker": 1}, timeout=10, transport="inproc", **kw)


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_static_lookup_follows_tf_and_equals_a_reference(strategy):
    async def main():
        async with cluster() as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("t", 23, 5, partition_strategy=strategy, initializer=zf.init.normal(seed=7))
                full = np.empty((23, 5), np.float32)
                async for ids, rows in emb.export():
                    full[ids] = rows
                for i in range(23):  # each id is where TF would put it
                    part, row = tf_owner(i, 23, 3, strategy)
                    task = emb.partitions[part]["task"]
                    stored = servers[task].service("ps").store.get("t", part).value[row]
                    np.testing.assert_array_equal(stored, full[i])
                for ids in ([3], [[0, 22], [5, 5]], np.array([[[1, 2, 2, 1]]]), np.arange(23)[::-1]):
                    np.testing.assert_array_equal(await emb.lookup(ids), full[np.asarray(ids)])
                empty = await emb.lookup(np.zeros((0, 3), np.int64))
                assert empty.shape == (0, 3, 5)

    arun(main())


def test_lookup_contacts_only_the_shards_that_own_ids():
    async def main():
        async with cluster() as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("t", 30, 4)  # mod over 3 shards
                counts = {t: servers[t].counters.msgs_in for t in ("ps:0", "ps:1", "ps:2")}
                await emb.lookup([0, 3, 6, 3, 0, 27])  # every id is 0 mod 3
                owner = emb.partitions[0]["task"]
                after = {t: servers[t].counters.msgs_in - counts[t] for t in counts}
                assert after[owner] == 1
                assert sum(after.values()) == 1
                await emb.push([1, 4, 1], np.ones((3, 4), np.float32))
                after = {t: servers[t].counters.msgs_in - counts[t] for t in counts}
                assert after[emb.partitions[1]["task"]] == 1 and sum(after.values()) == 2

    arun(main())


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_lookup_sparse_combiners(combiner):
    async def main():
        async with cluster(ps=2) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("t", 10, 3, initializer=zf.init.uniform(-1, 1, seed=2), dtype="float64")
                full = await emb.lookup(np.arange(10))
                ids = np.array([1, 3, 3, 7, 2, 9])
                seg = np.array([0, 0, 0, 1, 3, 3])
                w = np.array([1.0, 2.0, 0.5, 3.0, 1.0, -0.25])
                got = await emb.lookup_sparse(ids, seg, w, combiner=combiner)
                expected = np.zeros((4, 3))
                for s in range(4):
                    m = seg == s
                    if not m.any():
                        continue
                    total = (full[ids[m]] * w[m, None]).sum(0)
                    norm = {"sum": 1.0, "mean": w[m].sum(), "sqrtn": np.sqrt((w[m] ** 2).sum())}[combiner]
                    expected[s] = total / norm
                np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
                assert not got[2].any()  # an empty segment is zero

    arun(main())


def test_lookup_sparse_of_a_batch_matches_a_sum_id_by_id():
    """Many ids, repeated, in unsorted segments of unsigned type, some segments empty, weighted or
    not: each combiner agrees with np.add.at, a sum one id at a time."""
    async def main():
        async with cluster(ps=2) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("b", 300, 8, initializer=zf.init.uniform(-1, 1, seed=4), dtype="float32")
                full = (await emb.lookup(np.arange(300))).astype(np.float64)
                rng = np.random.default_rng(9)
                ids = rng.integers(0, 300, 2000)
                seg = rng.integers(0, 150, 2000).astype(np.uint32)
                seg[seg == 7] = 8  # segment 7 stays empty
                for w, combiner in [(rng.standard_normal(2000), c) for c in ("sum", "mean", "sqrtn")] + [
                        (None, c) for c in ("sum", "mean", "sqrtn")]:  # unweighted: rows summed from the unique ones
                    got = await emb.lookup_sparse(ids, seg, w, combiner=combiner, num_segments=160)
                    w = np.ones(2000) if w is None else w
                    total, norm = np.zeros((160, 8)), np.zeros(160)
                    np.add.at(total, seg, full[ids] * w[:, None])
                    np.add.at(norm, seg, w if combiner != "sqrtn" else w * w)
                    norm = np.ones(160) if combiner == "sum" else norm if combiner == "mean" else np.sqrt(norm)
                    want = np.divide(total, norm[:, None], out=np.zeros_like(total), where=norm[:, None] != 0)
                    assert got.dtype == np.float32 and got.shape == (160, 8)
                    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-6)
                    assert not got[7].any() and not got[150:].any()
                assert (await emb.lookup_sparse([], [], combiner="mean", num_segments=3)).shape == (3, 8)

    arun(main())


@pytest.mark.parametrize("ps", [1, 2])
def test_a_lookup_of_sorted_unique_ids_gives_the_callers_own_rows(ps):
    """Ids already unique and sorted skip the grouping: the rows are the same, writable, and the
    caller's own (changing them changes neither the table nor the next lookup)."""
    async def main():
        async with cluster(ps=ps) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("s", 20, 4, initializer=zf.init.uniform(-1, 1, seed=3))
                ids = np.array([[1, 4], [9, 17]])
                first = await emb.lookup(ids)
                mixed = await emb.lookup(np.array([[17, 4], [9, 1]]))
                assert first.shape == (2, 2, 4) and first.flags.writeable
                np.testing.assert_array_equal(first[1, 1], mixed[0, 0])
                np.testing.assert_array_equal(first[0, 0], mixed[1, 1])
                kept = first.copy()
                first[...] = 0
                np.testing.assert_array_equal(await emb.lookup(ids), kept)

    arun(main())


def test_sparse_push_touches_only_its_rows_and_slots():
    async def main():
        async with cluster() as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("t", 12, 2, dtype="float64", initializer=zf.init.normal(seed=1),
                                           optimizer=zf.optim.Adagrad(0.5))
                before = await emb.lookup(np.arange(12))
                slots_before = {p: servers[t["task"]].service("ps").store.get("t", p).slots["accumulator"].copy()
                                for p, t in enumerate(emb.partitions)}
                ids = np.array([[4, 1], [4, 10]])
                grads = np.arange(8, dtype=np.float64).reshape(2, 2, 2)
                assert await emb.push(ids, grads) == 3  # unique rows updated
                after = await emb.lookup(np.arange(12))
                summed = {4: grads[0, 0] + grads[1, 0], 1: grads[0, 1], 10: grads[1, 1]}
                for i in range(12):
                    if i in summed:
                        acc = 0.1 + summed[i] ** 2
                        np.testing.assert_allclose(after[i], before[i] - 0.5 * summed[i] / np.sqrt(acc), rtol=1e-12)
                    else:
                        np.testing.assert_array_equal(after[i], before[i])
                for p, t in enumerate(emb.partitions):
                    acc = servers[t["task"]].service("ps").store.get("t", p).slots["accumulator"]
                    touched = [i // 3 for i in summed if i % 3 == p]
                    untouched = [r for r in range(len(acc)) if r not in touched]
                    np.testing.assert_array_equal(acc[untouched], slots_before[p][untouched])

    arun(main())


def test_bad_input_is_refused_and_changes_nothing():
    async def main():
        async with cluster(ps=2) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("t", 8, 2, initializer=zf.init.ones())
                with pytest.raises(errors.InvalidArgument, match=r"id 8 out of range \[0, 8\)"):
                    await emb.lookup([1, 8])
                with pytest.raises(errors.InvalidArgument, match=r"id -1 out of range"):
                    await emb.push([-1], np.ones((1, 2), np.float32))
                with pytest.raises(errors.InvalidArgument, match=r"shape \[2, 2\], got \[2, 3\]"):
                    await emb.push([1, 2], np.ones((2, 3), np.float32))
                with pytest.raises(errors.InvalidArgument, match="float32, got float64"):
                    await emb.push([1], np.ones((1, 2)))
                with pytest.raises(errors.InvalidArgument, match="integers"):
                    await emb.lookup([1.5])
                with pytest.raises(errors.VariableConflict):
                    await sess.embedding("t", 9, 2)
                with pytest.raises(errors.InvalidArgument, match="partition_strategy"):
                    await sess.embedding("u", 9, 2, partition_strategy="zig")
                assert await emb.push([], np.zeros((0, 2), np.float32)) == 0
                np.testing.assert_array_equal(await emb.lookup(np.arange(8)), np.ones((8, 2), np.float32))

    arun(main())


def test_dynamic_table_creation_admission_and_export():
    async def main():
        async with cluster(ps=2) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                big = [2**62 + 5, -(2**40), 7]
                dyn = await sess.embedding("d", None, 3, initializer=zf.init.normal(seed=4))
                assert not (await dyn.lookup(big, create=False)).any() and await dyn.size() == 0
                first = await dyn.lookup(big)
                assert await dyn.size() == 3 and first.any()
                np.testing.assert_array_equal(await dyn.lookup(big), first)
                exported = {}
                async for ids, rows in dyn.export():
                    exported.update({int(i): r for i, r in zip(ids, rows)})
                assert sorted(exported) == sorted(big)
                np.testing.assert_array_equal(np.stack([exported[i] for i in big]), first)

                adm = await sess.embedding("adm", None, 2, min_frequency=3, initializer=zf.init.ones(), optimizer=zf.optim.SGD(1.0))
                for seen in range(1, 3):
                    assert not (await adm.lookup([11])).any()
                    assert await adm.push([11], np.ones((1, 2), np.float32)) == 0  # dropped: not admitted
                assert (await adm.lookup([11]) == 1.0).all()  # third sighting creates it
                assert await adm.push([11], np.ones((1, 2), np.float32)) == 1
                assert (await adm.lookup([11]) == 0.0).all()
                stats = await adm.stats()
                assert sum(s["dropped_pushes"] for s in stats) == 2

    arun(main())


def test_dynamic_table_lru_capacity_and_eviction_by_age():
    async def main():
        async with cluster(ps=1) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                lru = await sess.embedding("lru", None, 2, capacity=3, initializer=zf.init.ones())
                await lru.lookup([1, 2, 3])
                await lru.lookup([1])  # 2 is now the least recently used, then 3
                await lru.lookup([4])
                ids = [int(i) for i, _ in [(i, r) async for page in lru.export() for i, r in zip(*page)]]
                assert sorted(ids) == [1, 3, 4]
                await lru.lookup([5, 6])
                ids = sorted(int(i) for page in [p async for p in lru.export()] for i in page[0])
                assert ids == [4, 5, 6] and await lru.size() == 3
                assert (await lru.stats())[0]["evicted"] == 3

                aged = await sess.embedding("aged", None, 2, optimizer=zf.optim.SGD(0.1))
                await aged.lookup([1, 2, 3])
                for _ in range(5):
                    await aged.push([1], np.ones((1, 2), np.float32))
                assert await aged.evict(older_than=3) == 2  # 2 and 3 not updated in the last 3 pushes
                assert sorted(int(i) for p in [x async for x in aged.export()] for i in p[0]) == [1]
                assert await aged.evict(datetime.timedelta(seconds=3600)) == 0
                assert await aged.evict(older_than_seconds=0.0) == 1  # every row was updated before now
                assert await aged.size() == 0
                with pytest.raises(errors.InvalidArgument, match="static"):
                    static = await sess.embedding("static", 4, 2)
                    await static.evict(older_than=1)

    arun(main())


def test_two_workers_train_a_click_model_well_below_the_baseline():
    rng = np.random.default_rng(0)
    users, items, dim = 200, 100, 4
    true_u = rng.normal(0, 1, (users, dim))
    true_i = rng.normal(0, 1, (items, dim))

    def batch(r, n=256):
        u = r.integers(0, users, n)
        i = r.integers(0, items, n)
        p = 1 / (1 + np.exp(-(true_u[u] * true_i[i]).sum(1)))
        return u, i, (r.random(n) < p).astype(np.float64)

    test_u, test_i, test_y = batch(np.random.default_rng(99), 4000)
    base = test_y.mean()
    baseline = -np.mean(test_y * np.log(base) + (1 - test_y) * np.log(1 - base))
    p_true = 1 / (1 + np.exp(-(true_u[test_u] * true_i[test_i]).sum(1)))
    bayes = -np.mean(test_y * np.log(p_true) + (1 - test_y) * np.log(1 - p_true))  # the generating model's own loss

    async def main():
        async with local_cluster({"ps": 2, "worker": 2}, timeout=10, transport="inproc") as servers:
            spec = servers["ps:0"].spec

            async def worker(idx):
                async with zf.AsyncSession(cluster=spec, task=f"worker:{idx}") as sess:
                    opt = zf.optim.Adagrad(0.5)
                    ue = await sess.embedding("user", users, dim, initializer=zf.init.normal(0.5, seed=1), optimizer=opt, dtype="float64")
                    ie = await sess.embedding("item", items, dim, initializer=zf.init.normal(0.5, seed=2), optimizer=opt, dtype="float64")
                    r = np.random.default_rng(idx + 1)
                    for _ in range(300):
                        u, i, y = batch(r)
                        eu, ei = await asyncio.gather(ue.lookup(u), ie.lookup(i))
                        p = 1 / (1 + np.exp(-(eu * ei).sum(1)))
                        d = (p - y)[:, None]  # per-example log-loss gradients, summed per row by push
                        await asyncio.gather(ue.push(u, d * ei), ie.push(i, d * eu))

            await asyncio.gather(worker(0), worker(1))
            async with zf.AsyncSession(cluster=spec, task="worker:0") as sess:
                ue, ie = await sess.get_embedding("user"), await sess.get_embedding("item")
                eu, ei = await ue.lookup(test_u), await ie.lookup(test_i)
                p = np.clip(1 / (1 + np.exp(-(eu * ei).sum(1))), 1e-7, 1 - 1e-7)
                return -np.mean(test_y * np.log(p) + (1 - test_y) * np.log(1 - p))

    loss = arun(main(), timeout=120)
    print(f"test log-loss {loss:.3f}; base-rate baseline {baseline:.3f}; generating model {bayes:.3f}")
    assert loss < bayes + 0.3 * (baseline - bayes), (loss, baseline, bayes)
