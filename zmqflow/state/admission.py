"""Ids counting towards a dynamic table's admission: how often each was sighted, oldest first.

A table admits an id on its ``min_frequency``-th sighting; until then the id is pending. Pending
ids are bounded: past the cap, those first sighted longest ago are forgotten. They are kept in
a log in order of first sighting (id and count, 12 bytes each), indexed by a
:class:`~zmqflow.state.hash_index.HashIndex` over log positions: an admitted id leaves a hole
(count 0), and the log is compacted, oldest entries first out, when it fills or is pruned.
"""

from __future__ import annotations

import numpy as np

from . import pages
from .hash_index import HashIndex

__all__ = ["Sightings"]

_MAX_COUNT = np.iinfo(np.int32).max


class Sightings:
    """id -> sightings so far (>= 1) for pending ids, in order of first sighting."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int32)  # 0: a hole left by an admitted id
        self.end = 0  # log entries in use, holes included
        self.live = 0
        self.index = HashIndex(np.int32)

    def __len__(self) -> int:
        return self.live

    def __contains__(self, i: object) -> bool:
        try:
            key = np.array([i], dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return False
        return bool(self.index.find(key, self.ids)[0] >= 0)

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.counts.nbytes + self.index.nbytes)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, sightings) of every pending id, first sighted first."""
        alive = np.flatnonzero(self.counts[: self.end] > 0)
        return self.ids[alive], self.counts[alive].astype(np.int64)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Sightings of each id so far (0 for ids not pending)."""
        pos = self.index.find(ids, self.ids)
        out = np.zeros(len(ids), np.int64)
        out[pos >= 0] = self.counts[pos[pos >= 0]]
        return out

    def sight(self, ids: np.ndarray, min_frequency: int) -> np.ndarray:
        """Count one more sighting of each of ``ids`` (unique, in order of appearance) and return
        which reached ``min_frequency``: those are for the caller to admit (and then
        ``discard``); the rest are counted, new ones after every id already pending."""
        pos = self.index.find(ids, self.ids)
        have = pos >= 0
        seen = np.ones(len(ids), np.int64)
        seen[have] += self.counts[pos[have]]
        admit = seen >= min_frequency
        bump = have & ~admit
        self.counts[pos[bump]] = np.minimum(seen[bump], _MAX_COUNT)
        self._append(ids[~have & ~admit])
        return admit

    def add(self, ids: np.ndarray, counts: np.ndarray, cap: int) -> None:
        """Add saved sightings (a restore): each of ``ids`` (unique, none admitted) gains its
        count in ``counts`` (> 0), at most ``cap`` in all; ids new here join after every id
        pending, in the order given."""
        before = self.get(ids)
        self._append(ids[before == 0])
        self.counts[self.index.find(ids, self.ids)] = np.minimum(before + counts, min(cap, _MAX_COUNT))

    def bound(self, max_pending: int) -> int:
        """Past ``max_pending`` ids, forget those first sighted longest ago down to three quarters
        of it (so pruning is amortized over many sightings); returns how many."""
        return self.prune(max_pending * 3 // 4) if self.live > max_pending else 0

    def _append(self, new: np.ndarray) -> None:
        if len(new) == 0:
            return
        if self.end + len(new) > len(self.ids):
            self._compact(np.flatnonzero(self.counts[: self.end] > 0), room=len(new))
        at = np.arange(self.end, self.end + len(new))
        self.ids[at] = new
        self.counts[at] = 1
        self.end += len(new)
        self.live += len(new)
        self.index.insert(new, at, self.ids)

    def discard(self, ids: np.ndarray) -> None:
        """Forget ``ids`` (unique); ids not pending are ignored."""
        if self.live == 0 or len(ids) == 0:
            return
        pos = self.index.find(ids, self.ids)
        pos = pos[pos >= 0]
        self.index.remove(pos, self.ids)
        self.counts[pos] = 0
        self.live -= len(pos)

    def prune(self, keep: int) -> int:
        """Forget the ids first sighted longest ago, down to ``keep``; returns how many."""
        drop = self.live - keep
        if drop <= 0:
            return 0
        self._compact(np.flatnonzero(self.counts[: self.end] > 0)[drop:], room=0)
        return drop

    def _compact(self, keep: np.ndarray, room: int) -> None:
        """Keep the entries at log positions ``keep`` (ascending), moved to the front, with room
        for ``room`` more (and half as many again, so compaction is amortized O(1) per entry)."""
        ids, counts = self.ids[keep], self.counts[keep]
        need = len(keep) + room
        size = need + need // 2 + 16
        if size > len(self.ids) or len(self.ids) > 2 * size:
            self.ids = pages.zeros(size, np.int64)
            self.counts = pages.zeros(size, np.int32)
        else:
            self.counts[: self.end] = 0
        self.ids[: len(keep)] = ids
        self.counts[: len(keep)] = counts
        self.end = self.live = len(keep)
        self.index.rebuild(ids, np.arange(len(keep)))
