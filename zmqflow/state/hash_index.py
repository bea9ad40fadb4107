"""A vectorised open-addressing index from int64 ids to small non-negative handles, in numpy.

A Python dict of a few million ids costs about 100 bytes per id and a Python loop per lookup;
a dynamic table shard looks up thousands of ids per request. This index keeps one int32 (or
int64) per bucket and no copy of the ids: the caller keeps them, ``keys[handle]``, in an array it
already holds (a table's row ids), so the index costs 4 bytes per bucket, about 7 to 18 bytes per
id at its load factors. Every id is a valid key (0, negatives and the int64 extremes included):
emptiness lives in the handle, not in a reserved id.

Buckets are probed linearly, all ids of a batch in parallel: each round resolves the ids that
met their key or an empty bucket, and the others step to the next bucket. Deletion leaves a
tombstone, which becomes empty again when the bucket after it is empty; tombstones are dropped
when the index is rebuilt, as it is when it grows past its load factor.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HashIndex", "EMPTY", "TOMBSTONE"]

EMPTY = -1
TOMBSTONE = -2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIN_BUCKETS = 16


class HashIndex:
    """id -> handle (>= 0) for ids the caller holds as ``keys[handle]``.

    Every method that compares ids takes ``keys``, the caller's id array, as it is now (it may be
    a new array after the caller grew it); ``find`` answers -1 for absent ids. The caller inserts
    only ids that are absent and unique, and removes only handles that are present.
    """

    def __init__(self, handle_dtype: np.dtype | type = np.int32, max_load: float = 0.6, buckets: int = _MIN_BUCKETS):
        if not 0.0 < max_load < 1.0:
            raise ValueError(f"max_load must be in (0, 1), got {max_load}")
        self.dtype = np.dtype(handle_dtype)
        self.max_load = float(max_load)
        self._reset(_pow2(max(buckets, _MIN_BUCKETS)))

    def _reset(self, size: int) -> None:
        self.table = np.full(size, EMPTY, self.dtype)
        self.mask = size - 1
        self.shift = np.uint64(64 - (size.bit_length() - 1))
        self.live = 0  # buckets holding a handle
        self.used = 0  # buckets not empty: handles and tombstones

    # queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.live

    @property
    def buckets(self) -> int:
        return len(self.table)

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def values(self) -> np.ndarray:
        """Every live handle, ascending (int64)."""
        return np.sort(self.table[self.table >= 0]).astype(np.int64)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        """Fibonacci hashing: the top bits of id * 2**64/phi, which every bit of the id reaches
        (the low bits are left to ``hash_owner``, which spreads ids over parts by them)."""
        return ((ids.view(np.uint64) * _GOLDEN) >> self.shift).astype(np.intp)

    def find(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The handle of each id (int64), -1 where absent; ids may repeat."""
        return self._probe(ids, keys)[1]

    def _probe(self, ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bucket, handle) of each id, both -1 where absent."""
        n = len(ids)
        bucket = np.full(n, -1, np.intp)
        handle = np.full(n, -1, np.int64)
        if n == 0 or self.live == 0:
            return bucket, handle
        table, mask = self.table, self.mask
        todo = np.arange(n)
        want = ids
        pos = self._home(ids)
        while True:
            got = np.take(table, pos)
            hit = np.take(keys, got, mode="clip") == want
            hit &= got >= 0
            done = hit | (got == EMPTY)
            at = todo[hit]
            bucket[at] = pos[hit]
            handle[at] = got[hit]
            if done.all():
                return bucket, handle
            more = ~done
            todo, want = todo[more], want[more]
            pos = (pos[more] + 1) & mask

    # changes ------------------------------------------------------------------------------
    def insert(self, ids: np.ndarray, handles: np.ndarray, keys: np.ndarray) -> None:
        """Add absent, unique ``ids`` with their ``handles`` (``keys[handles] == ids`` already)."""
        if len(ids) == 0:
            return
        if self.used + len(ids) > self.max_load * len(self.table):
            self._rebuild(self.live + len(ids), keys)
        self._place(ids, np.asarray(handles).astype(self.dtype, copy=False))

    def _place(self, ids: np.ndarray, handles: np.ndarray) -> None:
        """Each id into the first free bucket of its probe sequence. Ids racing for one bucket all
        write it; the one whose handle reads back won, the others step on."""
        table, mask = self.table, self.mask
        pos = self._home(ids)
        self.live += len(ids)
        while len(pos):
            got = np.take(table, pos)
            free = np.flatnonzero(got < 0)
            fp, fh = pos[free], handles[free]
            table[fp] = fh
            won = np.take(table, fp) == fh
            self.used += int(np.count_nonzero(got[free[won]] == EMPTY))
            more = np.ones(len(pos), bool)
            more[free[won]] = False
            handles = handles[more]
            pos = (pos[more] + 1) & mask

    def remove(self, handles: np.ndarray, keys: np.ndarray) -> int:
        """Drop present handles (by their ids, ``keys[handles]``); returns how many were dropped."""
        if len(handles) == 0:
            return 0
        bucket, _ = self._probe(np.take(keys, np.asarray(handles, np.int64)), keys)
        bucket = np.unique(bucket[bucket >= 0])
        table, mask = self.table, self.mask
        table[bucket] = TOMBSTONE
        self.live -= len(bucket)
        # a tombstone before an empty bucket ends no probe sequence: empty it, and walk back
        at = bucket
        while len(at):
            at = at[(np.take(table, (at + 1) & mask) == EMPTY) & (np.take(table, at) == TOMBSTONE)]
            table[at] = EMPTY
            self.used -= len(at)
            at = (at - 1) & mask
        return len(bucket)

    def clear(self) -> None:
        self._reset(_MIN_BUCKETS)

    def rebuild(self, ids: np.ndarray, handles: np.ndarray) -> None:
        """Forget everything and index exactly these (unique) ids."""
        self._reset(_pow2(max(_MIN_BUCKETS, int(len(ids) / (self.max_load * 0.75)) + 1)))
        if len(ids):
            self._place(ids, np.asarray(handles).astype(self.dtype, copy=False))

    def _rebuild(self, need: int, keys: np.ndarray) -> None:
        """Re-place every live handle in a table sized for ``need`` ids at three quarters of the
        load factor (so a rebuild, which also drops tombstones, is followed by many inserts)."""
        live = self.table[self.table >= 0]
        self._reset(_pow2(max(_MIN_BUCKETS, int(need / (self.max_load * 0.75)) + 1)))
        if len(live):
            self._place(np.take(keys, live.astype(np.int64)), live)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
