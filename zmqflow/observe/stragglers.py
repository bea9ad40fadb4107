"""Who holds a synchronous round up: a sans-IO detector, and where what it finds is reported.

A round (a sync PS step, a ring collective) ends when its last member arrives. Given each
member's arrival time, :class:`StragglerDetector` names the slowest when it is *well behind*:

- with 3 or more members, its lag behind the median arrival exceeds
  ``max(factor x MAD, floor_s)`` (MAD: the median absolute deviation of all arrivals, which one
  slow member barely moves), so ordinary jitter among equals names no one;
- with 2 members there is no median: the later one must trail the other by more than ``floor_s``;
- and it is *sustained*: the same member was well behind in at least ``hits`` rounds within the
  last ``horizon_s`` seconds, so one slow step (a GC pause, a checkpoint) names no one. Rounds in
  which no one is behind do not dilute the count: a training step of several collectives (one per
  bucket) is held up only in its first, and the straggler must still be found.

Arrival times are seconds on one monotonic clock (``time.monotonic()`` where this package feeds it).

A finding goes to :func:`report`: one WARNING line naming the task, its lag and the median (at most
one per source and task every ``report_every_s``), and every callback given to :func:`subscribe`,
called as ``callback(source, task, lag_s)`` for every round in which the finding holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from . import timeline

__all__ = ["Straggler", "StragglerDetector", "Rounds", "subscribe", "unsubscribe", "report"]

log = logging.getLogger(__name__)

Callback = Callable[[str, str, float], Any]
_subscribers: list[Callback] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class Straggler:
    """``task`` trailed the median arrival (for 2 members: the other one) by ``lag_s`` on average
    over the rounds it was behind in; ``members`` took part in the last round."""

    source: str
    task: str
    lag_s: float
    median_s: float  # the median arrival's distance from the round's first arrival
    members: int


class StragglerDetector:
    """Sans-IO: feed one round's arrivals at a time to :meth:`observe`."""

    def __init__(self, source: str, *, factor: float = 4.0, floor_s: float = 0.1, hits: int = 4,
                 horizon_s: float = 60.0, window: int = 64):
        if factor < 0 or floor_s < 0 or horizon_s <= 0:
            raise InvalidArgument(f"straggler thresholds must be >= 0 (horizon > 0), got factor={factor}, "
                                  f"floor_s={floor_s}, horizon_s={horizon_s}")
        if not 1 <= hits <= window:
            raise InvalidArgument(f"straggler hits must be in [1, window={window}], got {hits}")
        self.source = source
        self.factor = float(factor)
        self.floor_s = float(floor_s)
        self.hits = int(hits)
        self.horizon_s = float(horizon_s)
        self._behind: deque[tuple[float, str, float]] = deque(maxlen=int(window))  # (when, task, lag)

    def behind(self, arrivals: Mapping[str, float]) -> tuple[str, float, float] | None:
        """This round alone: (the slowest, its lag, the median's offset) when it is well behind."""
        if len(arrivals) < 2:
            return None
        first = min(arrivals.values())
        times = {task: t - first for task, t in arrivals.items()}
        slowest = max(times, key=lambda task: times[task])
        if len(times) == 2:
            median = min(times.values())
            threshold = self.floor_s
        else:
            median = _median(times.values())
            mad = _median(abs(t - median) for t in times.values())
            threshold = max(self.factor * mad, self.floor_s)
        lag = times[slowest] - median
        return (slowest, lag, median) if lag > threshold else None

    def observe(self, arrivals: Mapping[str, float], at: float | None = None) -> Straggler | None:
        """Add a round (task -> arrival time; ``at``: when it ended, by default its last arrival);
        the straggler when this round's slowest has been well behind in ``hits`` rounds within
        ``horizon_s`` of ``at``."""
        found = self.behind(arrivals)
        if found is None:
            return None
        task, lag, median = found
        now = max(arrivals.values()) if at is None else at
        self._behind.append((now, task, lag))
        while self._behind and now - self._behind[0][0] > self.horizon_s:
            self._behind.popleft()
        lags = [x for _, t, x in self._behind if t == task]
        if len(lags) < self.hits:
            return None
        return Straggler(self.source, task, sum(lags) / len(lags), median, len(arrivals))


class Rounds:
    """Arrivals that come one at a time (a sync PS shard sees each push on its own), grouped by
    round id; :meth:`close` hands a finished round to the detector and reports what it finds, and
    with ``trace`` records the round (first arrival to close) on that timeline track. Keeps at
    most ``keep`` open rounds (one never closed is dropped, oldest first); arrivals for a round
    already closed (a late push, another part of the same step) are ignored."""

    def __init__(self, detector: StragglerDetector, *, keep: int = 8, trace: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.detector = detector
        self.keep = keep
        self.trace = trace
        self.clock = clock
        self._open: dict[Hashable, dict[str, float]] = {}
        self._closed: deque[Hashable] = deque(maxlen=keep)

    def arrive(self, round_id: Hashable, task: str) -> None:
        got = self._open.get(round_id)
        if got is None:
            if round_id in self._closed:
                return
            if len(self._open) >= self.keep:
                self._open.pop(next(iter(self._open)))
            got = self._open[round_id] = {}
        got.setdefault(task, self.clock())

    def close(self, round_id: Hashable) -> Straggler | None:
        got = self._open.pop(round_id, None)
        if not got:
            return None
        self._closed.append(round_id)
        now = self.clock()
        if self.trace is not None and timeline.enabled():
            start = timeline.now_us() - (now - min(got.values())) * 1e6
            timeline.complete(self.trace, f"round {round_id}", start, args={"members": sorted(got)})
        found = self.detector.observe(got, now)
        if found is not None:
            report(found)
        return found


def subscribe(callback: Callback) -> None:
    """Call ``callback(source, task, lag_s)`` for every round a straggler is found in."""
    with _lock:
        if callback not in _subscribers:
            _subscribers.append(callback)


def unsubscribe(callback: Callback) -> None:
    with _lock:
        if callback in _subscribers:
            _subscribers.remove(callback)


_last_logged: dict[tuple[str, str], float] = {}
REPORT_EVERY_S = 30.0


def report(found: Straggler, *, every_s: float | None = None) -> None:
    """Log ``found`` (at most once per source and task every ``every_s``, default
    ``REPORT_EVERY_S``) and tell every subscriber. A subscriber that raises is logged, not fatal."""
    now = time.monotonic()
    key = (found.source, found.task)
    with _lock:
        last = _last_logged.get(key)
        due = last is None or now - last >= (REPORT_EVERY_S if every_s is None else every_s)
        if due:
            if len(_last_logged) > 1024:
                _last_logged.clear()
            _last_logged[key] = now
        callbacks = list(_subscribers)
    if due:
        versus = "the median" if found.members > 2 else "the other member"
        log.warning("straggler in %s: %s is %.3f s behind %s of %d members (median %.3f s after the first)",
                    found.source, found.task, found.lag_s, versus, found.members, found.median_s)
    for cb in callbacks:
        try:
            cb(found.source, found.task, found.lag_s)
        except Exception:
            log.exception("straggler subscriber %r failed", cb)


def _median(values: Iterable[float]) -> float:
    """statistics.median's value, without the import (decimal, fractions: half a megabyte in
    every served task)."""
    xs = sorted(values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
