"""Timing and statistics shared by the benchmarks, so every table is measured the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["clamp", "median_seconds", "memcpy_gbps", "percentile", "seconds", "seconds_async"]


def clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def seconds(call: Callable[[], Any]) -> float:
    """Wall seconds of one ``call()``."""
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


async def seconds_async(call: Callable[[], Awaitable[Any]]) -> float:
    """Wall seconds of one ``await call()``."""
    t0 = time.perf_counter()
    await call()
    return time.perf_counter() - t0


def median_seconds(call: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``reps`` calls; ``before`` runs untimed ahead of each (e.g. a barrier, so
    every rank of a collective starts each call together)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        times.append(seconds(call))
    return statistics.median(times)


def percentile(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def memcpy_gbps(size: int, copies: int, batches: int) -> float:
    """Median GB/s (10**9 bytes/s) of ``np.copyto`` between two warm float32 arrays of ``size``
    bytes, timing ``batches`` batches of ``copies`` copies each: the physical reference."""
    src = np.ones(size // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)

    def batch() -> None:
        for _ in range(copies):
            np.copyto(dst, src)

    return statistics.median(size * copies / seconds(batch) / 1e9 for _ in range(batches))
