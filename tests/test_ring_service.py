"""The ring service's mailbox as a peer reaches it: aborts that carry odd details, and the bound
on what aborts leave behind."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from zmqflow import errors
from zmqflow.rpc import CallContext
from zmqflow.server.services import ring as ring_service
from zmqflow.server.services.ring import RingService

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
