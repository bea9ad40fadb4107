"""Even splits of a range, shared by partitioned variables and ring segments."""

from __future__ import annotations

__all__ = ["even_splits"]


def even_splits(total: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges covering ``[0, total)``: ``total // n`` each, the first ``total % n``
    one longer (TF's partition slicing, and ``np.array_split``'s sizes)."""
    base, extra = divmod(total, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out
