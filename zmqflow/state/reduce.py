"""Reductions and buffers for collectives: numpy on the CPU, cupy on a GPU.

A backend owns the fused buffer of a call: it hands out host arrays to put on the wire and folds
received host chunks into the buffer. The numpy backend works in place with zero copies; the
cupy backend keeps the buffer on the GPU, reduces there with cupy kernels, and stages what crosses
the wire through pinned host memory. Its stream is a blocking one: it starts after the work queued
on CUDA's default stream (where cupy and torch queue by default), so it never reads a buffer
before that work has written it. Work on other streams must be finished by the caller.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..wire.dtypes import half_precision

__all__ = ["OPS", "reduce_in_order", "NumpyBackend", "CupyBackend", "backend_for", "finish_mean", "is_cupy", "array_module",
           "as_array", "write_back", "to_host", "to_device", "Joined", "unfuse", "mean_dtype", "mean_into"]

OPS = ("sum", "mean", "min", "max")
_UFUNC = {"sum": "add", "mean": "add", "min": "minimum", "max": "maximum"}  # mean divides at the end

try:  # optional: the GPU path
    import cupy as _cp  # type: ignore[import-not-found]
except Exception:  # pragma: no cover - depends on the machine
    _cp = None


def is_cupy(x: Any) -> bool:
    return _cp is not None and isinstance(x, _cp.ndarray)


class NumpyBackend:
    """A host buffer; chunks go on the wire as views. With ``src`` (the caller's input, only
    read) the buffer starts empty: a rank's own data is sent from ``src`` and each fold reads it
    there, so the input is never copied into the buffer first (in a ring every range is folded
    at most once before it is overwritten by allgather)."""

    xp = np

    def __init__(self, buf: np.ndarray, src: np.ndarray | None = None):
        self.buf = buf
        self.src = buf if src is None else src

    def outgoing(self, a: int, b: int, own: bool = False) -> np.ndarray:
        """``own``: this rank's own data (the first scatter-reduce step), not yet in the buffer."""
        return self.src[a:b] if own else self.buf[a:b]

    def fold(self, a: int, b: int, incoming: np.ndarray, op: str) -> None:
        getattr(np, _UFUNC[op])(self.src[a:b], incoming, out=self.buf[a:b])

    def place(self, a: int, b: int, incoming: np.ndarray) -> None:
        self.buf[a:b] = incoming

    def synchronize(self) -> None:
        pass


