"""The shared-memory ring's fold: numpy's one pass per rank against the one-pass C loop.

What a rank of the ring on one host spends on summing: every rank's piece (a slot of 1 MiB, the
ring's piece size) added in rank order into the result, piece after piece, numpy's way (one
``np.add`` per rank, each a pass that writes the piece) and with ``kernels.fold_sum`` (one pass,
the result written past the cache from ``FOLD_STREAM_FROM``), alternating repetition by
repetition (:mod:`.two_ways`). The pieces come from a few slots per rank that are used over and
over, as the ring's segments are, so they are warm in the cache as a peer's freshly written
piece is. Both sides must end with the same bits (the pieces hold no NaN, whose sign and
payload the two may set differently), or the run fails. Without ``zmqflow/state/fold_c.c``
built the table says so and times numpy alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..state import kernels
from ..transport.memory import keep_big_blocks
from .report import write_jsonl
from .two_ways import NUMPY, ONE_PASS, alternate, format_rows, timings

__all__ = ["run", "format_table", "PIECE_BYTES", "SLOTS"]

PIECE_BYTES = 1 << 20  # the ring's piece: a slot of its segment
SLOTS = 8  # slots per rank's segment, reused piece after piece


def _numpy_fold(out: np.ndarray, views: list[np.ndarray]) -> None:
    np.add(views[0], views[1], out=out)
    for v in views[2:]:
        np.add(out, v, out=out)


Fold = Callable[[np.ndarray, list[np.ndarray]], None]


def _pass(out: np.ndarray, segments: list[np.ndarray], per: int, fold: Fold) -> float:
    """Seconds to fold the whole result, piece by piece, from the ranks' slots."""
    t0 = time.perf_counter()
    for i, a in enumerate(range(0, len(out), per)):
        b = min(a + per, len(out))
        slot = (i % SLOTS) * per
        fold(out[a:b], [seg[slot:slot + b - a] for seg in segments])
    return time.perf_counter() - t0


def run(quick: bool = False, mb: float | None = None, dtype: str = "float32", ranks: Sequence[int] = (2, 3),
        reps: int | None = None, json_out: str | None = None) -> list[dict[str, Any]]:
    """One row per rank count: median seconds to fold an ``mb`` MB result each way, and the ratio."""
    keep_big_blocks()  # as a ring rank: the result's blocks are reused, not faulted in anew
    mb = mb if mb is not None else (16 if quick else 64)
    reps = reps if reps is not None else (3 if quick else 7)
    itemsize = np.dtype(dtype).itemsize
    n = max(1, int(mb * 1e6) // itemsize)
    per = PIECE_BYTES // itemsize
    stream = n * itemsize >= kernels.FOLD_STREAM_FROM
    rng = np.random.default_rng(0)
    built = kernels.compiled()
    rows = []
    for k in ranks:
        segments = [rng.standard_normal(per * SLOTS).astype(dtype) for _ in range(k)]
        outs = {NUMPY: np.empty(n, dtype)}
        folds: dict[str, Fold] = {NUMPY: _numpy_fold}
        if built:
            outs[ONE_PASS] = np.empty(n, dtype)

            def one_pass(o: np.ndarray, views: list[np.ndarray]) -> None:
                if not kernels.fold_sum(o, views, 0, stream):
                    raise AssertionError("fold_sum did not take the ring's own pieces")

            folds[ONE_PASS] = one_pass
        times = alternate(list(outs), reps, lambda side: _pass(outs[side], segments, per, folds[side]))
        if built and outs[NUMPY].tobytes() != outs[ONE_PASS].tobytes():
            raise AssertionError(f"{k} ranks: the one-pass fold and numpy's disagree")
        row: dict[str, Any] = {"ranks": k, "dtype": dtype, "mb": n * itemsize / 1e6, "reps": reps, "streamed": stream,
                               **timings(times)}
        rows.append(row)
    if json_out:
        write_jsonl(json_out, [{"bench": "fold", **r} for r in rows])
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    return format_rows(rows, "ranks", "one ring rank's sum of every rank's 1 MiB pieces into its result; "
                       "GB/s of result", "zmqflow/state/fold_c.c")
