"""Which of a task's bulk streams (:mod:`.bulk_streams`) carry a pull or push, and how its share
is cut into transfers for them.

One TCP connection moves a few GB/s at most, bound by the one thread at each end that copies its
bytes through the kernel. A pull from fewer tasks than ``ZMQFLOW_BULK_LANES`` (2 by default, at
most ``MAX_LANES``) spreads over that many pull streams in all, at least ``LANE_BYTES`` each,
each stream with its own sending and receiving thread: several streams per peer where one cannot
fill the link. A pull from as many tasks has its streams already. A push keeps to one stream a
task: the shard's loop reads and applies every push stream itself, so a second adds switching
between them, not a core.

A task's share is cut into a multiple of its streams' count of transfers of about equal size, at
most ``BULK_BATCH`` bytes each (a row may carry one past it), whatever its parts' sizes: a part's
rows end a transfer where the task's running bytes pass a multiple of the transfer size. Each
transfer goes to the stream with the fewest bytes so far.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..cluster import TaskId
from ..errors import ConfigError
from ..wire.requests.base import MAX_ITEMS
from .bulk_pull import BULK_BATCH, BULK_FROM, Piece
from .port import SessionPort

__all__ = ["LANE_BYTES", "LANES_ENV", "MAX_LANES", "Lanes", "lanes", "streams"]

LANE_BYTES = 8 << 20
LANES_ENV = "ZMQFLOW_BULK_LANES"
MAX_LANES = 4  # with a push stream, 5 of a task's 16 streams per caller


def lanes() -> int:
    """The pull streams a pull spreads over in all (``ZMQFLOW_BULK_LANES``; 2 where unset)."""
    raw = os.environ.get(LANES_ENV, "").strip()
    if not raw:
        return 2
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not raw.isascii() or not 1 <= n <= MAX_LANES:
        raise ConfigError(f"{LANES_ENV} must be a whole number of streams, 1 to {MAX_LANES}, got {raw!r}")
    return n


class Lanes:
    """A task's streams of one kind for one pull or push, and how its ``nbytes`` are cut for them:
    :meth:`rows` cuts each part in turn, :meth:`spread` groups the pieces into transfers."""

    def __init__(self, streams: list[Any], nbytes: int):
        count = len(streams) * max(1, -(-nbytes // (len(streams) * BULK_BATCH)))
        self.streams = streams
        self.limit = max(1, -(-nbytes // count))  # a transfer's bytes
        self._at = 0  # the task's bytes cut so far

    def rows(self, nrows: int, row_bytes: int) -> list[tuple[int, int]]:
        """The next part's rows as ranges, each ending at the first row end at or past a multiple of
        ``limit`` in the task's running bytes (a part of no rows: one empty range)."""
        out, a = [], 0
        while a < nrows:
            room = self.limit - self._at % self.limit
            k = min(nrows - a, max(1, -(-room // max(1, row_bytes))))
            out.append((a, a + k))
            self._at += k * row_bytes
            a += k
        return out or [(0, 0)]

    def whole(self, nbytes: int) -> None:
        """The next part goes whole (a scalar): its bytes count toward the running total."""
        self._at += nbytes

    def spread(self, pieces: list[Piece]) -> list[tuple[Any, list[Piece]]]:
        """``pieces`` (as cut, in order) as transfers, each the pieces that start within one
        multiple of ``limit`` (at most MAX_ITEMS), with the stream each goes on."""
        groups: list[list[Piece]] = []
        at, current = 0, -1
        for p in pieces:
            j = at // self.limit
            if j != current or len(groups[-1]) >= MAX_ITEMS:
                groups.append([])
                current = j
            groups[-1].append(p)
            at += p.view.nbytes
        load = [0] * len(self.streams)
        out = []
        for group in groups:
            i = load.index(min(load))
            load[i] += sum(p.view.nbytes for p in group)
            out.append((self.streams[i], group))
        return out


async def streams(sess: SessionPort, shares: Mapping[TaskId, int], kind: str = "pull") -> dict[TaskId, Lanes]:
    """The bulk streams of ``kind`` of the tasks whose ``shares`` (bytes of this pull or push)
    reach BULK_FROM: one each, or for a pull the session's ``bulk_lanes`` in all (the largest
    shares take the remainder), at least LANE_BYTES each."""
    big = sorted(((nbytes, i, task) for i, (task, nbytes) in enumerate(shares.items()) if nbytes >= BULK_FROM),
                 reverse=True)
    total = sess.bulk_lanes if kind == "pull" else 1
    out = {}
    for rank, (nbytes, _, task) in enumerate(big):
        if (first := await sess.bulk_stream(task, kind)) is None:
            continue
        got = [first]
        want = max(1, total // len(big) + (rank < total % len(big)))
        for lane in range(1, min(want, nbytes // LANE_BYTES)):
            if (more := await sess.bulk_stream(task, kind, lane)) is not None:
                got.append(more)
        out[task] = Lanes(got, nbytes)
    return out
