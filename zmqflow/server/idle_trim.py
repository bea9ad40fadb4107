"""A task server hands its free heap back to the OS once it goes quiet after traffic.

Processes zmqflow owns keep freed big blocks in the heap (``transport.memory.keep_big_blocks``):
the next big message reuses them instead of faulting fresh pages, which makes 100 MB pulls 4x
faster. The price is that a server keeps, at rest, the heap its biggest requests needed: the
temporaries of a push or of filling a table stay resident long after the traffic is gone.
jemalloc hands such pages back after a decay time; glibc only on ``malloc_trim``, and
:class:`IdleTrim` calls it when nothing would lose by it. Every ``idle`` seconds a timer looks at
the server's counters and the process's CPU time, and trims when, over the whole period, fewer
than ``QUIET_BYTES`` moved in and out (pings and status polls) and the process, every thread of
it, used under a quarter of a CPU; once, until more than ``QUIET_BYTES`` moved again. A server
under load is never trimmed: its requests keep reusing their blocks, and the hot path pays
nothing, not even a check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..rpc import Counters
from ..state import pages

__all__ = ["IdleTrim", "IDLE_TRIM", "QUIET_BYTES", "BUSY_CPU"]

log = logging.getLogger(__name__)

IDLE_TRIM = 1.0  # seconds of quiet `zmqflow serve` waits before trimming
# Moved in a period, still quiet (status polls, pings, a few scalar ops); moved since the last
# trim, nothing big was allocated for messages, so there is nothing to trim again.
QUIET_BYTES = 64 << 10
BUSY_CPU = 0.25  # of one CPU over a period: a thread of the process is working, leave its blocks


class IdleTrim:
    """Trims the heap once after traffic, when ``counters`` and the process have been quiet for a
    whole period of ``idle`` seconds; ``start`` and ``stop`` on the server's loop."""

    def __init__(self, counters: Counters, idle: float = IDLE_TRIM, *, trim: Callable[[], bool] = pages.trim,
                 cpu: Callable[[], float] = time.process_time):
        if not idle > 0:
            raise ValueError(f"idle must be > 0 seconds, got {idle}")
        self.counters = counters
        self.idle = float(idle)
        self._trim = trim
        self._cpu = cpu
        self._handle: asyncio.TimerHandle | None = None
        self._seen = self._trimmed_at = self._moved()  # bytes at the last look, and at the last trim
        self._cpu_seen = cpu()

    def _moved(self) -> int:
        c = self.counters
        return c.bytes_in + c.bytes_out

    def start(self) -> None:
        if self._handle is None:
            self._seen, self._cpu_seen = self._moved(), self._cpu()
            self._handle = asyncio.get_running_loop().call_later(self.idle, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self.idle, self._tick)
        self.check()

    def check(self) -> bool:
        """One look (the timer's, every ``idle`` seconds): trim if the period just ended was
        quiet after enough traffic; True when it trimmed."""
        moved, cpu = self._moved(), self._cpu()
        quiet = moved - self._seen < QUIET_BYTES and cpu - self._cpu_seen < BUSY_CPU * self.idle
        self._seen, self._cpu_seen = moved, cpu
        if not quiet or moved - self._trimmed_at <= QUIET_BYTES:
            return False
        since, self._trimmed_at = moved - self._trimmed_at, moved
        released = self._trim()
        self.counters.heap_trims += 1
        self._cpu_seen = self._cpu()  # the trim's own CPU time is not the next period's load
        log.debug("quiet after %d MB moved: heap trimmed (pages released: %s)", since >> 20, released)
        return True
