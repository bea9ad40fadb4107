"""Which ids a dynamic table part dropped, and at which step: what an embedding delta tells a
server to forget.

Bounded: at most ``cap`` entries (16 bytes each). When full, the oldest half goes, and the log
then answers only for steps after the newest entry it forgot (``since``): a delta asked for from
an earlier step cannot be complete, and the caller is told to take a full export instead.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

__all__ = ["DropLog", "DEFAULT_DROP_LOG"]

DEFAULT_DROP_LOG = 1 << 20  # entries per table part: 16 MiB at most


class DropLog:
    def __init__(self, cap: int = DEFAULT_DROP_LOG, since: int = 0):
        if cap < 2:
            raise InvalidArgument(f"the drop log holds at least 2 entries, got {cap}")
        self.cap = int(cap)
        self.since = int(since)  # deletions at steps >= since are all here
        self.ids = np.zeros(0, np.int64)
        self.steps = np.zeros(0, np.int64)
        self.end = 0

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.steps.nbytes)

    def __len__(self) -> int:
        return self.end

    def record(self, ids: np.ndarray, step: int) -> None:
        """``ids`` were dropped at ``step`` (steps recorded never go down)."""
        n = len(ids)
        if n == 0:
            return
        if n > self.cap:  # more than the log holds at once: keep the newest, forget the rest
            self.since = step + 1
            self.ids, self.steps, self.end = np.zeros(0, np.int64), np.zeros(0, np.int64), 0
            return
        if self.end + n > self.cap:
            keep = max(0, min(self.end, self.cap // 2, self.cap - n))
            self.since = max(self.since, int(self.steps[self.end - keep - 1]) + 1)
            self.ids[:keep] = self.ids[self.end - keep: self.end]
            self.steps[:keep] = self.steps[self.end - keep: self.end]
            self.end = keep
        if self.end + n > len(self.ids):
            size = min(self.cap, max(2 * len(self.ids), self.end + n, 64))
            for name in ("ids", "steps"):
                grown = np.zeros(size, np.int64)
                grown[: self.end] = getattr(self, name)[: self.end]
                setattr(self, name, grown)
        self.ids[self.end: self.end + n] = ids
        self.steps[self.end: self.end + n] = step
        self.end += n

    def since_step(self, step: int, what: str) -> np.ndarray:
        """Ids dropped at steps >= ``step`` (unique, ascending); ``InvalidArgument`` when the log
        no longer reaches back that far."""
        if step < self.since:
            raise InvalidArgument(f"{what}: deletions are known from step {self.since} on, not from step {step} "
                                  f"(the drop log was trimmed or the table restored): take a full export instead",
                                  since=self.since)
        at = np.searchsorted(self.steps[: self.end], step, side="left")
        return np.unique(self.ids[at: self.end])

    def reset(self, since: int) -> None:
        self.since = int(since)
        self.end = 0
