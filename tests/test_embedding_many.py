"""Several tables in one request a shard (``lookup_many``, ``push_many``): the same answers and the
same rows, bit for bit, as one table at a time; one message a shard; and nothing changed by a
refused request, on the client or on the shard."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client import embedding_many
from zmqflow.client.embedding import AsyncEmbedding
from zmqflow.cluster import TaskId
from zmqflow.testing import local_cluster
from zmqflow.wire.requests import ps as rq

from .conftest import arun

SHARDS = ("ps:0", "ps:1", "ps:2")


def cluster():
    return local_cluster({"ps": 3, "worker": 1}, timeout=10, transport="inproc")


async def tables(sess, prefix: str) -> list:
    """A model's worth of tables: static mod and div over 3 shards, one on a single shard, a
    float64 one, and a dynamic one (rows made on first sight)."""
    adagrad = zf.optim.Adagrad(0.1)
    return [
        await sess.embedding(f"{prefix}mod", 40, 4, initializer=zf.init.normal(seed=1), optimizer=adagrad),
        await sess.embedding(f"{prefix}div", 31, 3, partition_strategy="div", initializer=zf.init.normal(seed=2),
                             optimizer=zf.optim.SGD(0.5)),
        await sess.embedding(f"{prefix}one", 9, 2, partitions=1, initializer=zf.init.normal(seed=3), optimizer=adagrad),
        await sess.embedding(f"{prefix}f64", 20, 5, dtype="float64", initializer=zf.init.normal(seed=4),
                             optimizer=zf.optim.Adam(0.01)),
        await sess.embedding(f"{prefix}dyn", None, 4, initializer=zf.init.normal(seed=5), optimizer=adagrad),
    ]


def batch(rng: np.random.Generator) -> list[np.ndarray]:
    """Ids for each of :func:`tables`: repeats, any shape, unsorted, one empty."""
    return [rng.integers(0, 40, (6, 5)), rng.integers(0, 31, 17), np.zeros(0, np.int64),
            rng.integers(0, 20, (3, 3)).astype(np.int32), rng.integers(-2**40, 2**40, 12)]


@contextlib.asynccontextmanager
async def model(*prefixes: str):
    """(the servers, a session, the tables of :func:`tables` under each prefix)."""
    async with cluster() as servers:
        async with zf.AsyncSession(servers["worker:0"].target) as sess:
            yield servers, sess, [await tables(sess, p) for p in prefixes]


def msgs(servers) -> dict[str, int]:
    return {t: servers[t].counters.msgs_in for t in SHARDS}


def test_lookup_many_is_each_tables_lookup_in_one_message_a_shard():
    async def main():
        async with model("") as (servers, sess, [embs]):
            rng = np.random.default_rng(0)
            ids = batch(rng)
            ids[4] = np.concatenate([ids[4], ids[4][:3]])
            for _ in range(2):  # the dynamic table's rows are made by the first
                before = msgs(servers)
                many = await sess.lookup_many(embs, ids)
                sent = {t: servers[t].counters.msgs_in - before[t] for t in SHARDS}
                assert sent == {t: 1 for t in SHARDS}, sent
                for emb, x, got in zip(embs, ids, many):
                    want = await emb.lookup(x)
                    assert got.shape == (*np.shape(x), emb.dim) and got.dtype == want.dtype
                    np.testing.assert_array_equal(got, want)
                    assert got.flags.writeable
            # one table twice, and a table alone: still what its own lookup gives
            twice = await sess.lookup_many([embs[0], embs[0]], [ids[0], ids[0][:1]])
            np.testing.assert_array_equal(twice[1], await embs[0].lookup(ids[0][:1]))
            alone = await sess.lookup_many([embs[2]], [[4, 1, 4]])
            np.testing.assert_array_equal(alone[0], await embs[2].lookup([4, 1, 4]))

    arun(main())


def test_lookup_many_without_create_makes_no_rows():
    async def main():
        async with model("") as (servers, sess, [embs]):
            got = await sess.lookup_many([embs[4], embs[0]], [[5, 6, 7], [1]], create=False)
            np.testing.assert_array_equal(got[0], np.zeros((3, 4), np.float32))
            assert await embs[4].size() == 0

    arun(main())


def test_push_many_updates_rows_as_pushes_one_by_one():
    async def main():
        async with model("a/", "b/") as (servers, sess, [one, many]):
            rng = np.random.default_rng(1)
            for step in range(3):
                ids = batch(rng)
                if step == 0:  # the dynamic tables' rows exist before their first gradient
                    await one[4].lookup(ids[4]), await many[4].lookup(ids[4])
                grads = [rng.standard_normal((*np.shape(x), e.dim)).astype(e.info.dtype)
                         for x, e in zip(ids, one)]
                singly = [await e.push(x, g, step=step) for e, x, g in zip(one, ids, grads)]
                before = msgs(servers)
                together = await sess.push_many(many, ids, grads, step=step)
                assert {t: servers[t].counters.msgs_in - before[t] for t in SHARDS} == {t: 1 for t in SHARDS}
                assert together == singly
            for a, b in zip(one, many):
                rows_a = dict((int(i), r) for ids, rows in [p async for p in a.export()] for i, r in zip(ids, rows))
                rows_b = dict((int(i), r) for ids, rows in [p async for p in b.export()] for i, r in zip(ids, rows))
                assert rows_a.keys() == rows_b.keys()
                for i in rows_a:
                    np.testing.assert_array_equal(rows_a[i], rows_b[i])

    arun(main())


def test_client_refusals_send_nothing():
    async def main():
        async with model("") as (servers, sess, [embs]):
            good = [np.array([1, 2]), np.array([3])]
            grads = [np.ones((2, 4), np.float32), np.ones((1, 3), np.float32)]
            before = msgs(servers)
            cases = [
                (sess.lookup_many(embs[:2], good[:1]), "2 tables but 1 id arrays"),
                (sess.lookup_many(embs[0], good), "a sequence of embedding tables"),
                (sess.lookup_many([], []), "no tables"),
                (sess.lookup_many(embs[:2], [good[0], np.array([31])]), "id 31 out of range"),
                (sess.lookup_many(embs[:2], [good[0], np.array([1.5])]), "lookup_many of 'div'"),
                (sess.push_many(embs[:2], good, grads[:1]), "2 tables but 1 gradient arrays"),
                (sess.push_many(embs[:2], good, [grads[0], np.ones((1, 4), np.float32)]), "shape [1, 3]"),
                (sess.push_many(embs[:2], good, [grads[0], np.ones((1, 3), np.float64)]), "must be float32"),
                (sess.push_many(embs[:2], good, grads, step=-1), "step must be an integer >= 0"),
            ]
            for call, message in cases:
                with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
                    await call
            assert msgs(servers) == before
            async with zf.AsyncSession(servers["worker:0"].target) as other:
                theirs = await other.get_embedding("mod")
                with pytest.raises(errors.InvalidArgument, match="another session's handle"):
                    await sess.lookup_many([embs[0], theirs], good)

    arun(main())


def test_a_shard_checks_every_item_before_it_changes_any():
    """Requests the client would never send, sent raw: an item that fails leaves the ones before
    it undone (a lookup with create changes a dynamic table; a push changes rows)."""
    async def main():
        async with model("") as (servers, sess, [embs]):
            task = TaskId.parse(embs[2].partitions[0]["task"])
            dyn_part = next(p for p, t in enumerate(embs[4].partitions) if t["task"] == str(task))
            mod_part = next(p for p, t in enumerate(embs[0].partitions) if t["task"] == str(task))
            ids = np.array([7, 8, 9])
            looks = [rq.LookupItem(name="dyn", part=dyn_part, ids=ids)]
            for bad, error in ([rq.LookupItem(name="nope", part=0, ids=ids)], errors.NotFound), \
                              ([rq.LookupItem(name="mod", part=mod_part, ids=np.array([99]))],
                               errors.InvalidArgument):
                with pytest.raises(error):
                    await sess.call_task(task, "ps", "emb_lookup_many", rq.EmbLookupMany(items=looks + bad))
            assert (await embs[4].stats())[dyn_part]["rows"] == 0
            row = (await embs[0].lookup([3 * mod_part]))[0]
            push = rq.PushItem(name="mod", part=mod_part, ids=np.array([0]), grads=np.ones((1, 4), np.float32))
            bads = [rq.PushItem(name="one", part=0, ids=np.array([1]), grads=np.ones((1, 3), np.float32)),
                    rq.PushItem(name="dyn", part=dyn_part, ids=ids, grads=np.ones((3, 4), np.float64)),
                    rq.PushItem(name="one", part=0, ids=np.array([-1]), grads=np.ones((1, 2), np.float32))]
            for bad in bads:
                with pytest.raises(errors.InvalidArgument):
                    await sess.call_task(task, "ps", "emb_push_many", rq.EmbPushMany(items=[push, bad]))
            np.testing.assert_array_equal((await embs[0].lookup([3 * mod_part]))[0], row)
            with pytest.raises(errors.InvalidArgument, match="items"):
                await sess.call_task(task, "ps", "emb_push_many", rq.EmbPushMany(items=[]))

    arun(main())


def test_blocking_session_many():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10) as servers:
            await asyncio.to_thread(blocking, servers["worker:0"].target)

    def blocking(target):
        with zf.Session(target) as sess:
            a = sess.embedding("a", 10, 2, initializer=zf.init.normal(seed=1))
            b = sess.embedding("b", 12, 3, initializer=zf.init.normal(seed=2))
            got = sess.lookup_many([a, b], [[1, 2], [[3], [4]]])
            np.testing.assert_array_equal(got[0], a.lookup([1, 2]))
            np.testing.assert_array_equal(got[1], b.lookup([[3], [4]]))
            assert sess.push_many([a, b], [[1, 1], [3]], [np.ones((2, 2), np.float32), np.ones((1, 3), np.float32)]) \
                == [1, 1]
            with pytest.raises(errors.InvalidArgument, match="a sequence of embedding tables"):
                sess.lookup_many(a, [[1]])

    arun(main())


def test_more_parts_than_a_request_holds_go_in_several(monkeypatch):
    monkeypatch.setattr(rq, "MAX_TABLE_ITEMS", 2)

    async def main():
        async with model("") as (servers, sess, [embs]):
            one_shard = [embs[2]] * 5  # five items for the one shard that holds "one"
            ids = [[k % 9, (k + 4) % 9] for k in range(5)]
            sent, call = [], sess.call_task

            async def recorded(task, service, op, body=None, **kw):
                sent.append((op, len(body.items) if op.endswith("_many") else 1))
                return await call(task, service, op, body, **kw)

            sess.call_task = recorded
            got = await sess.lookup_many(one_shard, ids)
            assert sent == [("emb_lookup_many", 2), ("emb_lookup_many", 2), ("emb_lookup", 1)]
            for x, rows in zip(ids, got):
                np.testing.assert_array_equal(rows, await embs[2].lookup(x))
            sent.clear()
            pushed = await sess.push_many(one_shard, ids, [np.ones((2, 2), np.float32)] * 5)
            assert pushed == [2] * 5 and [n for _, n in sent] == [2, 2, 1]

    arun(main())


def test_a_table_a_shard_refuses_fails_alone():
    """A part the shard does not hold (a table dropped there) fails its table only: the request
    it shared was refused whole, changing nothing, and its items went again one by one."""
    async def main():
        async with model("a/", "b/") as (servers, sess, [one, many]):
            ghost = AsyncEmbedding(sess, dataclasses.replace(many[0].info, name="ghost"))
            ids = [np.array([1, 2, 5]), np.array([3, 4]), np.array([0, 7])]
            grads = [np.ones((3, 4), np.float32), np.ones((2, 4), np.float32), np.ones((2, 3), np.float32)]
            got = await embedding_many.push_each(sess, [many[0], ghost, many[1]], ids, grads)
            assert isinstance(got[1], errors.NotFound) and "ghost" in str(got[1])
            assert got[0] == await one[0].push(ids[0], grads[0]) and got[2] == await one[1].push(ids[2], grads[2])
            for a, b, x in ((one[0], many[0], ids[0]), (one[1], many[1], ids[2])):
                np.testing.assert_array_equal(await a.lookup(x), await b.lookup(x))
            with pytest.raises(errors.NotFound, match="ghost"):
                await sess.lookup_many([many[0], ghost], ids[:2])
            rows = await embedding_many.lookup_each(sess, [ghost, many[0]], ids[:2])
            assert isinstance(rows[0], errors.NotFound)
            np.testing.assert_array_equal(rows[1], await many[0].lookup(ids[1]))

    arun(main())
