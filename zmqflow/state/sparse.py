"""Sparse rows, sans-IO: summing the rows of repeated ids. Where the C loops were built the ids are
grouped by a hash table and each id's rows summed in one pass; else a sort and one reduceat. Both
keep reduceat's bits, and both are many times faster than ``np.add.at``."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..wire.dtypes import half_precision
from .kernels import first_seen, runs, segment_sum

__all__ = ["unique_sum", "unique_inverse", "groups", "strictly_increasing", "has_repeats", "int64_ids"]


def unique_sum(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``ids`` and, for each, the sum of its ``rows``, returned in the rows' dtype.
    Half-precision rows are summed in float32: bfloat16 cannot count past 256 (its 8-bit
    significand), so a hot id's 3000 gradients of 1 would sum to 256."""
    if strictly_increasing(ids):  # unique and sorted already, as a client sends them
        return ids, rows
    uniq, order, starts = groups(ids)
    if len(uniq) == len(ids):  # already unique: just reorder
        return uniq, rows[order]
    if not half_precision(rows.dtype):
        return uniq, segment_sum(rows, order, starts)
    return uniq, segment_sum(rows.astype(np.float32), order, starts).astype(rows.dtype)


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` for 1-D ids: the sorted distinct ids and, for each
    id, its index among them. Grouped by a hash table in C where it was built (only the distinct
    ids are sorted: a batch of 4096 Zipf ids has about 1,350)."""
    grouped = first_seen(ids)
    if grouped is None:
        return np.unique(ids, return_inverse=True)
    first, inverse = grouped
    perm = np.argsort(first)
    rank = np.empty(len(first), np.int64)
    rank[perm] = np.arange(len(first))
    return first[perm], np.take(rank, inverse)


def groups(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the sorted distinct ``ids``, the positions of each one's occurrences in the order they came,
    one id after another, and where each id's begin there): what :func:`segment_sum` reads to sum
    each id's rows in reduceat's order."""
    uniq, inverse = unique_inverse(ids)
    order, starts = runs(inverse, len(uniq))
    return uniq, order, starts


def strictly_increasing(ids: np.ndarray) -> bool:
    """Whether ``ids`` are unique and sorted already (``np.unique``'s order, as a client sends them):
    one pass, no sort."""
    return len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())


def has_repeats(ids: np.ndarray) -> bool:
    """Whether any id occurs twice (a sort of the ids alone: no rows move). Ids already strictly
    increasing are told in one pass, no sort."""
    if strictly_increasing(ids):
        return False
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


_INT64_MAX = np.iinfo(np.int64).max


def int64_ids(ids: np.ndarray, what: str) -> np.ndarray:
    """``ids`` as int64, or InvalidArgument naming ``what``: non-integers, and unsigned ids past
    int64's range, which a cast would wrap onto negative ids (another row)."""
    if ids.size and ids.dtype.kind not in "iu":
        raise InvalidArgument(f"{what}: ids must be integers, got {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) > _INT64_MAX:
        raise InvalidArgument(f"{what}: id {int(ids.max())} is past the largest id, 2**63 - 1")
    return ids.astype(np.int64, copy=False)
