"""The ps service's bulk ops: a stream offered to a caller, a pull sent on one, a push read
from one (:mod:`zmqflow.server.bulk_listener`, :mod:`zmqflow.transport.bulk`)."""

from __future__ import annotations

from array import array
from collections.abc import Coroutine, Iterator
from typing import Any

import numpy as np

from ...errors import InvalidArgument, Recovering
from ...rpc import CallContext, op
from ...state.store import Part, Rows, ShardStore
from ...transport.bulk import as_bytes
from ...transport.bulk_sender import Gather
from ...wire.dtypes import dtype_name
from ...wire.requests import ps as rq
from ..bulk_listener import BulkListener, not_open
from ..bulk_receive import PushConn, Sink

__all__ = ["BulkOps", "ItemRows", "PUSH_CHUNK", "MAX_TRANSFER"]

# A pushed gradient is applied this many bytes at a time (whole rows, one at least): a chunk just
# read stays in the core's cache for the add (a 1 MiB L2 here; 4 MiB chunks ran 10% slower).
PUSH_CHUNK = 512 << 10
MAX_TRANSFER = 1 << 30  # bytes one pull_bulk or push_bulk may carry: a push's plan is one entry per chunk


class ItemRows(Gather):
    """A request's items, checked, as each one's part and local rows in about 20 bytes (a request
    waits on its stream until its turn or its deadline: a view per item held that long cost the
    shard many times the request's own size). Sent as a pull: each part is pinned once when its
    turn comes (writes meanwhile go to a copy, ``Part.own``), each item's bytes sliced from it on
    the sending thread."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self._index: dict[int, int] = {}  # id(part) -> its place in ``parts``
        self.part, self.lo, self.hi = array("I"), array("q"), array("q")
        self.nbytes = self.count = 0
        self._bases: list[memoryview] = []

    def add(self, p: Part, a: int, b: int) -> None:
        """Rows ``[a, b)`` of ``p`` (checked); a scalar's one item is rows ``[0, 1)``."""
        k = self._index.get(id(p))
        if k is None:
            k = self._index[id(p)] = len(self.parts)
            self.parts.append(p)
        if not p.full_shape:
            a, b = 0, 1
        self.part.append(k)
        self.lo.append(a)
        self.hi.append(b)
        self.nbytes += (b - a) * p.row_bytes
        self.count += 1

    def prepare(self) -> None:
        """On the loop: each part's bytes, viewed as they are now."""
        bases = []
        for p in self.parts:
            if p.value.base is not None:  # views must refer to ``value`` itself for ``own`` to count them
                p.value = p.value.copy()
            bases.append(as_bytes(p.value))
        self._bases = bases

    def __iter__(self) -> Iterator[memoryview]:
        bases, rows = self._bases, [p.row_bytes for p in self.parts]
        for k, a, b in zip(self.part, self.lo, self.hi):
            yield bases[k][a * rows[k]:b * rows[k]]

    def release(self) -> None:
        self._bases = []


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

    def _checked(self, req: rq.PullBulk | rq.PushBulk, op: str) -> ItemRows:
        """Each item's part and local rows, checked against what the caller expects of it: raw
        bytes carry no dtype or shape, so a part that differs is refused here, naming it. A
        transfer is at most MAX_TRANSFER bytes (a client sends at most BULK_BATCH and a row)."""
        if not len(req.items) == len(req.dtypes) == len(req.sizes):
            raise InvalidArgument(f"ps.{op}: {len(req.items)} items, {len(req.dtypes)} dtypes and {len(req.sizes)} "
                                  "sizes: one of each per item")
        if sum(req.sizes) > MAX_TRANSFER:
            raise InvalidArgument(f"ps.{op}: {sum(req.sizes)} bytes in one transfer, over the {MAX_TRANSFER} a "
                                  "transfer may carry")
        out = ItemRows()
        for it, dtype, size in zip(req.items, req.dtypes, req.sizes):
            p, a, b = self.store.row_range(it.name, it.part, it.start, it.stop)
            held = (b - a) * p.row_bytes if p.full_shape else p.row_bytes
            if dtype != dtype_name(p.dtype) or size != held:
                raise InvalidArgument(f"ps.{op}: {p.label} rows [{a}, {b}) are {held} bytes of {dtype_name(p.dtype)} "
                                      f"here, the caller expects {size} bytes of {dtype}: re-created since it looked?")
            out.add(p, a, b)
        return out

    @op(rq.PullBulk)
    def pull_bulk(self, ctx: CallContext, req: rq.PullBulk) -> Coroutine[Any, Any, int]:
        """The items' rows as one transfer on the caller's stream, as they are when its turn on the
        stream comes (read-only views: a write meanwhile goes to a copy of the part, as for a
        ZeroMQ pull). Every item and the stream are checked before a byte is sent."""
        if self.bulk is None:
            raise not_open(req.stream, "(this task offers none now)")
        conn = self.bulk.conn(req.stream, ctx.source)
        return conn.transfer(req.tag, self._checked(req, "pull_bulk"), ctx.deadline)

    @op(rq.PushBulk)
    def push_bulk(self, ctx: CallContext, req: rq.PushBulk) -> Coroutine[Any, Any, dict[str, Any]]:
        """Gradients for rows of async parts, whose bytes come on the caller's push stream: each
        chunk of ``PUSH_CHUNK`` bytes is applied (the part's optimizer, or an add) as it lands,
        while it is still in cache. Every item is checked first: a synchronous part (whose
        gradients wait for their step whole) or a scalar is refused, as is anything ``push``
        refuses. A fence before the last chunk fails the push with Recovering; the chunks
        applied before it stay applied, as a sliced push's slices do."""
        if self.bulk is None:
            raise not_open(req.stream, "(this task offers none now)")
        conn = self.bulk.push_conn(req.stream, ctx.source)
        items = self._checked(req, "push_bulk")
        for p in items.parts:
            if p.sync is not None or not p.full_shape:
                what = "synchronous" if p.sync is not None else "a scalar"
                raise InvalidArgument(f"variable {p.label} is {what}: its gradients go over ZeroMQ (ps.push)")
        # the plan, compact: each chunk's size, item and rows (24 bytes a chunk, no object)
        sizes, owner, starts, ends = array("q"), array("q"), array("q"), array("q")
        for j, (k, a, b) in enumerate(zip(items.part, items.lo, items.hi)):
            row = items.parts[k].row_bytes
            if not row or a == b:  # rows of nothing: no bytes come, nothing to apply
                continue
            per = max(1, PUSH_CHUNK // row)
            for r0 in range(a, b, per):
                r1 = min(b, r0 + per)
                sizes.append((r1 - r0) * row)
                owner.append(k)
                starts.append(r0)
                ends.append(r1)
        epoch = self.epoch
        apply, rate, parts = self.store.apply, req.learning_rate, items.parts

        def consume(i: int, chunk: memoryview) -> None:
            """Checked above, once: the part stays the same object until a fence (a restore) moves
            the epoch, and the chunk has exactly its rows' bytes."""
            if self.epoch != epoch:
                raise Recovering(f"ps.push_bulk: this shard began recovery (epoch {self.epoch}) while the gradients "
                                 "came; the rest were dropped", epoch=self.epoch, fenced=True)
            p, r0, r1 = parts[owner[i]], starts[i], ends[i]
            apply(Rows(p, r0, r1, np.frombuffer(chunk, dtype=p.dtype).reshape(r1 - r0, *p.full_shape[1:])), rate)

        sink = Sink(sizes, consume)
        conn.expect(req.tag, sink)
        return self._pushed(conn, sink, len(items.parts), ctx.deadline)

    async def _pushed(self, conn: PushConn, sink: Sink, parts: int, deadline: float | None) -> dict[str, Any]:
        await conn.landed(sink, deadline)
        self.pushes_applied["async"] += parts
        return {"step": None, "stale": False, "replicas": None}
