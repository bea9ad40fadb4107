"""Memory-bound loops that numpy does in more passes than they need, in C where it was built.

``zmqflow/state/kernels_c.c`` and ``fold_c.c`` are compiled by ``pip install`` where a C compiler
is there (optional, as the hash probe). Each function here checks that the arrays are ones the C
loop takes and otherwise does numpy's way, with the same result: numpy's bits, except that a NaN
result's sign and payload are unspecified (NaN either way; see kernels_c.c and fold_c.c).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    from . import kernels_c as _built  # type: ignore[attr-defined]
except ImportError:  # not built here: numpy does the same work
    _built = None
try:
    from . import fold_c as _built_fold  # type: ignore[attr-defined]
except ImportError:
    _built_fold = None
_kernels = _built  # what the functions call: the modules, or None when not built or turned off
_folds = _built_fold

__all__ = ["compiled", "use_compiled", "scaled", "sub_scaled", "momentum_step", "adagrad_step", "adam_step",
           "axpy_many", "momentum_many", "adagrad_many", "adam_many", "copy_into", "fold_sum", "add_into",
           "segment_sum", "first_seen", "runs",
           "FUSED", "STREAM_FROM", "FOLD_STREAM_FROM", "MAX_FOLD"]

FUSED = (np.dtype(np.float32), np.dtype(np.float64))  # the dtypes the C loops take
# Copies from this size on stream past the cache: below it the destination may well be read
# again while it is still cached, and the plain copy is as fast.
STREAM_FROM = 1 << 20
# A reduction's result from this size on is written past the cache: by the time it is whole its
# first pieces have left the cache anyway (the shared cache also holds every rank's slots), and
# the plain stores would read each line of it first.
FOLD_STREAM_FROM = 4 << 20
MAX_FOLD = 64  # views one fold takes (fold_c.c's MAX_FOLD)
# first_seen's hash key, drawn once a process: ids chosen to collide in its table (a shard groups
# the ids a request names) cannot be found without it
_SEED = int.from_bytes(os.urandom(8), "little")


def compiled() -> bool:
    """Whether the C loops run (built here, and not turned off)."""
    return _kernels is not None and _folds is not None


def use_compiled(on: bool) -> bool:
    """Turn the C loops on or off (on only where built), for a benchmark's numpy side or to rule
    them out; returns the previous setting. The results are the same either way."""
    global _kernels, _folds
    before = compiled()
    _kernels, _folds = (_built, _built_fold) if on else (None, None)
    return before


def scaled(x: np.ndarray, scale: float, dtype: np.dtype) -> np.ndarray:
    """``x * scale`` as a new array of ``dtype``. The Python float is a weak scalar (NEP 50), so
    float16/32/64 multiply in their own precision; bfloat16 (ml_dtypes) multiplies in float32
    and rounds once. ``np.multiply(x, scale, dtype=bfloat16)`` would refuse to cast the float."""
    out = np.empty(x.shape, dtype)
    np.multiply(x, scale, out=out)
    return out


def _takes(written: list[np.ndarray], read: list[np.ndarray]) -> bool:
    """Whether a C loop takes these arrays: one dtype and shape, contiguous and aligned (the C
    loops read and write whole elements of their type: a view at an odd offset of a frame is
    left to numpy), the written ones writeable and apart from every other array (the read ones
    are only read: they may share memory with one another, as a fold's views of one array may)."""
    arrays = written + read
    first = arrays[0]
    dtype, shape, nwritten = first.dtype, first.shape, len(written)
    for i, a in enumerate(arrays):
        flags = a.flags
        if a.dtype != dtype or a.shape != shape or not (flags.c_contiguous and flags.aligned):
            return False
        if i < nwritten and not flags.writeable:
            return False
    return not any(np.may_share_memory(w, a) for i, w in enumerate(written) for a in arrays[i + 1:])


def _judged(update: Callable[..., None], *args: Any) -> bool:
    """``update(*args)``, a C update, where it takes the arrays: it checks each one before it
    writes any (one of float32 or float64, contiguous, aligned, the written ones writeable and
    apart from every other, ``_takes``'s rule but for the shapes, which callers compare), and
    refuses the call otherwise; then False, nothing done. Cheaper than judging them here: a small
    variable's push paid more for ``_takes``'s pairwise overlap checks than for its update."""
    try:
        update(*args)
    except (TypeError, ValueError, BufferError):
        return False
    return True


def _aligned(x: np.ndarray) -> np.ndarray:
    """``x``, or a copy where it lies off its type's alignment: a gradient of a few KB received
    over tcp lies where ZeroMQ's receive buffer put it, mostly off. The copy and the C pass cost
    less than numpy's passes over it, or the failed call (an exception) before them."""
    return x if x.flags.aligned else x.copy()


def sub_scaled(param: np.ndarray, x: np.ndarray, scale: float) -> None:
    """``param -= x * scale`` in place, the product rounded to ``param``'s dtype first. One pass
    in C where the arrays allow (both float32 or both float64, contiguous, apart), with the bits
    of numpy's temporary-then-subtract, which runs everywhere else. A shard's SGD push spends
    most of its CPU here: the two passes move each byte about five times, the one pass three."""
    if not (param.shape == x.shape and _kernels is not None and _judged(_kernels.axpy, param, _aligned(x), -scale)):
        param -= scaled(x, scale, param.dtype)


def add_into(y: np.ndarray, x: np.ndarray, sign: float) -> bool:
    """``y += x`` (``sign`` 1.0) or ``y -= x`` (-1.0) in one C call where it fits: float32 or
    float64, both contiguous, apart (the C call checks, and refuses otherwise); False (nothing
    done) where not. The caller has checked that ``x`` has ``y``'s shape and dtype. Multiplying by
    one is exact, so the bits are numpy's; a scalar update skips the ufunc machinery (~1 us)."""
    if _kernels is None or y.dtype not in FUSED:
        return False
    try:
        _kernels.axpy(y, x, sign)
    except (TypeError, ValueError, BufferError):
        return False
    return True


def momentum_step(param: np.ndarray, grad: np.ndarray, m: np.ndarray, lr: float, mu: float, nesterov: bool) -> bool:
    """Momentum's step (Nesterov's too) in one C pass where the arrays allow; False (nothing done) where not."""
    return (param.shape == grad.shape == m.shape and _kernels is not None
            and _judged(_kernels.momentum, param, _aligned(grad), m, lr, mu, nesterov))


def adagrad_step(param: np.ndarray, grad: np.ndarray, acc: np.ndarray, lr: float) -> bool:
    """Adagrad's step in one C pass where the arrays allow; False (nothing done) where not."""
    return (param.shape == grad.shape == acc.shape and _kernels is not None
            and _judged(_kernels.adagrad, param, _aligned(grad), acc, lr))


def adam_step(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, beta1: float, beta2: float,
              epsilon: float, lr_rows: np.ndarray) -> bool:
    """Adam's step in one C pass where the arrays allow (``lr_rows``: the step size of each row,
    one per row of ``param``); False (nothing done) where not."""
    if (_kernels is None or param.ndim == 0 or len(lr_rows) != len(param) or param.dtype not in FUSED
            or not param.shape == grad.shape == m.shape == v.shape):
        return False
    lr = np.ascontiguousarray(lr_rows, dtype=param.dtype)
    return _judged(_kernels.adam, param, _aligned(grad), m, v, 1 - beta1, beta1, 1 - beta2, beta2, epsilon, lr)


def axpy_many(ys: list[np.ndarray], xs: list[np.ndarray], a: float) -> bool:
    """``ys[i] += a * xs[i]`` for every i in one C call, where it takes every item (each as
    ``add_into``'s or ``sub_scaled``'s call would); False (nothing done) where not. The caller
    has checked each pair's shapes and dtypes."""
    return _kernels is not None and _judged(_kernels.axpy_many, ys, [_aligned(x) for x in xs], a)


def momentum_many(params: list[np.ndarray], grads: list[np.ndarray], ms: list[np.ndarray], lr: float, mu: float,
                  nesterov: bool) -> bool:
    """``momentum_step`` on every item in one C call; False (nothing done) where one does not fit."""
    return _kernels is not None and _judged(_kernels.momentum_many, params, [_aligned(g) for g in grads], ms, lr, mu,
                                            nesterov)


def adagrad_many(params: list[np.ndarray], grads: list[np.ndarray], accs: list[np.ndarray], lr: float) -> bool:
    """``adagrad_step`` on every item in one C call; False (nothing done) where one does not fit."""
    return _kernels is not None and _judged(_kernels.adagrad_many, params, [_aligned(g) for g in grads], accs, lr)


def adam_many(params: list[np.ndarray], grads: list[np.ndarray], ms: list[np.ndarray], vs: list[np.ndarray],
              steps: list[np.ndarray], table: np.ndarray, beta1: float, beta2: float, epsilon: float,
              learning_rate: float) -> list[int] | None:
    """Adam's step on every item in one C call: each ``steps[i]`` (a count a row) added one,
    each row's step size ``learning_rate * table[count]`` (the bias table), then ``adam_step``'s
    pass. Returns the items it left as they were, whose counts would pass the table (for the
    one-part way, which computes those rates); None (nothing done) where an item does not fit."""
    if _kernels is None:
        return None
    try:
        return _kernels.adam_many(params, [_aligned(g) for g in grads], ms, vs, steps, table, 1 - beta1, beta1,
                                  1 - beta2, beta2, epsilon, learning_rate)
    except (TypeError, ValueError, BufferError):
        return None


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``. From STREAM_FROM bytes on, where both are contiguous arrays of one
    dtype and shape, with streaming stores: a plain copy first reads each destination line into
    the cache, a third pass over memory (a pull into ``out=`` spent a third to a half of its
    time copying)."""
    if _kernels is not None and src.nbytes >= STREAM_FROM and _takes([dst], [src]):
        _kernels.copy(dst, src)
    else:
        dst[...] = src


def segment_sum(rows: np.ndarray, order: np.ndarray, starts: np.ndarray,
                weights: np.ndarray | None = None) -> np.ndarray:
    """``np.add.reduceat(rows[order] * weights, starts, axis=0)`` (no product without ``weights``),
    with its bits: each run of ``order`` (from one start to the next) summed in numpy's pairwise
    order. ``order`` may name a row more than once (a bag's rows read from the unique ones);
    ``weights``, one a position of ``order``, of the rows' dtype. In one C pass over the rows in
    place where it was built and ``rows`` is float32 or float64 (``order`` and ``starts`` int64);
    reduceat walks a 4096 x 64 gradient at about 0.2 GB/s, most of an embedding push's client time."""
    if _kernels is None or rows.dtype not in FUSED or rows.ndim < 1 or not len(starts) or (
            weights is not None and weights.dtype != rows.dtype):
        picked = rows[order]
        if weights is not None:
            picked = picked * weights.reshape(-1, *(1,) * (rows.ndim - 1))
        return np.add.reduceat(picked, starts, axis=0)
    flat = np.require(rows, requirements=("C", "A")).reshape(len(rows), -1)  # a view off its alignment: a copy
    out = np.empty((len(starts), *rows.shape[1:]), rows.dtype)
    if flat.shape[1]:
        aligned = ("C", "A")
        _kernels.segment_sum(out, flat, np.require(order, np.int64, aligned), np.require(starts, np.int64, aligned),
                             flat.shape[1], None if weights is None else np.require(weights, rows.dtype, aligned))
    return out


def first_seen(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(the distinct ``ids`` in order of first appearance, each id's index among them), from int64
    ``ids`` in one pass of a hash table; None (nothing done) where the C loops do not run. With it,
    a batch of 4096 Zipf ids' sorted uniques and inverse took 71 us, ``np.unique`` 138-208."""
    if _kernels is None or ids.dtype != np.int64 or ids.ndim != 1:
        return None
    first, inverse = np.empty(len(ids), np.int64), np.empty(len(ids), np.int64)
    u = _kernels.first_seen(np.require(ids, requirements=("C", "A")), _SEED, first, inverse)
    return first[:u], inverse


def runs(inverse: np.ndarray, u: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts) for :func:`segment_sum`: the positions of group 0, then group 1, ..., each
    group's in increasing order (a stable sort of ``inverse``, int64 in ``[0, u)``), and where each
    group begins; counted in C where it was built."""
    if _kernels is None:
        order = np.argsort(inverse, kind="stable")
        return order, np.searchsorted(inverse[order], np.arange(u))
    order, starts = np.empty(len(inverse), np.int64), np.empty(u, np.int64)
    _kernels.runs(np.require(inverse, np.int64, ("C", "A")), u, order, starts)
    return order, starts


def fold_sum(out: np.ndarray, views: list[np.ndarray], div: int = 0, stream: bool = False) -> bool:
    """``out[...] = ((views[0] + views[1]) + views[2]) + ...``, divided by ``div`` unless it is 0,
    in one pass where the C loop takes the arrays (out and views all float32 or all float64, of one
    shape, contiguous and aligned, out writeable and apart from every view), with the bits of
    numpy's ``np.add`` per view and ``out /= div``; False (nothing done) where it does not.
    ``stream``: write ``out`` with non-temporal stores. numpy makes one pass per view, each
    writing out."""
    if _folds is None or not 2 <= len(views) <= MAX_FOLD or out.dtype not in FUSED:
        return False
    if not _takes([out], views):
        return False
    _folds.fold(out, views, div, stream)
    return True
