"""A pull through a task's bulk stream (:mod:`.bulk`): the rows land in their arrays as they come.

``BULK_FROM``: a task's share of a pull (or of a push's async gradients) from this many bytes on
goes through its streams, where the task offers them; smaller ones gain nothing over ZeroMQ's
one message. A task's parts go as transfers of up to ``BULK_BATCH`` bytes (cut and dealt to its
streams by :mod:`.bulk_lanes`), all asked for at once, each answered over ZeroMQ once its bytes
are sent.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple, TypeVar

from ..cluster import TaskId
from ..errors import DeadlineExceeded, Recovering, ShardStateLost, Unavailable
from ..wire.requests import ps as rq
from .bulk import BulkStream
from .port import SessionPort

__all__ = ["BULK_FROM", "BULK_BATCH", "Piece", "request", "pull_into"]

BULK_FROM = 1 << 20
BULK_BATCH = 64 << 20
T = TypeVar("T")


class Piece(NamedTuple):
    """One item of a transfer: its rows (as a request names them), where its bytes are, its dtype."""

    item: rq.PullItem
    view: memoryview
    dtype: str


def request(cls: type[T], stream: Any, tag: int, pieces: list[Piece]) -> T:
    """A ``PullBulk`` or ``PushBulk`` for ``pieces``: their items, and the dtype and byte count
    the caller expects of each (the task refuses a part that differs before a byte moves)."""
    return cls(items=[p.item for p in pieces], dtypes=[p.dtype for p in pieces],  # type: ignore[call-arg]
               sizes=[p.view.nbytes for p in pieces], stream=stream.handle, tag=tag)


async def pull_into(sess: SessionPort, task: TaskId, stream: BulkStream, pieces: list[Piece],
                    timeout: float | None) -> None:
    """The rows of ``pieces`` of ``task`` into their views (each exactly its rows' bytes), by
    ``timeout`` (the session's by default). On any failure the views are left alone from then on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (sess.timeout if timeout is None else timeout)
    t = stream.expect([p.view for p in pieces])
    try:
        await sess.call_task(task, "ps", "pull_bulk", request(rq.PullBulk, stream, t.tag, pieces), timeout=timeout)
    except (Recovering, ShardStateLost):
        await stream.abandon(t, sent=False)  # refused before a byte was sent (a fence, a restart)
        raise
    except Unavailable as exc:
        if exc.details.get("bulk_stream") != stream.handle:
            await stream.abandon(t, sent=True)  # the task may send it yet: its bytes are read and dropped
            raise
        # the task holds no such stream (it closed it, its end not yet seen here): close this end
        # too, so the next pull opens a new one or goes over ZeroMQ
        await stream.abandon(t, sent=False)
        await stream.close()
        raise
    except (DeadlineExceeded, asyncio.CancelledError):
        await stream.abandon(t, sent=True)
        raise
    except BaseException:
        await stream.abandon(t, sent=False)  # refused before a byte was sent
        raise
    try:  # the reply follows the last byte into the socket; the reader may still be landing them
        await asyncio.wait_for(asyncio.shield(t.done), max(0.0, deadline - loop.time()))
    except TimeoutError:
        await stream.abandon(t, sent=True)
        raise DeadlineExceeded(f"pull from {task}: its bytes did not all land on the bulk stream in time") from None
    except asyncio.CancelledError:
        await stream.abandon(t, sent=True)
        raise
