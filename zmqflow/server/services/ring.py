"""The ring service: a mailbox where a rank's left neighbour deposits chunks, aborts, and the
membership rendezvous (``status``, ``join``: see :mod:`.rendezvous`).

Deposits may arrive before this rank has started the matching call (the left is ahead); they
wait in the mailbox, keyed by ring, call sequence number, phase, step and chunk. An abort (a
collective mismatch seen by some rank, or a dead member) fails every pending take of that call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ...errors import InvalidArgument, PermissionDenied, ResourceExhausted, ZmqflowError
from ...rpc import CallContext, Service, op
from ...wire.requests import cluster as rq
from ...wire.error_data import error_from
from ...wire.requests.ps import Empty
from .rendezvous import Rendezvous

__all__ = ["RingService", "BoxKey"]

BoxKey = tuple[str, int, str, int, int]  # ring, seq, phase, step, chunk
_MAX_RINGS = 1024  # departure records kept (rings are registered by this task's own code; bounded anyway)
_MAX_ABORTED = 4096  # abort records kept, oldest forgotten first: they refuse stragglers of calls just failed
# chunks deposited and not yet taken: a left neighbour runs at most a step or so ahead, a few
# hundred chunks of the largest tensors; far more is a peer depositing what no call will take
MAX_WAITING_CHUNKS = 1 << 16


class RingService(Service):
    name = "ring"

    def __init__(self) -> None:
        super().__init__()
        self.boxes: dict[BoxKey, asyncio.Future] = {}
        self.aborted: dict[tuple[str, int], ZmqflowError] = {}
        self.retired: set[str] = set()
        self.members: dict[str, list[str]] = {}  # ring -> its members' task names, by rank
        self.departed: dict[str, dict[int, int]] = {}  # ring -> rank -> the last call it completed
        self.rendezvous = Rendezvous()

    def _box(self, key: BoxKey) -> asyncio.Future:
        fut = self.boxes.get(key)
        if fut is None:
            fut = self.boxes[key] = asyncio.get_running_loop().create_future()
        return fut

    def register(self, ring: str, members: list[str]) -> None:
        """The task names of ``ring``'s ranks: with keys, a chunk is taken only from the rank its key names."""
        self.members[ring] = list(members)

    @op(rq.Deposit)
    def deposit(self, ctx: CallContext, req: rq.Deposit) -> bool:
        ring, seq = req.ring, req.seq
        names = self.members.get(ring)
        if ctx.verified and names is not None and not (req.src < len(names) and names[req.src] == ctx.source):
            raise PermissionDenied(f"ring {ring!r}: {ctx.source} may not deposit as rank {req.src}", task=ctx.source)
        if (ring, seq) in self.aborted or ring in self.retired:
            return False
        key = (ring, seq, req.phase, req.step, req.chunk)
        if key not in self.boxes and len(self.boxes) >= MAX_WAITING_CHUNKS:
            raise ResourceExhausted(f"ring {ring!r} call {seq}: {len(self.boxes)} chunks already wait to be taken "
                                    f"here, the limit", limit=MAX_WAITING_CHUNKS)
        fut = self._box(key)
        if fut.done():
            raise InvalidArgument(f"ring {ring!r} call {seq}: chunk {req.phase}/{req.step}/{req.chunk} delivered twice")
        fut.set_result((req.src, req.meta, req.data))
        return True

    @op(rq.Abort)
    def abort(self, ctx: CallContext, req: rq.Abort) -> bool:
        self.fail(req.ring, req.seq, error_from(req.code, req.message, req.details))
        return True

    @op(rq.Leave)
    def leave(self, ctx: CallContext, req: rq.Leave) -> bool:
        """A member is done after call ``seq``: it had every chunk of those calls, so its going
        away fails none of them here (a lost acknowledgement of the last is not a lost chunk)."""
        names = self.members.get(req.ring)
        if ctx.verified and names is not None and not (req.src < len(names) and names[req.src] == ctx.source):
            raise PermissionDenied(f"ring {req.ring!r}: {ctx.source} may not leave as rank {req.src}", task=ctx.source)
        if req.ring in self.retired or names is None:
            return False
        if len(self.departed) >= _MAX_RINGS and req.ring not in self.departed:
            self.departed.pop(next(iter(self.departed)))
        self.departed.setdefault(req.ring, {})[req.src] = req.seq
        return True

    def departed_after(self, ring: str, rank: int) -> int:
        """The last call ``rank`` completed before it left ``ring`` (-1: it has not left)."""
        return self.departed.get(ring, {}).get(rank, -1)

    def state(self) -> str | None:
        g = self.rendezvous.generation
        return f"ring generation {g} of {len(self.rendezvous.members)}" if g else None

    @op(Empty)
    def status(self, ctx: CallContext, req: Empty) -> dict:
        """This rank's ring generation, its members, and whether its training is over."""
        return self.rendezvous.status()

    @op(rq.Join)
    def join(self, ctx: CallContext, req: rq.Join) -> Any:
        """Ask this rank, as coordinator, for a place in the next generation; answers once it forms.
        With keys, a task joins only as itself: the member is the task its key names."""
        if ctx.verified and req.task != ctx.source:
            raise PermissionDenied(f"ring.join: task {ctx.source} asked to join as {req.task}")
        return self.rendezvous.join(req.task, req.generation, req.step, req.target)

    async def stop(self) -> None:
        self.rendezvous.close()

    def fail(self, ring: str, seq: int, exc: ZmqflowError) -> None:
        """Fail every pending take of one call (first failure wins)."""
        if (ring, seq) in self.aborted:
            return
        if len(self.aborted) >= _MAX_ABORTED:
            self.aborted.pop(next(iter(self.aborted)))
        self.aborted[(ring, seq)] = exc
        for key, fut in self.boxes.items():
            if key[0] == ring and key[1] == seq and not fut.done():
                fut.set_exception(exc)

    async def take(self, key: BoxKey) -> tuple[int, Any, np.ndarray]:
        failure = self.aborted.get(key[:2])  # type: ignore[arg-type]
        if failure is not None:
            raise failure
        try:
            return await self._box(key)
        finally:
            self.boxes.pop(key, None)

    def forget(self, ring: str, seq: int) -> None:
        """Drop what is left of a finished call (boxes of an aborted one); its abort record stays,
        so chunks that straggle in afterwards are refused rather than kept."""
        for key in [k for k in self.boxes if k[0] == ring and k[1] == seq]:
            fut = self.boxes.pop(key)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "never retrieved" warning

    def retire(self, ring: str) -> None:
        """A ring generation is over: drop its boxes and refuse its chunks from now on."""
        self.retired.add(ring)
        self.members.pop(ring, None)
        self.departed.pop(ring, None)
        for key in [k for k in self.boxes if k[0] == ring]:
            fut = self.boxes.pop(key)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()
        for key in [k for k in self.aborted if k[0] == ring]:
            del self.aborted[key]
