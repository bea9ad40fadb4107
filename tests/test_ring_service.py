"""The ring service's mailbox as a peer reaches it: aborts that carry odd details, the bound on
what aborts leave behind, and on what is deposited for calls this task never runs."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from zmqflow import errors
from zmqflow.client.ring import AsyncRing
from zmqflow.rpc import CallContext
from zmqflow.server.services import ring as ring_service
from zmqflow.server.services.ring import RingService
from zmqflow.testing import async_wait_until, local_cluster

from .conftest import arun

CTX = CallContext("ring", "abort", b"peer", "worker:1", None)


def test_an_abort_whose_details_name_the_errors_own_fields_fails_the_call_with_its_code():
    """``message`` and ``remote_traceback`` are the error's own parameters: a peer's details that
    use those names are left out, not a TypeError that escapes the op."""
    async def main():
        svc = RingService()
        take = asyncio.ensure_future(svc.take(("r", 3, "reduce", 0, 0)))
        await asyncio.sleep(0)  # the take waits on its box
        details = {"message": "m", "remote_traceback": "t", "rank": 1}
        assert svc.abort(CTX, ring="r", seq=3, code="INVALID_ARGUMENT", message="shapes differ", details=details)
        try:
            await asyncio.wait_for(take, 5)
        except errors.InvalidArgument as exc:
            assert exc.message == "shapes differ" and exc.details == {"rank": 1}
        else:
            raise AssertionError("the take was not failed")
        assert not svc.deposit(CTX, ring="r", seq=3, phase="reduce", step=0, chunk=1, src=1, meta=[],
                           data=np.zeros(1, np.float32))

    arun(main())


def test_abort_records_are_bounded_oldest_first():
    svc = RingService()
    limit = ring_service._MAX_ABORTED
    for seq in range(limit + 10):
        svc.abort(CTX, ring="r", seq=seq, code="ABORTED", message="gone")
    assert len(svc.aborted) == limit
    assert ("r", 0) not in svc.aborted and ("r", limit + 9) in svc.aborted


def test_chunks_no_call_takes_are_capped(monkeypatch):
    async def main():
        monkeypatch.setattr(ring_service, "MAX_WAITING_CHUNKS", 3)
        svc = RingService()
        chunk = dict(ring="r", phase="reduce", step=0, src=1, meta=[], data=np.zeros(1, np.float32))
        for seq in range(3):
            assert svc.deposit(CTX, seq=seq, chunk=0, **chunk)
        with pytest.raises(errors.ResourceExhausted, match=r"ring 'r' call 9: 3 chunks already wait to be taken"):
            svc.deposit(CTX, seq=9, chunk=0, **chunk)
        assert len(svc.boxes) == 3
        got = await svc.take(("r", 0, "reduce", 0, 0))  # a take makes room again
        assert got[0] == 1 and svc.deposit(CTX, seq=9, chunk=0, **chunk)

    arun(main())


def parked(server) -> dict:
    """What a task's ring mailbox holds untaken, by ring: (deposits, bytes)."""
    out: dict = {}
    for key, (nbytes, _) in server.service("ring").parked.items():
        count, total = out.get(key[0], (0, 0))
        out[key[0]] = (count + 1, total + nbytes)
    return out


def test_an_abort_drops_what_was_parked_for_the_call():
    """Two ranks run rings of different names: each parks a chunk at the other that no call there
    takes. Each gives up at its deadline and tells every member, which drops the chunk it parked."""
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            rings = [AsyncRing(servers["worker:0"], name="default", timeout=1, shm=False),
                     AsyncRing(servers["worker:1"], name="grads", timeout=1, shm=False)]
            for _ in range(2):
                got = await asyncio.gather(*(r.allreduce(np.ones(1 << 20, np.float32)) for r in rings),
                                           return_exceptions=True)
                assert all(isinstance(g, errors.DeadlineExceeded) for g in got), got
            for name in ("worker:0", "worker:1"):
                assert servers[name].service("ring").boxes == {}
                assert parked(servers[name]) == {} and servers[name].service("ring").parked_bytes == 0

    arun(main(), timeout=60)


def test_parked_deposits_are_capped_in_bytes_naming_the_ring(monkeypatch):
    monkeypatch.setattr(ring_service, "MAX_PARKED_BYTES", 1 << 20)

    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            odd = AsyncRing(servers["worker:1"], name="grads", timeout=5, shm=False, small_bytes=0)
            start = time.monotonic()
            with pytest.raises(errors.ResourceExhausted, match=r"ring 'grads' call 0: .* pass the limit") as refused:
                await odd.allreduce(np.ones(1 << 20, np.float32))  # a 2 MiB chunk for worker:0
            assert time.monotonic() - start < 4 and refused.value.details["ring"] == "grads"
            assert servers["worker:0"].service("ring").parked_bytes <= 1 << 20

    arun(main(), timeout=60)


def test_deposits_no_call_takes_expire_unless_their_ring_may_still_take_them(monkeypatch):
    """worker:1 runs two rings, "lost" and "kept"; worker:0 runs only "kept", and has not
    started its call yet. The chunk parked for "lost" goes once it waited PARKED_TTL_S, while
    the sender's call still runs; "kept" registered a 10 s timeout: its chunk stays, and the
    call takes it."""
    monkeypatch.setattr(ring_service, "PARKED_TTL_S", 0.2)

    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            mailbox = servers["worker:0"].service("ring")
            lost = AsyncRing(servers["worker:1"], name="lost", timeout=3, shm=False)
            kept = [AsyncRing(servers[f"worker:{i}"], name="kept", timeout=10, shm=False) for i in range(2)]
            waiting = [asyncio.ensure_future(r.allreduce(np.full(4, 2.0))) for r in (lost, kept[1])]
            await async_wait_until(lambda: set(parked(servers["worker:0"])) == {"lost", "kept"}, 10, what="both parked")
            since = max(t for _, t in mailbox.parked.values())
            await async_wait_until(lambda: "lost" not in parked(servers["worker:0"]), 10, what="'lost' expired")
            assert not waiting[0].done()  # its chunk went by expiry, not by an abort
            await async_wait_until(lambda: time.monotonic() - since > 3 * ring_service.PARKED_TTL_S, 5,
                                   what="sweeps past the bound for unregistered rings")
            assert set(parked(servers["worker:0"])) == {"kept"}
            out = await kept[0].allreduce(np.full(4, 1.0))
            assert out.tolist() == [3.0] * 4 and (await waiting[1]).tolist() == [3.0] * 4
            with pytest.raises(errors.DeadlineExceeded):
                await waiting[0]
            assert mailbox.parked_bytes == 0

    arun(main(), timeout=60)
