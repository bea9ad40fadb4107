"""How one rank of a ring call over TCP notices a failure and spreads it: a deposit that was not
delivered, a member whose connection dropped (the first one to go is named, not a neighbour that
quit after it), a chunk from a different call (``CollectiveMismatch`` naming both sides), the
deadline. Every member hears why through ``ring.abort``, so all fail the same call the same way."""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import CollectiveMismatch, DeadlineExceeded, Unavailable, ZmqflowError
from ..wire.requests import cluster as crq
from .ring_meta import describe, differing

__all__ = ["RingFailures", "WATCH_S"]

WATCH_S = 0.05


class RingFailures:
    """One rank's failure handling for the calls of one ring (``client/ring.py`` runs the calls)."""

    def __init__(self, name: str, rank: int, members: list[Any], endpoints: list[str], server: Any):
        self.name, self.rank, self.members, self.endpoints, self.server = name, rank, members, endpoints, server
        self.size = len(members)
        self.aborts: list[asyncio.Future] = []  # abort calls in flight: a failing caller waits for them

    @property
    def service(self) -> Any:
        return self.server.service("ring")

    def label(self, rank: int) -> str:
        return f"rank {rank} ({self.members[rank]})"

    async def delivered(self, call: asyncio.Future, right: int, seq: int) -> Any:
        """A deposit's acknowledgement; one lost because the right neighbour left after completing
        this call counts as delivered (it could not have completed without the chunk)."""
        try:
            return await call
        except Unavailable:
            if self.service.departed_after(self.name, right) >= seq:
                return True
            raise

    def sent(self, fut: asyncio.Future, seq: int) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, ZmqflowError):
            gone = self.first_gone(seq)  # name the member that died first, not a neighbour that quit after it
            self.abort_everywhere(seq, gone or exc)

    def first_gone(self, seq: int) -> Unavailable | None:
        client = self.server.client
        service = self.service
        down = [(t, i) for i, ep in enumerate(self.endpoints)
                if i != self.rank and service.departed_after(self.name, i) < seq and (t := client.down_since(ep)) is not None]
        if not down:
            return None
        _, i = min(down)
        return Unavailable(f"ring {self.name!r} call {seq}: member {self.label(i)} is gone", task=str(self.members[i]))

    def check(self, seq: int, src: int, mine: list[Any], theirs: Any, data: Any, size: int, dtype: Any) -> None:
        if theirs != mine or getattr(data, "size", -1) != size or data.dtype != dtype:
            fields = differing(mine, theirs)
            message = (
                f"ring {self.name!r} call {seq}: {self.label(src)} sent {describe(theirs)} but "
                f"{self.label(self.rank)} called {describe(mine)}; {' and '.join(fields)} differ"
            )
            exc = CollectiveMismatch(message, ranks=[src, self.rank], fields=fields)
            self.abort_everywhere(seq, exc)
            raise exc

    def abort_everywhere(self, seq: int, exc: ZmqflowError) -> None:
        """Fail the call here and tell every other member why (once per call)."""
        if (self.name, seq) in self.service.aborted:
            return
        self.service.fail(self.name, seq, exc)
        body = crq.Abort(ring=self.name, seq=seq, code=exc.code, message=exc.message,
                         details={k: v for k, v in exc.details.items() if isinstance(v, (str, int, float, list))})
        client = self.server.client
        for i, ep in enumerate(self.endpoints):
            if i != self.rank and client.peer_state(ep) != "down":
                fut = client.start_call(ep, "ring", "abort", body, timeout=1.0, name=str(self.members[i]))
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                self.aborts.append(fut)

    async def watch(self, seq: int, meta: list[Any], deadline: float) -> None:
        """Fail the call when a member's connection drops, or at the deadline: on every member, as
        one that has all it needs would otherwise return a result of a call this rank gave up."""
        loop = asyncio.get_running_loop()
        left = (self.rank - 1) % self.size
        while True:
            await asyncio.sleep(WATCH_S)
            gone = self.first_gone(seq)
            if gone is not None:
                self.abort_everywhere(seq, gone)
                return
            if loop.time() > deadline:
                self.abort_everywhere(seq, DeadlineExceeded(
                    f"ring {self.name!r} call {seq} ({describe(meta)}) did not complete in time; "
                    f"{self.label(self.rank)} was waiting for {self.label(left)}", task=str(self.members[left])))
                return
