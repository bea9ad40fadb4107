"""The ring service: a mailbox where a rank's left neighbour deposits chunks, aborts, and the
membership rendezvous (``status``, ``join``: see :mod:`.rendezvous`).

Deposits may arrive before this rank has started the matching call (the left is ahead); they
wait in the mailbox, keyed by ring, call sequence number, phase, step and chunk. An abort (a
collective mismatch seen by some rank, a dead member, a deadline) fails every pending take of that
call and drops what was parked for it. What no call here takes (a peer running a ring of another
name, or a call this rank gave up without hearing an abort) is bounded in bytes, as well as in
chunks, and dropped once it has waited longer than any call of its ring could still take it.
"""

from __future__ import annotations

import asyncio
import time
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
# bytes deposited and not yet taken: a lagging rank holds about a segment of each call it is behind
# on (a whole bucket from every rank on the small path); a deposit past this is refused
MAX_PARKED_BYTES = 4 << 30
# how long a deposit may wait untaken: calls of a ring registered here get twice its timeout (no
# call that could take it lasts longer once the depositor's call ended), others this long
PARKED_TTL_S = 120.0


class RingService(Service):
    name = "ring"

    def __init__(self) -> None:
        super().__init__()
        self.boxes: dict[BoxKey, asyncio.Future] = {}
        self.aborted: dict[tuple[str, int], ZmqflowError] = {}
        self.retired: set[str] = set()
        self.members: dict[str, list[str]] = {}  # ring -> its members' task names, by rank
        self.ttl: dict[str, float] = {}  # ring -> how long its deposits may wait untaken
        self.parked: dict[BoxKey, tuple[int, float]] = {}  # deposited, untaken: (bytes, when)
        self.parked_bytes = 0
        self._sweep: asyncio.TimerHandle | None = None
        self.departed: dict[str, dict[int, int]] = {}  # ring -> rank -> the last call it completed
        self.rendezvous = Rendezvous()

    def _box(self, key: BoxKey) -> asyncio.Future:
        fut = self.boxes.get(key)
        if fut is None:
            fut = self.boxes[key] = asyncio.get_running_loop().create_future()
        return fut

    def register(self, ring: str, members: list[str], timeout: float = 0.0) -> None:
        """The task names of ``ring``'s ranks: with keys, a chunk is taken only from the rank its key
        names. ``timeout``: its calls' deadline, which bounds how long its deposits may wait here."""
        self.members[ring] = list(members)
        self.ttl[ring] = max(PARKED_TTL_S, 2 * float(timeout))

    def _park(self, key: BoxKey, nbytes: int) -> None:
        self.parked[key] = (nbytes, time.monotonic())
        self.parked_bytes += nbytes
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(PARKED_TTL_S / 4, self._expire)

    def _unpark(self, key: BoxKey) -> None:
        nbytes, _ = self.parked.pop(key, (0, 0.0))
        self.parked_bytes -= nbytes

    def _drop(self, key: BoxKey) -> None:
        """Remove one box: a waiting take is cancelled, a deposit no one took is let go."""
        fut = self.boxes.pop(key, None)
        self._unpark(key)
        if fut is None:
            return
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()  # retrieved: no "never retrieved" warning

    def _expire(self) -> None:
        """Drop deposits that waited untaken past their ring's bound; again while any are parked."""
        self._sweep = None
        now = time.monotonic()
        for key, (_, since) in list(self.parked.items()):
            if now - since > self.ttl.get(key[0], PARKED_TTL_S):
                self._drop(key)
        if self.parked:
            self._sweep = asyncio.get_running_loop().call_later(PARKED_TTL_S / 4, self._expire)

    def _refuse(self, ring: str, seq: int, nbytes: int) -> None:
        if self.parked_bytes + nbytes <= MAX_PARKED_BYTES:
            return
        per_ring: dict[str, int] = {}
        for key, (size, _) in self.parked.items():
            per_ring[key[0]] = per_ring.get(key[0], 0) + size
        most = max(per_ring, key=per_ring.__getitem__) if per_ring else ring
        raise ResourceExhausted(f"ring {ring!r} call {seq}: {self.parked_bytes} bytes of deposits already wait to be "
                                f"taken here ({per_ring.get(most, 0)} of ring {most!r}), and {nbytes} more pass the "
                                f"limit", limit=MAX_PARKED_BYTES, ring=ring)

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
        nbytes = int(getattr(req.data, "nbytes", 0))
        self._refuse(ring, seq, nbytes)
        fut = self._box(key)
        if fut.done():
            raise InvalidArgument(f"ring {ring!r} call {seq}: chunk {req.phase}/{req.step}/{req.chunk} delivered twice")
        fut.set_result((req.src, req.meta, req.data))
        self._park(key, nbytes)
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
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def fail(self, ring: str, seq: int, exc: ZmqflowError) -> None:
        """Fail every pending take of one call (first failure wins) and drop what was deposited
        for it: a take of the call raises from now on, so nothing will take it."""
        if (ring, seq) in self.aborted:
            return
        if len(self.aborted) >= _MAX_ABORTED:
            self.aborted.pop(next(iter(self.aborted)))
        self.aborted[(ring, seq)] = exc
        for key, fut in list(self.boxes.items()):
            if key[0] == ring and key[1] == seq:
                if fut.done():
                    self._drop(key)
                else:
                    fut.set_exception(exc)

    async def take(self, key: BoxKey) -> tuple[int, Any, np.ndarray]:
        failure = self.aborted.get(key[:2])  # type: ignore[arg-type]
        if failure is not None:
            raise failure
        try:
            return await self._box(key)
        finally:
            self.boxes.pop(key, None)
            self._unpark(key)

    def forget(self, ring: str, seq: int) -> None:
        """Drop what is left of a finished call (boxes of an aborted one); its abort record stays,
        so chunks that straggle in afterwards are refused rather than kept."""
        for key in [k for k in self.boxes if k[0] == ring and k[1] == seq]:
            self._drop(key)

    def retire(self, ring: str) -> None:
        """A ring generation is over: drop its boxes and refuse its chunks from now on."""
        self.retired.add(ring)
        self.members.pop(ring, None)
        self.ttl.pop(ring, None)
        self.departed.pop(ring, None)
        for key in [k for k in self.boxes if k[0] == ring]:
            self._drop(key)
        for key in [k for k in self.aborted if k[0] == ring]:
            del self.aborted[key]
