"""Initializers (``zf.init``): declarative, so a shard can initialize its own part of a variable.

An initializer is a small spec that travels in a declaration; the shard that owns a part builds
the values for its rows. Random initializers draw from a generator seeded by ``(seed, first row)``,
so a part's values do not depend on which process declared it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument

__all__ = [
    "Initializer",
    "zeros",
    "ones",
    "constant",
    "normal",
    "truncated_normal",
    "uniform",
    "glorot_uniform",
    "from_spec",
    "build",
]


@dataclass(frozen=True)
class Initializer:
    kind: str
    value: float = 0.0
    mean: float = 0.0
    stddev: float = 1.0
    minval: float = 0.0
    maxval: float = 1.0
    seed: int = 0

    def spec(self) -> dict[str, Any]:
        return asdict(self)


def zeros() -> Initializer:
    return Initializer("constant", value=0.0)


def ones() -> Initializer:
    return Initializer("constant", value=1.0)


def constant(value: float) -> Initializer:
    return Initializer("constant", value=float(value))


def normal(stddev: float = 1.0, mean: float = 0.0, seed: int = 0) -> Initializer:
    return Initializer("normal", mean=float(mean), stddev=float(stddev), seed=int(seed))


def truncated_normal(stddev: float = 1.0, mean: float = 0.0, seed: int = 0) -> Initializer:
    """Normal values redrawn until within two standard deviations of the mean (as TF's)."""
    return Initializer("truncated_normal", mean=float(mean), stddev=float(stddev), seed=int(seed))


def uniform(minval: float = 0.0, maxval: float = 1.0, seed: int = 0) -> Initializer:
    return Initializer("uniform", minval=float(minval), maxval=float(maxval), seed=int(seed))


def glorot_uniform(seed: int = 0) -> Initializer:
    """Uniform in ±sqrt(6 / (fan_in + fan_out)), fans taken from the whole variable's shape."""
    return Initializer("glorot_uniform", seed=int(seed))


_KINDS = {"constant", "normal", "truncated_normal", "uniform", "glorot_uniform"}


def from_spec(spec: Any) -> Initializer:
    if isinstance(spec, Initializer):
        return spec
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str) or spec["kind"] not in _KINDS:
        raise InvalidArgument(f"unknown initializer {spec!r}; use one of zf.init.{', zf.init.'.join(sorted(_KINDS))}")
    fields = {k: v for k, v in spec.items() if k in Initializer.__dataclass_fields__}
    return Initializer(**fields)


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return shape[-2] * receptive, shape[-1] * receptive


_CHUNK = 1 << 20  # truncated normal values drawn per step (its redraws depend on the chunk: kept for its values)
_DRAW = 1 << 16  # other random values drawn per step: 512 KB of float64 scratch, reused from the heap


def build(init: Initializer, full_shape: tuple[int, ...], rows: tuple[int, int], dtype: np.dtype, salt: int = 0,
          out: np.ndarray | None = None) -> np.ndarray:
    """The values of rows ``[rows[0], rows[1])`` of a variable of ``full_shape``, written into
    ``out`` when given (C-contiguous, that shape and ``dtype``: a table's own rows, no copy).

    Random values are drawn in chunks straight into an array of ``dtype`` (a 2.5 GB float32 table
    never needs a 5 GB float64 temporary), from a generator seeded by ``(seed, rows[0], salt)``.
    The chunks are small: the heap keeps its high-water mark resident, and normal and uniform
    draws are the same values however they are chunked.
    """
    part_shape = (rows[1] - rows[0], *full_shape[1:]) if full_shape else ()
    if out is None:
        out = np.empty(part_shape, dtype=dtype)
    elif out.shape != part_shape or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {np.dtype(dtype)} array of shape {part_shape}")
    if init.kind == "constant":
        out[...] = init.value
        return out
    rng = np.random.default_rng([init.seed, rows[0]] + ([salt] if salt else []))
    flat = out.reshape(-1)
    if init.kind == "glorot_uniform":
        fan_in, fan_out = _fans(full_shape)
        limit = math.sqrt(6.0 / max(1, fan_in + fan_out))  # as TF: an empty shape has no fans
    step = _CHUNK if init.kind == "truncated_normal" else _DRAW
    for start in range(0, flat.size, step):
        n = min(step, flat.size - start)
        if init.kind == "normal":
            chunk = rng.normal(init.mean, init.stddev, n)
        elif init.kind == "truncated_normal":
            chunk = rng.normal(0.0, 1.0, n)
            bad = np.abs(chunk) > 2.0
            while bad.any():
                chunk[bad] = rng.normal(0.0, 1.0, int(bad.sum()))
                bad = np.abs(chunk) > 2.0
            chunk = chunk * init.stddev + init.mean
        elif init.kind == "uniform":
            chunk = rng.uniform(init.minval, init.maxval, n)
        else:  # glorot_uniform
            chunk = rng.uniform(-limit, limit, n)
        flat[start:start + n] = chunk
    return out
