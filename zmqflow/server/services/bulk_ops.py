"""The ps service's bulk ops: a stream offered to a caller, and a pull sent on it
(:mod:`zmqflow.server.bulk_listener`, :mod:`zmqflow.transport.bulk`)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from ...errors import NotFound
from ...rpc import CallContext, op
from ...state.store import ShardStore
from ...transport.bulk import as_bytes
from ...wire.requests import ps as rq
from ..bulk_listener import BulkListener

__all__ = ["BulkOps"]


class BulkOps:
    """Mixed into the ps service, which provides ``store``. ``bulk`` is its listener where the
    task's server opened one (None: every pull goes over ZeroMQ)."""

    store: ShardStore
    bulk: BulkListener | None = None

    async def open_bulk(self, host: str) -> None:
        """Offer streams from now on, listening on ``host`` (the task's server decides where)."""
        await self.close_bulk()
        self.bulk = await BulkListener(host).start()

    async def close_bulk(self) -> None:
        """Offer none from now on; every open stream is closed."""
        bulk, self.bulk = self.bulk, None
        if bulk is not None:
            await bulk.close()

    @op(rq.Empty)
    def bulk_offer(self, ctx: CallContext, req: rq.Empty) -> dict[str, Any] | None:
        """A stream for the caller: the port to connect to, the one-time token to present there,
        and the handle its pulls name. None where this task offers none."""
        if self.bulk is None:
            return None
        handle, token = self.bulk.offer(ctx.source)
        return {"port": self.bulk.port, "token": token, "handle": handle}

    @op(rq.PullBulk)
    def pull_bulk(self, ctx: CallContext, req: rq.PullBulk) -> Coroutine[Any, Any, int]:
        """The items' rows as one transfer on the caller's stream, from read-only views (a write
        meanwhile goes to a copy of the part, as for a ZeroMQ pull). Every item and the stream are
        checked before a byte is sent."""
        if self.bulk is None:
            raise NotFound("this task offers no bulk streams")
        conn = self.bulk.conn(req.stream, ctx.source)
        view = self.store.view
        views = [as_bytes(view(it.name, it.part, it.start, it.stop)) for it in req.items]
        return conn.send(req.tag, views, ctx.deadline)
