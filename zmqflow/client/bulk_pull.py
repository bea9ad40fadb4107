"""A pull through a task's bulk stream (:mod:`.bulk`): the rows land in their arrays as they come.

``BULK_FROM``: a task's share of a pull (or of a push's async gradients) from this many bytes on
goes through its streams, where the task offers them; smaller ones gain nothing over ZeroMQ's
one message. A task's parts go as transfers of up to ``BULK_BATCH`` bytes, all asked for at
once, each answered over ZeroMQ once its bytes are sent.

One TCP connection moves a few GB/s at most, bound by the one thread at each end that copies its
bytes through the kernel. A pull from fewer tasks than :func:`lanes` (``ZMQFLOW_BULK_LANES``) spreads
each task's share over several pull streams, that many in all and at least ``LANE_BYTES`` each,
each stream with its own sending and receiving thread, in transfers of about equal size: several
streams per peer where one cannot fill the link. A pull from many tasks has its streams already.
A push keeps to one a task: the shard's loop reads and applies every push stream itself, so a
second adds switching between them, not a core.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

from ..cluster import TaskId
from ..errors import ConfigError, DeadlineExceeded, Unavailable
from ..wire.requests import ps as rq
from ..wire.requests.base import MAX_ITEMS
from .bulk import BulkStream
from .port import SessionPort

__all__ = ["BULK_FROM", "BULK_BATCH", "LANE_BYTES", "LANES_ENV", "lanes", "Lanes", "Piece", "row_ranges", "streams",
           "transfers", "request", "pull_into"]

BULK_FROM = 1 << 20
BULK_BATCH = 64 << 20
LANE_BYTES = 8 << 20
LANES_ENV = "ZMQFLOW_BULK_LANES"
MAX_LANES = 4  # within a task's cap of streams per caller (8), with both kinds open
T = TypeVar("T")


def lanes() -> int:
    """The pull streams a pull spreads over (``ZMQFLOW_BULK_LANES``, 1 to MAX_LANES; 2 by default)."""
    raw = os.environ.get(LANES_ENV, "").strip()
    if not raw:
        return 2
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LANES:
        raise ConfigError(f"{LANES_ENV} must be a whole number of streams, 1 to {MAX_LANES}, got {raw!r}")
    return int(raw)


class Lanes(NamedTuple):
    """A task's streams of one kind for one pull or push, and the bytes each transfer carries."""

    streams: list[Any]
    limit: int

    def spread(self, pieces: list[Piece]) -> Iterator[tuple[Any, list[Piece]]]:
        """``pieces`` as transfers, each with the stream it goes on, in turn."""
        return zip(itertools.cycle(self.streams), transfers(pieces, self.limit))


async def streams(sess: SessionPort, shares: Mapping[TaskId, int], kind: str = "pull") -> dict[TaskId, Lanes]:
    """The bulk streams of ``kind`` of the tasks whose ``shares`` (bytes of this pull or push)
    reach BULK_FROM: one each, or for a pull ``lanes()`` in all, at least LANE_BYTES each."""
    out = {}
    big = {task: nbytes for task, nbytes in shares.items() if nbytes >= BULK_FROM}
    each = max(1, lanes() // max(1, len(big))) if kind == "pull" and big else 1
    for task, nbytes in big.items():
        if (first := await sess.bulk_stream(task, kind)) is None:
            continue
        got = [first]
        for lane in range(1, min(each, nbytes // LANE_BYTES)):
            if (more := await sess.bulk_stream(task, kind, lane)) is not None:
                got.append(more)
        out[task] = Lanes(got, min(BULK_BATCH, -(-nbytes // len(got))))
    return out


class Piece(NamedTuple):
    """One item of a transfer: its rows (as a request names them), where its bytes are, its dtype."""

    item: rq.PullItem
    view: memoryview
    dtype: str


def row_ranges(nrows: int, row_bytes: int, limit: int = BULK_BATCH) -> list[tuple[int, int]]:
    """A part's rows cut into ranges of at most ``limit`` bytes (one row at least): a transfer's
    items, so no transfer carries much more than ``limit``."""
    per = max(1, limit // max(1, row_bytes))
    return [(a, min(nrows, a + per)) for a in range(0, nrows, per)] or [(0, 0)]


def transfers(pieces: list[Piece], limit: int = BULK_BATCH) -> list[list[Piece]]:
    """``pieces`` in order, cut into transfers of about ``limit`` bytes and at most the request's
    MAX_ITEMS items."""
    out: list[list[Piece]] = [[]]
    size = 0
    for piece in pieces:
        if out[-1] and (size + piece.view.nbytes > limit or len(out[-1]) >= MAX_ITEMS):
            out.append([])
            size = 0
        out[-1].append(piece)
        size += piece.view.nbytes
    return out


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
