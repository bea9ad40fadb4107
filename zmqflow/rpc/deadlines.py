"""When each call in flight is due, so that a client arms one loop timer instead of one per call.

Sans-IO: the caller passes loop times and says which calls are still live. A call that ends is
not removed (that would cost a search); its entry is skipped when it reaches the top of the heap,
and the heap is rebuilt from the live calls once stale entries outnumber them, so memory stays
proportional to the calls in flight. Calls made with one timeout are due in the order they were
made, so a new call almost never moves the next wake-up and costs one heap push.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Container

__all__ = ["Deadlines"]

_SLACK = 256  # stale entries tolerated beyond twice the live calls before a rebuild


class Deadlines:
    """A heap of ``(due, call id)`` with lazy removal."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, due: float, rid: int, live: Collection[int]) -> None:
        """Note that call ``rid`` is due at ``due``; drop the stale entries once they outnumber the
        ``live`` ones (the calls still in flight)."""
        heap = self._heap
        heapq.heappush(heap, (due, rid))
        if len(heap) > 2 * len(live) + _SLACK:
            self._heap = [entry for entry in heap if entry[1] in live]
            heapq.heapify(self._heap)

    def pop_due(self, now: float, live: Container[int]) -> list[int]:
        """The live calls due at or before ``now``, earliest first; their entries leave the heap."""
        heap = self._heap
        due: list[int] = []
        while heap and heap[0][0] <= now:
            rid = heapq.heappop(heap)[1]
            if rid in live:
                due.append(rid)
        return due

    def next_due(self, live: Container[int]) -> float | None:
        """When the earliest live call is due (None: none is), dropping ended calls from the top."""
        heap = self._heap
        while heap and heap[0][1] not in live:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def clear(self) -> None:
        """Forget every entry (the client closed: no call is live)."""
        self._heap.clear()

