"""Recovery where a message is in flight across an event, made to happen by the fault injector.

Each of these used to need timing luck (a request that happens to be on the wire while a shard is
fenced, a reply that happens to be lost, a connection that happens to drop mid-call); here a rule
holds, drops or cuts exactly the message the test is about.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.elastic_ring import AsyncElasticRing
from zmqflow.testing import REPLY, REQUEST, async_wait_until, faulty_cluster

from .conftest import arun

PS0 = zf.TaskId("ps", 0)
W = [f"worker:{i}" for i in range(3)]


def test_a_write_in_flight_across_a_fence_and_unfence_is_refused_as_the_first_since_the_restore():
    async def main():
        async with faulty_cluster({"ps": 1, "worker": 1}, timeout=10) as (servers, faults):
            target = servers["worker:0"].target
            async with zf.AsyncSession(target, name="user") as user, zf.AsyncSession(target, name="restorer") as restorer:
                v = await user.variable("v", np.zeros(2))
                await v.read()
                held = faults.hold(direction=REQUEST, op="ps.assign", client="user")
                write = asyncio.ensure_future(v.assign_add(np.ones(2)))
                await async_wait_until(lambda: held.held, 5, what="the write to be on the wire")
                epoch = await restorer.call_task(PS0, "ps", "fence")
                assert await restorer.call_task(PS0, "ps", "unfence", {"epoch": epoch})
                assert held.release() == 1  # it arrives after the recovery it was sent before
                with pytest.raises(errors.Recovering, match="first request since this shard was restored"):
                    await write
                np.testing.assert_array_equal(await v.read(), np.zeros(2))  # the refused write changed nothing
                await v.assign_add(np.ones(2))
                np.testing.assert_array_equal(await v.read(), np.ones(2))

    arun(main())


def test_a_push_arriving_while_the_shard_is_fenced_is_refused_and_changes_nothing():
    async def main():
        async with faulty_cluster({"ps": 1, "worker": 1}, timeout=10) as (servers, faults):
            ps = servers["ps:0"].service("ps")
            target = servers["worker:0"].target
            async with zf.AsyncSession(target, name="user") as user, zf.AsyncSession(target, name="restorer") as restorer:
                v = await user.variable("v", np.zeros(3), optimizer=zf.optim.SGD(1.0))
                held = faults.hold(direction=REQUEST, op="ps.push", client="user")
                push = asyncio.ensure_future(v.push(np.ones(3)))
                await async_wait_until(lambda: held.held, 5, what="the push to be on the wire")
                epoch = await restorer.call_task(PS0, "ps", "fence")
                held.release()
                with pytest.raises(errors.Recovering, match=r"ps\.push refused: this shard is being restored"):
                    await push
                assert ps.store.get("v", 0).value.tolist() == [0.0, 0.0, 0.0]
                assert await restorer.call_task(PS0, "ps", "unfence", {"epoch": epoch})

    arun(main())


def test_a_lost_reply_to_a_push_is_a_deadline_exceeded_and_the_push_was_applied_once():
    async def main():
        async with faulty_cluster({"ps": 1, "worker": 1}, timeout=10) as (servers, faults):
            async with zf.AsyncSession(servers["worker:0"].target, name="user", timeout=0.5) as sess:
                v = await sess.variable("v", np.zeros(2), optimizer=zf.optim.SGD(1.0))
                lost = faults.drop(direction=REPLY, op="ps.push", times=1)
                with pytest.raises(errors.DeadlineExceeded, match=r"ps\.push on ps:0"):
                    await v.push(np.ones(2))
                assert lost.fired == 1
                # the shard applied it; nothing re-sent it: at most once, as the caller must assume
                np.testing.assert_array_equal(await v.read(), -np.ones(2))

    arun(main())


def test_a_sync_push_waiting_when_its_connection_drops_fails_fast_and_the_shard_sees_the_client_gone():
    async def main():
        async with faulty_cluster({"ps": 1, "worker": 2}, timeout=10) as (servers, faults):
            target, ps_server = servers["ps:0"].target, servers["ps:0"]
            a, b = zf.AsyncSession(target, name="worker:0"), zf.AsyncSession(target, name="worker:1")
            try:
                opt = zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                v = await a.variable("v", np.zeros(2), optimizer=opt)
                await b.get("v")
                waiting = asyncio.ensure_future(a.push({"v": np.ones(2)}))  # one of two: it waits for the other
                part = ps_server.service("ps").store.get("v", 0)
                await async_wait_until(lambda: part.sync.contributors, 5, what="the push to wait at the shard")
                identity = a.client.identity
                start = time.monotonic()
                assert faults.disconnect("ps:0", client=identity.decode()) == 1
                with pytest.raises(errors.Unavailable, match=r"connection to \S+ dropped during ps\.push"):
                    await waiting
                assert time.monotonic() - start < 1
                assert not ps_server.client_reachable(identity)
                faults.reconnect("ps:0", client=identity.decode())
                assert ps_server.client_reachable(identity)
                np.testing.assert_array_equal(await v.read(), np.zeros(2))  # the step has not completed
            finally:
                await a.close()
                await b.close()

    arun(main())


async def _sum_everywhere(rings):
    return await asyncio.gather(*(r.ring.allreduce(np.full(3, float(i + 1))) for i, r in enumerate(rings)),
                                return_exceptions=True)


def test_a_ring_member_cut_off_mid_allreduce_makes_the_others_raise_and_reform_without_it():
    async def main():
        async with faulty_cluster({"worker": 3}, timeout=10, default_timeout=10) as (servers, faults):
            rings = [AsyncElasticRing(servers[t], join_window=5) for t in W]
            first = await asyncio.gather(*(r.form(step, 20) for r, step in zip(rings, [0, -1, -1])))
            assert {(f.generation, tuple(f.members)) for f in first} == {(1, tuple(W))}
            # worker:2's chunks are held: the allreduce is certainly in flight when it is cut off
            held = faults.hold(direction=REQUEST, op="ring.deposit", client="worker:2")
            results = asyncio.ensure_future(_sum_everywhere(rings))
            await async_wait_until(lambda: held.held, 5, what="worker:2's chunk on the wire")
            start = time.monotonic()
            faults.disconnect("worker:2")  # every connection to it drops
            faults.disconnect("worker:0", client="worker:2")
            faults.disconnect("worker:1", client="worker:2")
            out = await results
            assert time.monotonic() - start < 5
            for got in out[:2]:
                assert isinstance(got, errors.Unavailable) and "worker:2" in str(got), got
            held.cancel()
            second = await asyncio.gather(rings[0].form(5, 20), rings[1].form(5, 20))
            assert {(f.generation, tuple(f.members)) for f in second} == {(2, tuple(W[:2]))}
            for got in await asyncio.gather(*(r.ring.allreduce(np.full(3, float(i + 1))) for i, r in enumerate(rings[:2]))):
                np.testing.assert_array_equal(got, np.full(3, 3.0))
            for r in rings:
                r.close()

    arun(main(), timeout=60)
