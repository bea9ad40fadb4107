"""What every ring call carries to say which call it is (kind, op, dtype, counts, shapes, root),
and how that description reads in an error: kept apart from the ring so that both of its data
paths (TCP chunks, shared-memory pieces) describe calls the same way."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..state.shm_schedule import FIELDS
from ..wire.dtypes import dtype_name

__all__ = ["FIELDS", "call_meta", "describe", "differing"]


def call_meta(kind: str, op: str, arrays: Sequence[Any], extra: Any = None) -> list[Any]:
    """The description a rank checks against every peer's: a difference is a ``CollectiveMismatch``."""
    shapes = [list(a.shape) for a in arrays]
    dtypes = sorted({dtype_name(np.dtype(a.dtype)) for a in arrays})
    crc = zlib.crc32(repr(shapes).encode())
    return [kind, op, ",".join(dtypes), len(arrays), int(sum(int(np.prod(s)) for s in shapes)), crc, extra]


def differing(mine: list[Any], theirs: Any) -> list[str]:
    """The fields in which two descriptions differ (a chunk of the wrong size when none do)."""
    return [f for f, x, y in zip(FIELDS, mine, theirs or [None] * len(FIELDS)) if x != y] or ["chunk size"]


def describe(meta: Any) -> str:
    if not isinstance(meta, list) or len(meta) != len(FIELDS):
        return repr(meta)
    kind, op, dtype, count, total, crc, extra = meta
    root = "" if extra is None else f" root {extra}"
    return f"{kind}({op}) of {count} {dtype} tensor(s), {total} elements, shapes #{crc:08x}{root}"
