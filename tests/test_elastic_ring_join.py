"""Joining the elastic ring through the leader when its status answer is late.

A rank surveys every member's ``ring.status`` with short calls before it joins. On a loaded
machine the leader's answer can miss those calls while the leader is alive and leading; the
fault injector holds exactly those replies, so the miss happens every run instead of by luck.
"""

from __future__ import annotations

import asyncio

import numpy as np

from zmqflow.client.elastic_ring import AsyncElasticRing
from zmqflow.server import AsyncServer
from zmqflow.server.checkpoint_roots import ANYWHERE
from zmqflow.testing import REPLY, async_wait_until, faulty_cluster

from .conftest import arun

W = [f"worker:{i}" for i in range(3)]


async def _sum_everywhere(rings: list[AsyncElasticRing]) -> list[np.ndarray]:
    return await asyncio.gather(*(r.ring.allreduce(np.full(3, float(i + 1))) for i, r in enumerate(rings)))


def test_a_newcomer_that_misses_the_leaders_status_still_joins_through_the_leader():
    """The restarted worker:2 hears worker:1 (generation 2) but never the leader worker:0 in its
    surveys: it must not wait at worker:1, which never re-forms for it, but be counted by worker:0."""
    async def main():
        async with faulty_cluster({"worker": 3}, timeout=10, default_timeout=10) as (servers, faults):
            rings = [AsyncElasticRing(servers[t], join_window=5) for t in W]
            await asyncio.gather(*(r.form(step, 20) for r, step in zip(rings, [0, -1, -1])))
            await servers["worker:2"].stop()
            second = await asyncio.gather(rings[0].form(5, 20), rings[1].form(6, 20))
            assert {(f.generation, tuple(f.members)) for f in second} == {(2, tuple(W[:2]))}

            spec = servers["worker:0"].spec
            servers["worker:2"] = await AsyncServer(spec, "worker:2", default_timeout=10,
                                                    checkpoint_roots=ANYWHERE).start()
            late = faults.hold(direction=REPLY, op="ring.status", server="worker:0", client="worker:2")
            newcomer = AsyncElasticRing(servers["worker:2"], join_window=5)
            joining = asyncio.ensure_future(newcomer.form(-1, 20))
            # wherever it waits, one of the two counts it: only the leader's count reaches the others
            await async_wait_until(lambda: rings[0].joiners() or rings[1].state.waiting, 15,
                                   what="a member counting the newcomer")
            assert late.fired >= 1  # its survey did miss the leader's answer
            assert (rings[0].joiners(), rings[1].state.waiting) == (1, 0)
            assert not joining.done()
            rings[2] = newcomer
            third = await asyncio.gather(rings[0].form(6, 20), rings[1].form(6, 20), joining)
            assert {(f.generation, tuple(f.members), f.holder) for f in third} == {(3, tuple(W), "worker:0")}
            for out in await _sum_everywhere(rings):
                np.testing.assert_array_equal(out, np.full(3, 6.0))
            late.release()
            for r in rings:
                r.close()

    arun(main(), timeout=60)


def test_a_survivor_that_misses_the_leaders_status_re_forms_with_it_not_alone():
    """worker:2 stops; worker:1's survey misses the leader's answer once. It must not coordinate a
    round of its own (each survivor would then form generation 2 alone after the window)."""
    async def main():
        async with faulty_cluster({"worker": 3}, timeout=10, default_timeout=10) as (servers, faults):
            rings = [AsyncElasticRing(servers[t], join_window=5) for t in W]
            await asyncio.gather(*(r.form(step, 20) for r, step in zip(rings, [0, -1, -1])))
            await servers["worker:2"].stop()
            late = faults.hold(direction=REPLY, op="ring.status", server="worker:0", client="worker:1", times=1)
            second = await asyncio.gather(rings[0].form(5, 20), rings[1].form(6, 20))
            assert late.fired == 1
            formed = {(f.generation, tuple(f.members), f.holder, f.step) for f in second}
            assert formed == {(2, tuple(W[:2]), "worker:1", 6)}  # one generation of both, not one each
            for out in await _sum_everywhere(rings[:2]):
                np.testing.assert_array_equal(out, np.full(3, 3.0))
            late.release()
            for r in rings[:2]:
                r.close()

    arun(main(), timeout=60)
