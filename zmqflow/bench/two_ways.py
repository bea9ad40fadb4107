"""numpy's way against a one-pass C loop, timed alternately: what ``bench optim`` and ``bench fold``
share. Each repetition runs both sides, in an order that flips every time, so drift in the
machine's load falls on both alike; the first repetition warms pages and caches and is dropped."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .report import align

__all__ = ["NUMPY", "ONE_PASS", "alternate", "timings", "format_rows"]

NUMPY, ONE_PASS = "numpy", "one pass"


def alternate(sides: Sequence[str], reps: int, measure: Callable[[str], float]) -> dict[str, list[float]]:
    """Seconds of ``reps`` runs of each side (``measure(side)`` runs one), after a warm-up of each."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(reps + 1):
        for side in (list(sides) if rep % 2 else list(sides)[::-1]):
            seconds = measure(side)
            if rep:
                times[side].append(seconds)
    return times


def timings(times: dict[str, list[float]]) -> dict[str, Any]:
    """A row's timing columns: each side's median ms and its runs, and the speedup when both ran."""
    row: dict[str, Any] = {"numpy_ms": statistics.median(times[NUMPY]) * 1e3, "numpy_s": times[NUMPY]}
    if ONE_PASS in times:
        row["one_pass_ms"] = statistics.median(times[ONE_PASS]) * 1e3
        row["one_pass_s"] = times[ONE_PASS]
        row["speedup"] = row["numpy_ms"] / row["one_pass_ms"]
    return row


def format_rows(rows: Sequence[dict[str, Any]], key: str, what: str, unbuilt: str) -> str:
    """The table both benches print, its first column each row's ``key``; ``what`` says what was
    timed (the GB/s are MB over ms); ``unbuilt`` names the C file when it is missing."""
    lines = [[key, "dtype", "MB", "numpy ms", "one pass ms", "numpy GB/s", "one pass GB/s", "speedup"]]
    for r in rows:
        one = r.get("one_pass_ms")
        lines.append([str(r[key]), r["dtype"], f"{r['mb']:.0f}", f"{r['numpy_ms']:.1f}",
                      "-" if one is None else f"{one:.1f}", f"{r['mb'] / r['numpy_ms']:.2f}",
                      "-" if one is None else f"{r['mb'] / one:.2f}", "-" if one is None else f"{r['speedup']:.2f}x"])
    text = align(lines)
    text.append(f"{what}; medians; both sides end with the same bits")
    if rows and "one_pass_ms" not in rows[0]:
        text.append(f"{unbuilt} is not built here: numpy's way only")
    return "\n".join(text)