class CupyBackend:  # pragma: no cover - runs where a GPU is present
    """A GPU buffer; outgoing chunks are copied to pinned host memory, incoming ones uploaded
    and reduced with cupy kernels on the device."""

    def __init__(self, buf: Any):
        self.buf = buf
        self.xp = _cp
        self.stream = _cp.cuda.Stream(non_blocking=False)  # ordered after the default stream's work

    def _pinned(self, n: int) -> np.ndarray:
        mem = _cp.cuda.alloc_pinned_memory(max(1, n * self.buf.dtype.itemsize))
        return np.frombuffer(mem, self.buf.dtype, n)

    def outgoing(self, a: int, b: int, own: bool = False) -> np.ndarray:
        host = self._pinned(b - a)
        with self.stream:
            self.buf[a:b].get(out=host, stream=self.stream)
        self.stream.synchronize()
        return host

    def fold(self, a: int, b: int, incoming: np.ndarray, op: str) -> None:
        with self.stream:
            target = self.buf[a:b]
            getattr(_cp, _UFUNC[op])(target, _cp.asarray(incoming), out=target)

    def place(self, a: int, b: int, incoming: np.ndarray) -> None:
        with self.stream:
            self.buf[a:b].set(incoming, stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()


def to_host(arrays: list[Any]) -> np.ndarray:  # pragma: no cover - GPU only
    """cupy arrays (one dtype) copied once, end to end, into one flat pinned host buffer, after the
    default stream's work: how GPU buffers take the host's paths (shared memory on one host, the
    one-step small exchange)."""
    total = sum(a.size for a in arrays)
    dtype = arrays[0].dtype
    mem = _cp.cuda.alloc_pinned_memory(max(1, total * dtype.itemsize))
    host = np.frombuffer(mem, dtype, total)
    start = 0
    for a in arrays:
        a.reshape(-1).get(out=host[start:start + a.size], stream=_cp.cuda.Stream.null)
        start += a.size
    _cp.cuda.Stream.null.synchronize()
    return host


def to_device(host: np.ndarray) -> Any:  # pragma: no cover - GPU only
    """A host result back on the GPU, as a new cupy array, copied in on the default stream and
    waited for: a pinned ``host`` goes back to cupy's pool when the caller drops it."""
    with _cp.cuda.Stream.null:
        out = _cp.asarray(host)
    _cp.cuda.Stream.null.synchronize()
    return out


class Joined:
    """Several arrays of one dtype read end to end as one flat array, never copied together: a
    collective copies each piece it sends straight out of them (``copy_to``), where fusing them
    first would cost a whole extra pass over the bytes."""

    def __init__(self, parts: Sequence[np.ndarray]):
        if not parts or len({p.dtype for p in parts}) != 1:
            raise InvalidArgument("joined arrays must be at least one, all of one dtype")
        self.parts = [np.ascontiguousarray(p).reshape(-1) for p in parts]
        self.dtype = self.parts[0].dtype
        self.itemsize = self.dtype.itemsize
        self.ends = np.cumsum([p.size for p in self.parts]).tolist()
        self.size = int(self.ends[-1])

    def copy_to(self, a: int, b: int, dst: np.ndarray) -> None:
        """Elements ``[a, b)`` of the whole into ``dst`` (``b - a`` long)."""
        if not 0 <= a <= b <= self.size or len(dst) != b - a:
            raise InvalidArgument(f"range [{a}, {b}) of {self.size} elements into {len(dst)}")
        i = bisect.bisect_right(self.ends, a)
        pos = 0
        while a < b:
            start = self.ends[i - 1] if i else 0
            take = min(b, self.ends[i]) - a
            dst[pos:pos + take] = self.parts[i][a - start:a - start + take]
            pos, a, i = pos + take, a + take, i + 1


def unfuse(fused: Any, arrays: Sequence[Any]) -> list[Any]:
    """Views of the flat ``fused``, one per array of ``arrays`` (laid end to end), each shaped as it."""
    out, start = [], 0
    for a in arrays:
        out.append(fused[start:start + a.size].reshape(a.shape))
        start += a.size
    return out


def mean_dtype(dtype: Any) -> "np.dtype | None":
    """What a mean of ``dtype`` is summed in when not in ``dtype`` itself: float32 for the
    half-precision floats. A float16 sum overflows (two 40000s are inf) where the mean fits;
    summed in float32 it cannot, for any ring size, and the mean is rounded once, which is more
    exact than dividing each term first. bfloat16 has float32's range, so it gains the single
    rounding only. Only half-precision means pay the wider pass; None for every other dtype."""
    return np.dtype(np.float32) if half_precision(dtype) else None


def mean_into(out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """``out[...]``: the mean of ``parts`` (a half-precision dtype), summed left to right in float32."""
    acc = parts[0].astype(np.float32)
    for part in parts[1:]:
        np.add(acc, part, out=acc)
    acc /= len(parts)
    out[...] = acc


def reduce_in_order(parts: list[np.ndarray], op: str) -> np.ndarray:
    """A new array: ``parts`` folded left to right (``mean`` as a sum divided by their count;
    a half-precision one summed in float32, see :func:`mean_dtype`). The fixed order makes every
    rank that folds the same parts get the very same bits."""
    if op == "mean" and mean_dtype(parts[0].dtype) is not None:
        out = np.empty_like(parts[0])
        mean_into(out, parts)
        return out
    out = parts[0].copy()
    ufunc = getattr(np, _UFUNC[op])
    for part in parts[1:]:
        ufunc(out, part, out=out)
    if op == "mean":
        finish_mean(out, len(parts))
    return out


def backend_for(buf: Any, src: Any = None) -> "NumpyBackend | CupyBackend":
    """``src``: a separate read-only input (host buffers only; see :class:`NumpyBackend`)."""
    if is_cupy(buf):
        if src is not None and src is not buf:
            raise InvalidArgument("a separate input buffer is for host arrays only")
        return CupyBackend(buf)
    return NumpyBackend(buf, src)


def finish_mean(buf: Any, n: int) -> None:
    """Divide a summed buffer by the ring size: exact for floats; for integers truncated toward
    zero (as ``np.mean(...).astype(dtype)``) in integer arithmetic, as float64 cannot hold every
    int64 or uint64 past 2**53."""
    kind = buf.dtype.kind
    if kind in "fc" or str(buf.dtype) == "bfloat16":
        buf /= n
    elif kind in "iu":
        xp = _cp if is_cupy(buf) else np
        work = buf if n <= int(np.iinfo(buf.dtype).max) else buf.astype(np.int64)  # more ranks than the dtype counts
        if kind == "i":  # floor division of what is left once the remainder (with the sum's sign) is taken off
            work -= xp.fmod(work, n)
        work //= n
        if work is not buf:
            buf[...] = work
    else:
        raise InvalidArgument(f"mean of {buf.dtype} is not defined")


def array_module(a: Any) -> Any:
    """cupy for a cupy array, numpy for anything else."""
    return _cp if is_cupy(a) else np


def as_array(x: Any) -> tuple[Any, Any]:
    """(array to reduce, what to return for it): numpy and cupy arrays as they are; other
    frameworks' tensors through DLPack, zero-copy, with the result written back into them. A
    numpy array in the other byte order is copied into this machine's: chunks cross the wire in
    it, and each rank checks that what arrives has its own dtype."""
    if isinstance(x, np.ndarray):
        return (x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))), None
    if is_cupy(x):
        return x, None
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x), x
        except (RuntimeError, BufferError, TypeError):
            if _cp is not None:  # pragma: no cover - GPU only
                return _cp.from_dlpack(x), x
            raise InvalidArgument(f"cannot read a {type(x).__name__} through DLPack without copying") from None
    if isinstance(x, (int, float, list, tuple)):
        return np.asarray(x), None
    raise InvalidArgument(f"collectives take numpy or cupy arrays (or DLPack tensors), got {type(x).__name__}")


def write_back(original: Any, result: Any) -> Any:
    """``result`` into the tensor ``as_array`` read through DLPack (or ``result`` when there was none)."""
    if original is None:
        return result
    view, _ = as_array(original)
    view[...] = result
    return original
