"""The ring allreduce schedule: which segment each rank sends and receives at each step.

A fused buffer of N elements is cut into ``n`` segments (``np.array_split`` sizes). Scatter-reduce
runs ``n - 1`` steps: at step ``s`` rank ``r`` sends segment ``(r - s) % n`` to its right and
reduces segment ``(r - s - 1) % n`` from its left; rank ``r`` then holds the full reduction of
segment ``(r + 1) % n``. Allgather runs ``n - 1`` more steps: at step ``s`` rank ``r`` sends
segment ``(r + 1 - s) % n`` and receives segment ``(r - s) % n``. Every segment is cut into
chunks of at most ``chunk`` elements, and chunk ``k`` moves through all steps independently of
chunk ``k + 1``: reducing one chunk overlaps sending the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from .splits import even_splits

__all__ = ["Step", "segments", "chunks", "scatter_reduce", "allgather", "RS", "AG"]

RS, AG = "rs", "ag"


@dataclass(frozen=True, slots=True)
class Step:
    phase: str
    index: int
    send: int  # segment index sent to the right
    recv: int  # segment index received from the left


def segments(total: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges covering ``[0, total)``, sizes as ``np.array_split``."""
    return even_splits(total, n)


def chunks(total: int, n: int, chunk: int) -> int:
    """How many chunks every segment is cut into (the largest segment decides; some may be empty)."""
    largest = -(-total // n) if n else 0
    return max(1, -(-largest // max(1, chunk)))


def chunk_range(segment: tuple[int, int], k: int, chunk: int) -> tuple[int, int]:
    a = min(segment[0] + k * chunk, segment[1])
    return a, min(a + chunk, segment[1])


def scatter_reduce(rank: int, n: int) -> list[Step]:
    return [Step(RS, s, (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]


def allgather(rank: int, n: int) -> list[Step]:
    return [Step(AG, s, (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)]
