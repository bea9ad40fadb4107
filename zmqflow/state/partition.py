"""Partitioners: how many parts a variable is split into along axis 0, and each part's rows.

TF's semantics: ``fixed_size_partitioner(n)`` asks for n parts; ``min_max_variable_partitioner``
asks for as many parts as keep each at least ``min_slice_size`` bytes, at most
``max_partitions``. Rows are split as TF slices them: ``dim // n`` each, the first ``dim % n``
parts one row more. Never more parts than rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .splits import even_splits

__all__ = [
    "Partitioner",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
    "num_partitions",
    "row_splits",
]


@dataclass(frozen=True)
class Partitioner:
    kind: str
    num_shards: int = 1
    max_partitions: int = 1
    min_slice_size: int = 256 << 10

    def __call__(self, shape: Sequence[int], dtype: Any) -> list[int]:
        """TF's partitioner interface: partitions per dimension (only axis 0 is split)."""
        parts = [1] * len(shape)
        if shape:
            parts[0] = self.count(tuple(shape), np.dtype(dtype))
        return parts

    def count(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        if not shape:
            return 1
        dim = shape[0]
        if self.kind == "fixed":
            n = self.num_shards
        else:
            bytes_per_row = max(1, math.prod(shape[1:]) * dtype.itemsize)
            rows_per_part = max(1, self.min_slice_size // bytes_per_row)
            n = min(self.max_partitions, math.ceil(dim / rows_per_part))
        return max(1, min(n, dim))


def fixed_size_partitioner(num_shards: int, axis: int = 0) -> Partitioner:
    if axis != 0:
        raise InvalidArgument(f"only axis 0 can be partitioned, got axis {axis}")
    if num_shards < 1:
        raise InvalidArgument(f"num_shards must be >= 1, got {num_shards}")
    return Partitioner("fixed", num_shards=int(num_shards))


def min_max_variable_partitioner(max_partitions: int = 1, axis: int = 0, min_slice_size: int = 256 << 10) -> Partitioner:
    if axis != 0:
        raise InvalidArgument(f"only axis 0 can be partitioned, got axis {axis}")
    if max_partitions < 1 or min_slice_size < 1:
        raise InvalidArgument("max_partitions and min_slice_size must be >= 1")
    return Partitioner("min_max", max_partitions=int(max_partitions), min_slice_size=int(min_slice_size))


def num_partitions(partitioner: "Partitioner | Callable[..., Any] | int | None", shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Parts for a variable: from a Partitioner, a TF-style callable, or a plain count."""
    if partitioner is None:
        return 1
    if isinstance(partitioner, Partitioner):
        return partitioner.count(shape, dtype)
    if isinstance(partitioner, int) and not isinstance(partitioner, bool):
        n = partitioner
    elif callable(partitioner):
        parts = list(partitioner(shape, dtype))
        if len(parts) != len(shape) or any(p != 1 for p in parts[1:]):
            raise InvalidArgument(f"partitioner returned {parts} for shape {shape}: only axis 0 can be split")
        n = int(parts[0]) if parts else 1
    else:
        raise InvalidArgument(f"partitioner must be a Partitioner, a callable or an int, got {type(partitioner).__name__}")
    if not shape:
        return 1
    return max(1, min(int(n), shape[0]))


def row_splits(dim: int, n: int) -> list[tuple[int, int]]:
    """Row ranges of ``n`` parts of ``dim`` rows: the first ``dim % n`` get one more."""
    return even_splits(dim, n)
