"""Pushes that would be merged, counted twice or left uncounted: refused or counted as one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.rpc import CallContext
from zmqflow.testing import local_cluster

from .conftest import arun


def test_a_push_with_two_gradients_for_one_part_is_refused_whole_by_the_shard():
    """Same rows twice (one overwrote the other), overlapping rows (both applied), two sparse
    items (the last won), sparse beside dense: refused, naming the variable, nothing applied."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"].service("ps")
            ctx = CallContext("ps", "push", b"peer", "worker:0", None)
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("a", np.zeros(2, np.float32))
                await sess.variable("d", np.zeros(4, np.float32))
                await sess.variable("s", np.zeros((4, 2), np.float32))
                one, rows = np.ones(4, np.float32), np.ones((2, 2), np.float32)
                first = ["a", 0, None, None, np.ones(2, np.float32)]  # applied by no refused push
                bad = [
                    dict(dense=[first, ["d", 0, None, None, one], ["d", 0, None, None, 2 * one]]),
                    dict(dense=[first, ["d", 0, 0, 4, one], ["d", 0, 0, 2, one[:2]]]),
                    dict(dense=[first, ["d", 0, 2, 4, one[:2]], ["d", 0, 0, 3, one[:3]]]),
                    dict(dense=[first], sparse=[["s", 0, np.array([0, 1]), rows], ["s", 0, np.array([2, 3]), rows]]),
                    dict(dense=[first, ["s", 0, None, None, np.ones((4, 2), np.float32)]],
                         sparse=[["s", 0, np.array([0, 1]), rows]]),
                ]
                for body in bad:
                    with pytest.raises(errors.InvalidArgument, match=r"push names variable (d|s) twice"):
                        ps.push(ctx, **body)
                for name in ("a", "d", "s"):
                    assert not ps.store.get(name).value.any()
                ps.push(ctx, dense=[["d", 0, 0, 2, one[:2]], ["d", 0, 2, 4, 2 * one[:2]]])  # apart: both apply
                np.testing.assert_array_equal(ps.store.get("d").value, [1, 1, 2, 2])

    arun(main())


def test_a_session_refuses_two_keys_for_one_variable_before_sending_anything():
    """Two handles of one variable, or its name beside a handle, where the handles' gradients
    were merged by the shard and the name's was dropped by the session's own dict."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("e", shape=(4, 2))
                other = await sess.variable("other", shape=(2,))
                h1, h2 = await sess.get("e"), await sess.get("e")
                r = np.ones((1, 2), np.float32)
                for grads in ({other: np.ones(2, np.float32), h1: (np.array([0]), r), h2: (np.array([3]), r)},
                              {other: np.ones(2, np.float32), "e": np.ones((4, 2), np.float32),
                               h2: np.ones((4, 2), np.float32)}):
                    with pytest.raises(errors.InvalidArgument, match="push names variable 'e' twice"):
                        await sess.push(grads)
                assert not (await h1.read()).any() and not (await other.read()).any()
                await sess.push({h1: (np.array([0]), r), other: np.ones(2, np.float32)})
                assert (await h2.read())[0].tolist() == [1, 1]

    arun(main())


def test_a_sparse_sync_gradient_counts_its_replica_on_every_part_its_rows_miss():
    """Rows on one part only, or none at all: the other parts still hear from the replica
    (as absent), so their step completes instead of waiting for it until the deadline."""
    async def main():
        async with local_cluster({"ps": 2, "worker": 2}, timeout=10, transport="inproc") as servers:
            a = zf.AsyncSession(servers["worker:0"].target, name="worker:0")
            b = zf.AsyncSession(servers["worker:1"].target, name="worker:1")
            try:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                va = await a.variable("emb", shape=(8, 2), optimizer=opt, partitioner=zf.fixed_size_partitioner(2))
                vb = await b.get("emb")
                got = await asyncio.gather(
                    a.push({va: (np.array([1]), np.ones((1, 2), np.float32))}, step=0, timeout=5),
                    b.push({vb: (np.array([1, 6]), np.ones((2, 2), np.float32))}, step=0, timeout=5))
                assert got == [1, 1]
                want = np.zeros((8, 2), np.float32)
                want[1], want[6] = -1.0, -0.5  # row 6: one replica's gradient, averaged over two
                np.testing.assert_array_equal(await va.read(), want)
                empty = (np.zeros(0, np.int64), np.zeros((0, 2), np.float32))
                row6 = (np.array([6]), np.ones((1, 2), np.float32))
                got = await asyncio.gather(a.push({va: empty}, step=1, timeout=5),
                                           b.push({vb: row6}, step=1, timeout=5))
                assert got == [2, 2]
                want[6] -= 0.5
                np.testing.assert_array_equal(await vb.read(), want)
            finally:
                await a.close()
                await b.close()

    arun(main())


def test_a_replica_that_pushes_again_after_its_deadline_is_counted_once():
    """Its retry used to count as a second replica and complete a two-replica step alone; now
    it waits for the step like the first push, and names the replica still missing."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 2}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"].service("ps")
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                await sess.variable("w", np.zeros(2, np.float32), optimizer=opt)
            loop = asyncio.get_running_loop()
            body = dict(dense=[["w", 0, None, None, np.ones(2, np.float32)]], step=0)
            for _ in range(2):  # the push, then its retry
                ctx = CallContext("ps", "push", b"a", "worker:0", loop.time() + 0.5)
                with pytest.raises(errors.DeadlineExceeded, match="1 of 2 gradients arrived; no push from worker:1"):
                    await ps.push(ctx, **body)
            part = ps.store.get("w")
            assert part.sync.step == 0 and part.sync.contributors == ["worker:0"] and part.sync.dropped == 1
            other = CallContext("ps", "push", b"b", "worker:1", None)
            assert ps.push(other, **body)["replicas"] == ["worker:0", "worker:1"]
            np.testing.assert_array_equal(part.value, -np.ones(2, np.float32))

    arun(main())


