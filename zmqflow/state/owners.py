"""Which part of a table owns an id, and the part-local row it has there.

Static tables split ``num_embeddings`` rows over parts with TF's ``embedding_lookup`` strategies:
``mod`` (part ``id % n``, row ``id // n``) or ``div`` (contiguous blocks, the first ``num % n``
parts one row longer). Dynamic tables spread any int64 id over parts by a hash of the id. Clients
route by these, and checkpoints re-split by them, so both ends must agree: one module says it.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

__all__ = ["static_owner", "static_part_rows", "hash_owner"]


def static_part_rows(num: int, parts: int, strategy: str) -> list[int]:
    """Rows held by each part of a static table."""
    if strategy == "mod":
        return [(num - p + parts - 1) // parts for p in range(parts)]
    if strategy == "div":
        base, extra = divmod(num, parts)
        return [base + (1 if p < extra else 0) for p in range(parts)]
    raise InvalidArgument(f"partition_strategy must be 'mod' or 'div', got {strategy!r}")


def static_owner(ids: np.ndarray, num: int, parts: int, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """(part, row within the part) of each id, as TF's embedding_lookup assigns them."""
    if strategy == "mod":
        return ids % parts, ids // parts
    base, extra = divmod(num, parts)
    threshold = extra * (base + 1)
    low = ids < threshold
    part = np.where(low, ids // (base + 1), extra + (ids - threshold) // max(base, 1))
    row = np.where(low, ids % (base + 1), (ids - threshold) % max(base, 1))
    return part, row


def _mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: consecutive or strided ids spread evenly over parts."""
    z = ids.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_owner(ids: np.ndarray, parts: int) -> np.ndarray:
    return (_mix64(ids) % np.uint64(parts)).astype(np.int64)
