"""A rank that gives a call up at its deadline, between rings on real sockets and segments: the
call fails on every rank with that rank's reason, even on a late rank that has all it needs, and
every rank takes the same path (shared memory or TCP) for the calls after it."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from zmqflow import errors
from zmqflow.client import ring_shm
from zmqflow.client.ring import AsyncRing
from zmqflow.state import shm_schedule as plan
from zmqflow.testing import local_cluster

from .conftest import arun

SHM = os.access("/dev/shm", os.W_OK)
PATHS = [pytest.param(True, id="shm", marks=pytest.mark.skipif(not SHM, reason="no writable /dev/shm")),
         pytest.param(False, id="tcp")]


async def agreed(servers: dict, shm: bool) -> list[AsyncRing]:
    rings = [AsyncRing(servers[f"worker:{i}"], timeout=10, shm=shm) for i in range(2)]
    await asyncio.gather(*(r.allreduce(np.ones(1)) for r in rings))  # the first call agrees on the path
    assert all((r.shm_channel is not None) == shm for r in rings)
    return rings


@pytest.mark.parametrize("shm", PATHS)
def test_a_call_one_rank_gave_up_fails_on_the_late_rank_too(shm):
    """Rank 0 gives up at its deadline while rank 1 has not started; rank 1 then finds all of rank
    0's data there, yet must fail the call at once, saying rank 0 gave up waiting for it (not that
    it is gone itself); the next calls take one path on both ranks and succeed."""
    async def main() -> None:
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            rings = await agreed(servers, shm)
            with pytest.raises(errors.DeadlineExceeded, match=r"waiting for rank 1 \(worker:1\)"):
                await rings[0].allreduce(np.ones(4, np.float32), timeout=0.3)
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded) as late:
                await rings[1].allreduce(np.ones(4, np.float32), timeout=5)
            assert time.monotonic() - start < 2.5  # at once, not at its own deadline
            assert late.value.details["task"] == "worker:1" and "rank 0" in str(late.value), late.value
            for k in range(2):
                outs = await asyncio.gather(*(r.allreduce(np.full(2, k + 1.0), timeout=5) for r in rings))
                assert [o.tolist() for o in outs] == [[2.0 * (k + 1)] * 2] * 2
                assert rings[0].shm_channel is None and rings[1].shm_channel is None  # both left shared memory

    arun(main(), timeout=60)


@pytest.mark.skipif(not SHM, reason="no writable /dev/shm")
def test_a_call_queued_behind_the_one_that_broke_the_channel_runs_over_tcp_on_every_rank():
    """Rank 0 queues two calls on shared memory; the first fails at its deadline. The second was
    already queued there, and rank 1 reaches it after the break: both run it over TCP."""
    async def main() -> None:
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            rings = await agreed(servers, True)
            first = asyncio.ensure_future(rings[0].allreduce(np.ones(4, np.float32), timeout=0.3))
            second = asyncio.ensure_future(rings[0].allreduce(np.full(3, 2.0), timeout=10))
            await asyncio.wait([first])
            assert isinstance(first.exception(), errors.DeadlineExceeded) and not second.done()
            late = await asyncio.gather(rings[1].allreduce(np.ones(4, np.float32), timeout=5),
                                        rings[1].allreduce(np.full(3, 5.0), timeout=10), return_exceptions=True)
            assert isinstance(late[0], errors.DeadlineExceeded), late[0]
            assert late[1].tolist() == [7.0] * 3 and (await second).tolist() == [7.0] * 3
            assert rings[0].shm_channel is None and rings[1].shm_channel is None

    arun(main(), timeout=60)


@pytest.mark.skipif(not SHM, reason="no writable /dev/shm")
def test_a_peer_that_gave_up_an_earlier_call_sends_every_later_one_over_tcp():
    """Rank 1 completed call 0 just before rank 0 gave it up (its abort word came after): for
    call 1, rank 1 must leave shared memory as rank 0 does, not wait there for it."""
    ranks = [ring_shm.ShmChannel("gave-up-earlier", r, 2, ["worker:0", "worker:1"]) for r in range(2)]
    try:
        blobs = np.stack([ch.blob() for ch in ranks])
        for ch in ranks:
            ch.attach(blobs)
        assert ranks[1].usable(1)
        ranks[0].headers[0][plan.H_ABORT_SEQ] = 0  # as rank 0 writes it at its deadline, waiting for rank 1
        ranks[0].headers[0][plan.H_ABORT] = plan.abort_word(plan.DEADLINE, 1, 2)
        assert not ranks[1].usable(1) and ranks[1].usable(0)  # call 0 itself would still fail there, at once
        assert isinstance(ranks[1].broken, errors.DeadlineExceeded) and ranks[1].broken_seq == 0
        src = np.ones(4, np.float32)
        with pytest.raises(ring_shm.ChannelClosed):
            ranks[1].collective(src, "sum", 1, ["allreduce", "sum", "float32", 1, 4, 0, None], time.monotonic() + 10)
        with pytest.raises(errors.DeadlineExceeded, match=r"rank 0 \(worker:0\) gave up waiting for rank 1"):
            ranks[1].collective(src, "sum", 0, ["allreduce", "sum", "float32", 1, 4, 0, None], time.monotonic() + 10)
    finally:
        for ch in ranks:
            ch.close()
