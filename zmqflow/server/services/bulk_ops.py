"""The ps service's bulk ops: a stream offered to a caller, a pull sent on one, a push read
from one (:mod:`zmqflow.server.bulk_listener`, :mod:`zmqflow.transport.bulk`)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import numpy as np

from ...errors import InvalidArgument, NotFound, Recovering
from ...rpc import CallContext, op
from ...state.store import Part, Rows, ShardStore
from ...transport.bulk import as_bytes
from ...wire.dtypes import dtype_name
from ...wire.requests import ps as rq
from ..bulk_listener import BulkListener
from ..bulk_receive import PushConn, Sink

__all__ = ["BulkOps", "PUSH_CHUNK", "MAX_TRANSFER"]

# A pushed gradient is applied this many bytes at a time (whole rows, one at least): a chunk just
# read stays in the core's cache for the add (a 1 MiB L2 here; 4 MiB chunks ran 10% slower).
PUSH_CHUNK = 512 << 10
MAX_TRANSFER = 1 << 30  # bytes one pull_bulk or push_bulk may carry: a push's plan is one entry per chunk


class BulkOps:
    """Mixed into the ps service, which provides ``store``. ``bulk`` is its listener where the
    task's server opened one (None: every pull goes over ZeroMQ)."""

    store: ShardStore
    bulk: BulkListener | None = None
    epoch: int  # the fence's (FenceOps)
    pushes_applied: dict[str, int]

    async def open_bulk(self, host: str) -> None:
        """Offer streams from now on, listening on ``host`` (the task's server decides where)."""
        await self.close_bulk()
        self.bulk = await BulkListener(host).start()

    async def close_bulk(self) -> None:
        """Offer none from now on; every open stream is closed."""
        bulk, self.bulk = self.bulk, None
        if bulk is not None:
            await bulk.close()

    @op(rq.BulkOffer)
    def bulk_offer(self, ctx: CallContext, req: rq.BulkOffer) -> dict[str, Any] | None:
        """A stream for the caller, of ``req.kind``: the port to connect to, the one-time token to
        present there, and the handle its requests name. None where this task offers none."""
        if self.bulk is None:
            return None
        handle, token = self.bulk.offer(ctx.source, req.kind)
        return {"port": self.bulk.port, "token": token, "handle": handle}

    def _checked(self, req: rq.PullBulk | rq.PushBulk, op: str) -> list[tuple[Part, int, int]]:
        """Each item's part and local rows, checked against what the caller expects of it: raw
        bytes carry no dtype or shape, so a part that differs is refused here, naming it. A
        transfer is at most MAX_TRANSFER bytes (a client sends at most BULK_BATCH and a row)."""
        if not len(req.items) == len(req.dtypes) == len(req.sizes):
            raise InvalidArgument(f"ps.{op}: {len(req.items)} items, {len(req.dtypes)} dtypes and {len(req.sizes)} "
                                  "sizes: one of each per item")
        if sum(req.sizes) > MAX_TRANSFER:
            raise InvalidArgument(f"ps.{op}: {sum(req.sizes)} bytes in one transfer, over the {MAX_TRANSFER} a "
                                  "transfer may carry")
        out = []
        for it, dtype, size in zip(req.items, req.dtypes, req.sizes):
            p, a, b = self.store.row_range(it.name, it.part, it.start, it.stop)
            held = (b - a) * p.row_bytes if p.full_shape else p.row_bytes
            if dtype != dtype_name(p.dtype) or size != held:
                raise InvalidArgument(f"ps.{op}: {p.label} rows [{a}, {b}) are {held} bytes of {dtype_name(p.dtype)} "
                                      f"here, the caller expects {size} bytes of {dtype}: re-created since it looked?")
            out.append((p, a, b))
        return out

    @op(rq.PullBulk)
    def pull_bulk(self, ctx: CallContext, req: rq.PullBulk) -> Coroutine[Any, Any, int]:
        """The items' rows as one transfer on the caller's stream, from read-only views (a write
        meanwhile goes to a copy of the part, as for a ZeroMQ pull). Every item and the stream are
        checked before a byte is sent."""
        if self.bulk is None:
            raise NotFound("this task offers no bulk streams")
        conn = self.bulk.conn(req.stream, ctx.source)
        self._checked(req, "pull_bulk")
        view = self.store.view
        views = [as_bytes(view(it.name, it.part, it.start, it.stop)) for it in req.items]
        return conn.send(req.tag, views, ctx.deadline)

    @op(rq.PushBulk)
    def push_bulk(self, ctx: CallContext, req: rq.PushBulk) -> Coroutine[Any, Any, dict[str, Any]]:
        """Gradients for rows of async parts, whose bytes come on the caller's push stream: each
        chunk of ``PUSH_CHUNK`` bytes is applied (the part's optimizer, or an add) as it lands,
        while it is still in cache. Every item is checked first: a synchronous part (whose
        gradients wait for their step whole) or a scalar is refused, as is anything ``push``
        refuses. A fence before the last chunk fails the push with Recovering; the chunks
        applied before it stay applied, as a sliced push's slices do."""
        if self.bulk is None:
            raise NotFound("this task offers no bulk streams")
        conn = self.bulk.push_conn(req.stream, ctx.source)
        plan: list[tuple[Part, int, int, tuple[int, ...]]] = []  # each chunk's part, rows and shape
        sizes: list[int] = []
        parts: set[Part] = set()
        for p, a, b in self._checked(req, "push_bulk"):
            if p.sync is not None or not p.full_shape:
                what = "synchronous" if p.sync is not None else "a scalar"
                raise InvalidArgument(f"variable {p.label} is {what}: its gradients go over ZeroMQ (ps.push)")
            row = p.row_bytes
            parts.add(p)
            if not row:  # rows of nothing: no bytes come, nothing to apply
                continue
            per = max(1, PUSH_CHUNK // row)
            for r0 in range(a, b, per):
                r1 = min(b, r0 + per)
                plan.append((p, r0, r1, (r1 - r0, *p.full_shape[1:])))
                sizes.append((r1 - r0) * row)
        epoch = self.epoch
        apply, rate = self.store.apply, req.learning_rate

        def consume(i: int, chunk: memoryview) -> None:
            """Checked above, once: the part stays the same object until a fence (a restore) moves
            the epoch, and the chunk has exactly its rows' bytes."""
            if self.epoch != epoch:
                raise Recovering(f"ps.push_bulk: this shard began recovery (epoch {self.epoch}) while the gradients "
                                 "came; the rest were dropped", epoch=self.epoch, fenced=True)
            p, r0, r1, shape = plan[i]
            apply(Rows(p, r0, r1, np.frombuffer(chunk, dtype=p.dtype).reshape(shape)), rate)

        sink = Sink(sizes, consume)
        conn.expect(req.tag, sink)
        return self._pushed(conn, sink, len(parts), ctx.deadline)

    async def _pushed(self, conn: PushConn, sink: Sink, parts: int, deadline: float | None) -> dict[str, Any]:
        await conn.landed(sink, deadline)
        self.pushes_applied["async"] += parts
        return {"step": None, "stale": False, "replicas": None}