def test_a_sync_half_variable_rounds_once_with_the_update():
    """The float32 mean of -2.797 and -0.3972 rounded to float16 first, then applied, gave -1.152
    where the update rounded once gives -1.151 (with SGD(0.1) from -1.312)."""
    grads = [np.float16(-2.797), np.float16(-0.3972)]
    mean = (np.float32(grads[0]) + np.float32(grads[1])) / np.float32(2)
    want = np.float16(np.float32(np.float16(-1.312)) - np.float32(0.1) * mean)
    assert want != np.float16(np.float32(np.float16(-1.312)) - np.float32(0.1) * np.float32(np.float16(mean)))

    async def main():
        async with local_cluster({"ps": 1, "worker": 2}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"].service("ps")
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(0.1), replicas_to_aggregate=2)
                await sess.variable("w", np.full(2, -1.312, np.float16), optimizer=opt)
            answers = [ps.push(CallContext("ps", "push", who.encode(), who, None),
                               dense=[["w", 0, None, None, np.full(2, g, np.float16)]], step=0)
                       for who, g in zip(("worker:0", "worker:1"), grads)]
            assert asyncio.iscoroutine(answers[0]) and not asyncio.iscoroutine(answers[1])  # the first waits
            assert (await answers[0])["replicas"] == answers[1]["replicas"] == ["worker:0", "worker:1"]
            np.testing.assert_array_equal(ps.store.get("w").value, np.full(2, want, np.float16))

    arun(main())


def test_an_optimizer_on_an_integer_variable_is_refused_before_anything_is_recorded():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                with pytest.raises(errors.InvalidArgument, match="variable 'i' is int32: the sgd optimizer"):
                    await sess.variable("i", np.zeros(4, np.int32), optimizer=zf.optim.SGD(0.5))
                assert await sess.variables() == [] and servers["ps:0"].service("ps").store.parts == {}
                with pytest.raises(errors.InvalidArgument, match="variable i is int32"):  # the shard checks too
                    await sess.call("ps", "create", {"name": "i", "part": 0, "shape": [4], "rows": [0, 4],
                                                     "dtype": "int32", "optimizer": {"kind": "sgd"}}, task="ps:0")
                counter = await sess.variable("i", np.zeros(4, np.int32))  # a plain add is fine
                await counter.push(np.ones(4, np.int32))
                assert (await counter.read()).tolist() == [1, 1, 1, 1]

    arun(main())


def test_a_variable_declared_again_with_another_optimizer_conflicts():
    """Where it attached, and its pushes ran the first declaration's optimizer (a plain add)."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("w", np.zeros(2, np.float32))
                with pytest.raises(errors.VariableConflict, match=r"'w' exists with optimizer none .* declared with "
                                                                  r"\{'kind': 'sgd'"):
                    await sess.variable("w", np.zeros(2, np.float32), optimizer=zf.optim.SGD(0.1))
                await sess.variable("m", np.zeros(2, np.float32), optimizer=zf.optim.SGD(0.1))
                again = await sess.variable("m", np.zeros(2, np.float32))  # none named: attaches
                await again.push(np.ones(2, np.float32))
                np.testing.assert_allclose(await again.read(), [-0.1, -0.1])

    arun(main())
