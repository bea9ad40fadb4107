"""A shard's optimizer step: numpy's chain of whole-array passes against the one-pass C loops.

What a dense push costs a ps shard beyond receiving it: each optimizer applied through
``ShardStore.apply_dense`` to a float variable in the 4 MiB row ranges a push arrives in (the
client's slices), numpy's way (``kernels.use_compiled(False)``) and the one-pass way
(``zmqflow/state/kernels_c.c``), alternating repetition by repetition on the same machine. Both
sides start from the same values and must end with the same bits, or the run fails. Without the
C module built the table says so and times numpy alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..state import kernels
from ..state.optim import SGD, Adagrad, Adam, Momentum, Optimizer
from ..state.store import ShardStore
from ..transport.memory import keep_big_blocks
from .report import write_jsonl
from .two_ways import NUMPY, ONE_PASS, alternate, format_rows, timings

__all__ = ["OPTIMIZERS", "run", "format_table"]

OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": SGD(0.01),
    "momentum": Momentum(0.01),
    "nesterov": Momentum(0.01, nesterov=True),
    "adagrad": Adagrad(0.01),
    "adam": Adam(0.001),
}
CHUNK_BYTES = 4 << 20  # the slices a push arrives in (``zmqflow.client.variables.SLICE_BYTES``)


def _store(opt: Optimizer, rows: int, cols: int, dtype: str, init: np.ndarray) -> ShardStore:
    store = ShardStore()
    store.create("w", 0, [rows, cols], [0, rows], dtype, optimizer=opt.spec())
    store.assign("w", 0, init)
    return store


def _step(store: ShardStore, grad: np.ndarray, per: int) -> float:
    """Seconds to apply ``grad`` to the whole variable, ``per`` rows at a time."""
    t0 = time.perf_counter()
    for a in range(0, len(grad), per):
        b = min(a + per, len(grad))
        store.apply_dense("w", 0, grad[a:b], a, b)
    return time.perf_counter() - t0


def _state(store: ShardStore) -> list[bytes]:
    part = store.get("w", 0)
    return [part.value.tobytes(), *(s.tobytes() for s in part.slots.values())]


def run(quick: bool = False, mb: float | None = None, dtype: str = "float32", names: Sequence[str] | None = None,
        reps: int | None = None, json_out: str | None = None) -> list[dict[str, Any]]:
    """One row per optimizer: median seconds of a step over ``mb`` MB each way, and the ratio."""
    keep_big_blocks()  # a shard's allocator: numpy's temporaries reuse their blocks, as in `zmqflow serve`
    mb = mb if mb is not None else (16 if quick else 64)
    reps = reps if reps is not None else (3 if quick else 7)
    cols = 64
    itemsize = np.dtype(dtype).itemsize
    rows = max(1, int(mb * 1e6) // (cols * itemsize))
    per = max(1, CHUNK_BYTES // (cols * itemsize))
    rng = np.random.default_rng(0)
    init = rng.standard_normal((rows, cols)).astype(dtype)
    grad = (rng.standard_normal((rows, cols)) * 1e-2).astype(dtype)
    built = kernels.compiled()
    out = []
    for name in names or list(OPTIMIZERS):
        opt = OPTIMIZERS[name]
        sides = {NUMPY: _store(opt, rows, cols, dtype, init)}
        if built:
            sides[ONE_PASS] = _store(opt, rows, cols, dtype, init)

        def step(side: str) -> float:  # the side's way turned on for its run alone
            before = kernels.use_compiled(side == ONE_PASS)
            try:
                return _step(sides[side], grad, per)
            finally:
                kernels.use_compiled(before)

        times = alternate(list(sides), reps, step)
        if built and _state(sides[NUMPY]) != _state(sides[ONE_PASS]):
            raise AssertionError(f"{name}: the one-pass step and numpy's disagree")
        row: dict[str, Any] = {"optimizer": name, "dtype": dtype, "mb": rows * cols * itemsize / 1e6, "reps": reps,
                               **timings(times)}
        out.append(row)
    if json_out:
        write_jsonl(json_out, [{"bench": "optim", **r} for r in out])
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    return format_rows(rows, "optimizer", "a dense push's optimizer step on one shard, in 4 MiB row "
                       "ranges; GB/s of gradient", "zmqflow/state/kernels_c.c")
