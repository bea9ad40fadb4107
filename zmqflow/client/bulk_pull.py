"""A pull through a task's bulk stream (:mod:`.bulk`): the rows land in their arrays as they come.

``BULK_FROM``: a task's share of a pull (or of a push's async gradients) from this many bytes on
goes through its streams, where the task offers them; smaller ones gain nothing over ZeroMQ's
one message. A task's parts go as transfers of up to ``BULK_BATCH`` bytes, all asked for at
once, each answered over ZeroMQ once its bytes are sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, TypeVar

from ..cluster import TaskId
from ..errors import DeadlineExceeded, Unavailable
from ..wire.requests import ps as rq
from ..wire.requests.base import MAX_ITEMS
from .bulk import BulkStream
from .port import SessionPort

__all__ = ["BULK_FROM", "BULK_BATCH", "streams", "transfers", "pull_into"]

BULK_FROM = 1 << 20
BULK_BATCH = 64 << 20
T = TypeVar("T")


async def streams(sess: SessionPort, shares: Mapping[TaskId, int], kind: str = "pull") -> dict[TaskId, Any]:
    """The bulk streams of ``kind`` of the tasks whose ``shares`` (bytes of this pull or push)
    reach BULK_FROM."""
    out = {}
    for task, nbytes in shares.items():
        if nbytes >= BULK_FROM and (stream := await sess.bulk_stream(task, kind)) is not None:
            out[task] = stream
    return out


def transfers(entries: list[tuple[int, T, memoryview]], limit: int = BULK_BATCH) -> list[list[tuple[int, T, memoryview]]]:
    """``(nbytes, item, dest)`` in order, cut into transfers of about ``limit`` bytes and at most
    the request's MAX_ITEMS items."""
    out: list[list[tuple[int, T, memoryview]]] = [[]]
    size = 0
    for entry in entries:
        if out[-1] and (size + entry[0] > limit or len(out[-1]) >= MAX_ITEMS):
            out.append([])
            size = 0
        out[-1].append(entry)
        size += entry[0]
    return out


async def pull_into(sess: SessionPort, task: TaskId, stream: BulkStream, items: list[rq.PullItem],
                    dests: list[memoryview], timeout: float | None) -> None:
    """``items`` of ``task`` into ``dests`` (one per item, each exactly its rows' bytes), by ``timeout``
    (the session's by default). On any failure the destinations are left alone from then on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (sess.timeout if timeout is None else timeout)
    t = stream.expect(dests)
    try:
        await sess.call_task(task, "ps", "pull_bulk", rq.PullBulk(items=items, stream=stream.handle, tag=t.tag),
                             timeout=timeout)
    except (DeadlineExceeded, Unavailable, asyncio.CancelledError):
        await stream.abandon(t, sent=True)  # the task may send it yet: its bytes are read and dropped
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
