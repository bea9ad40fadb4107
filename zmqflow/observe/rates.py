"""Rates from successive status readings of a task: steps/s, samples/s, bytes/s.

Sans-IO: the watcher feeds each task's status reply as it arrives and reads the rates back. Time
is the task's own uptime (its monotonic clock when it answered), so the network's delay does not
skew a rate. A new process (another pid), a clock that did not advance or a counter that went
back starts the task's history again rather than showing a negative or infinite rate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from .status_reply import clean_status

__all__ = ["Reading", "Rates", "RateTracker", "rate"]


@dataclass(frozen=True, slots=True)
class Reading:
    """One status reply of one task, reduced to what rates need."""

    t: float  # the task's uptime in seconds when it answered
    pid: int | None
    step: int | None
    samples: int | None
    bytes: int  # bytes in plus bytes out since the task started

    @classmethod
    def from_status(cls, reply: Mapping[str, Any]) -> "Reading":
        """From a ``master.status`` reply (its ``uptime_s``, ``pid``, ``counters``, ``progress``); a
        field of another type counts as absent (see :func:`.status_reply.clean_status`)."""
        clean = clean_status(reply)
        counters = clean.get("counters", {})
        progress = clean.get("progress", {})
        return cls(t=float(clean.get("uptime_s", 0.0)), pid=clean.get("pid"), step=progress.get("step"),
                   samples=progress.get("samples"), bytes=counters.get("bytes_in", 0) + counters.get("bytes_out", 0))


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-second rates over the readings in the window; None where there is no basis yet."""

    steps: float | None = None
    samples: float | None = None
    bytes: float | None = None


def rate(first: int | None, last: int | None, seconds: float) -> float | None:
    """``(last - first) / seconds``; None when either count is missing or no time passed."""
    if first is None or last is None or seconds <= 0:
        return None
    return (last - first) / seconds


def _continues(prev: Reading, cur: Reading) -> bool:
    """Whether ``cur`` can follow ``prev`` in one process's history."""
    if cur.pid != prev.pid or cur.t <= prev.t or cur.bytes < prev.bytes:
        return False
    for a, b in ((prev.step, cur.step), (prev.samples, cur.samples)):
        if a is not None and b is not None and b < a:
            return False
    return True


class RateTracker:
    """Each task's readings of the last ``window`` seconds (of its own time) and the rates over them."""

    def __init__(self, window: float = 10.0):
        if not window > 0:
            raise InvalidArgument(f"RateTracker window must be > 0 seconds, got {window!r}")
        self.window = window
        self._history: dict[Hashable, deque[Reading]] = {}

    def update(self, key: Hashable, reading: Reading) -> Rates:
        """Add ``reading`` for ``key``; the rates over its history now."""
        hist = self._history.get(key)
        if hist is None or not _continues(hist[-1], reading):
            if hist is not None and reading.pid == hist[-1].pid and reading.t == hist[-1].t:
                return self.rates(key)  # the same answer seen twice: nothing new
            hist = self._history[key] = deque()
        hist.append(reading)
        while len(hist) > 2 and reading.t - hist[1].t >= self.window:
            hist.popleft()  # keep the oldest reading that still spans the window
        return self.rates(key)

    def rates(self, key: Hashable) -> Rates:
        hist = self._history.get(key)
        if not hist or len(hist) < 2:
            return Rates()
        first, last = hist[0], hist[-1]
        dt = last.t - first.t
        return Rates(steps=rate(first.step, last.step, dt), samples=rate(first.samples, last.samples, dt),
                     bytes=rate(first.bytes, last.bytes, dt))

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s history (a task that stopped answering starts afresh when it returns)."""
        self._history.pop(key, None)
