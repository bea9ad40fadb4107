"""A vectorised open-addressing index from int64 ids to small non-negative handles, in numpy.

A Python dict of a few million ids costs about 100 bytes per id and a Python loop per lookup;
a dynamic table shard looks up thousands of ids per request. This index keeps no copy of the
ids: the caller keeps them, ``keys[handle]``, in an array it already holds (a table's row ids).
Per bucket it holds a handle (int32, or int64 for more than 2**31 of them) and one control byte:
5 bytes, about 7 to 8 bytes per id as it grows (any number of groups, sized to what it holds; a
power of two, at the wrong size, nearly doubles that). Every int64 is a valid id (0, negatives
and the extremes included): emptiness lives in the control byte, not in a reserved id.

The layout is a SwissTable's: buckets in groups of 8, whose 8 control bytes are one uint64.
A control byte is EMPTY (0x00), DELETED (0x01), or 0x80 | 7 bits of the id's hash. An id's hash
(id * 2**64/phi) picks its home group from its top 32 bits (scaled to the number of groups, as
Lemire's multiply-shift does: no power of two needed) and its 7-bit fingerprint from the 7 bits
below them; a lookup compares the fingerprint with all 8 bytes of a group at once (SWAR on
uint64s), checks the caller's id only where it matches (a false match is 1 in 128 per occupied
byte), and goes on only when the group is full, to the next group (wrapping at the end). With
8 buckets a group and the load at most 3/4, a group is seldom full, so the runs stay short;
linear steps visit every group whatever their number. All ids of a batch do this in parallel, a
few vectorised rounds per batch.

Deletion leaves DELETED where the group is full (a probe may have passed it) and EMPTY where it
is not. DELETED bytes are reused by inserts and dropped when the index is rebuilt, as it is when
its used buckets pass the load factor.

Where the C module ``hash_probe`` was built (``pip install`` compiles it when a C compiler is there;
it needs no numpy headers), ``find`` and ``insert`` walk each id's probe sequence in C over the
same arrays, prefetching ids ahead so their cache misses overlap: several times faster than the
numpy rounds, which remain the fallback and the reference. ``use_compiled(False)`` turns it off.
"""

from __future__ import annotations

import numpy as np

from . import pages

try:
    from . import hash_probe as _compiled  # type: ignore[attr-defined]
except ImportError:  # not built here: the numpy rounds do the same work
    _compiled = None

__all__ = ["HashIndex", "EMPTY", "DELETED", "compiled", "use_compiled"]

_use_compiled = _compiled is not None


def compiled() -> bool:
    """Whether the C probe runs (built, and not turned off)."""
    return _use_compiled


def use_compiled(on: bool) -> bool:
    """Turn the C probe on or off (on only where it was built); returns the previous setting."""
    global _use_compiled
    before, _use_compiled = _use_compiled, bool(on) and _compiled is not None
    return before

EMPTY = 0x00
DELETED = 0x01
GROUP = 8  # buckets per group: one uint64 of control bytes

_U64 = np.dtype("<u8")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LSB = np.uint64(0x0101010101010101)  # times a byte: that byte in every lane
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH = np.uint64(0x8080808080808080)
_BYTE_INDEX = np.uint64(0x0001020304050607)  # (1 << 8j) * this >> 56 == j
_U1, _U3, _U7, _U25, _U32, _U56 = (np.uint64(k) for k in (1, 3, 7, 25, 32, 56))
_SEVEN_BITS, _TOP = np.uint64(0x7F), np.uint64(0x80)
_MIN_GROUPS = 2
_MAX_GROUPS = 1 << 32  # the home group is (top 32 bits of the hash) * groups >> 32
_TRIM_AFTER = 1 << 20  # ids re-placed by a rebuild big enough to hand its temporaries back
_SPAN = 4  # groups the ids left after the first round probe at once
_SPAN_STEPS = np.arange(_SPAN, dtype=np.uint64)

# Group and bucket numbers stay uint64 (numpy indexes with them): mixing them with int64 would
# make numpy promote to float64.


def _zero_bytes(x: np.ndarray) -> np.ndarray:
    """0x80 in exactly the bytes of ``x`` that are zero (no false positives, unlike the borrow trick)."""
    t = x & _LOW7
    t += _LOW7
    t |= x
    t |= _LOW7
    return np.invert(t, out=t)


def _first_zero_byte(x: np.ndarray) -> np.ndarray:
    """0x80 in the lowest zero byte of ``x``, and maybe in bytes above it, none if no byte is
    zero: the classic borrow trick, whose false marks all sit above a true one."""
    t = x - _LSB
    np.invert(x, out=x)
    t &= x
    t &= _HIGH
    return t


def _lowest_byte(marks: np.ndarray) -> np.ndarray:
    """Index (0..7, uint64) of the lowest byte marked 0x80 in each non-zero ``marks``."""
    low = np.negative(marks)
    low &= marks
    low >>= _U7
    low *= _BYTE_INDEX
    low >>= _U56
    return low


class HashIndex:
    """id -> handle (>= 0) for ids the caller holds as ``keys[handle]``.

    Every method that compares ids takes ``keys``, the caller's id array as it is now (it may be
    a new array after the caller grew it); ``find`` answers -1 for absent ids. The caller inserts
    only ids that are absent and unique, and removes only handles that are present.
    """

    def __init__(self, handle_dtype: np.dtype | type = np.int32, max_load: float = 0.75):
        if not 0.0 < max_load <= 0.875:
            raise ValueError(f"max_load must be in (0, 0.875], got {max_load}")
        self.dtype = np.dtype(handle_dtype)
        self.max_load = float(max_load)
        self._reset(_MIN_GROUPS)

    def _reset(self, groups: int) -> None:
        self.ctrl = pages.zeros(groups, _U64)  # 8 control bytes per group
        self.bytes = self.ctrl.view(np.uint8)  # the same bytes, one per bucket
        self.handles = pages.zeros(groups * GROUP, self.dtype)
        self.groups = groups
        self._groups = np.uint64(groups)
        self.live = 0  # buckets holding a handle
        self.used = 0  # buckets not empty: handles and DELETED

    # queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.live

    @property
    def buckets(self) -> int:
        return len(self.handles)

    @property
    def nbytes(self) -> int:
        return int(self.ctrl.nbytes + self.handles.nbytes)

    def values(self) -> np.ndarray:
        """Every live handle, ascending (int64)."""
        return np.sort(self.handles[self.bytes >= 0x80]).astype(np.int64)

    def _hash(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(home group, fingerprint byte 0x80..0xFF in all 8 lanes) of each id: the top 32 bits
        of id * 2**64/phi (every bit of the id reaches them) times the groups, over 2**32; the
        fingerprint from the 7 bits below those."""
        h = ids.view(np.uint64) * _GOLDEN
        fp = h >> _U25
        fp &= _SEVEN_BITS
        fp |= _TOP
        fp *= _LSB
        h >>= _U32
        h *= self._groups
        h >>= _U32
        return h, fp

    def find(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The handle of each id (int64), -1 where absent; ids may repeat."""
        return self._probe(ids, keys)[1]

    def _probe(self, ids: np.ndarray, keys: np.ndarray, buckets: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
        """(bucket, handle) of each id, both -1 where absent; the buckets only when asked for.

        One round settles nearly every id: its home group's lowest fingerprint match is it, or
        there is no match and the group has an empty byte. The rest (another match to check,
        or a full group to go on from) continue in ``_probe_rest``."""
        n = len(ids)
        if n == 0 or self.live == 0:
            return (np.full(n, -1, np.intp) if buckets else None), np.full(n, -1, np.int64)
        if _use_compiled:
            handle, bucket = np.empty(n, np.int64), (np.empty(n, np.int64) if buckets else None)
            _compiled.find(self.ctrl, self.handles, _i64(keys), _i64(ids), handle, bucket, self.groups)
            return bucket, handle
        group, pattern = self._hash(ids)
        word = np.take(self.ctrl, group)
        marks = _first_zero_byte(word ^ pattern)
        slot = group << _U3
        slot |= _lowest_byte(marks)
        handle = np.take(self.handles, slot)
        hit = np.take(keys, handle, mode="clip") == ids
        hit &= marks != 0
        miss = np.flatnonzero(~hit)
        handle = handle.astype(np.int64)
        handle[miss] = -1
        bucket = None
        if buckets:
            bucket = slot.astype(np.intp)
            bucket[miss] = -1
        if len(miss):
            marks, word = marks[miss], word[miss]
            rest = ((marks & (marks - _U1)) != 0) | (_zero_bytes(word) == 0)
            if rest.any():
                at = miss[rest]
                self._probe_rest(ids[at], keys, at, group[at], pattern[at], bucket, handle)
        return bucket, handle

    def _probe_rest(self, ids: np.ndarray, keys: np.ndarray, todo: np.ndarray, home: np.ndarray,
                    pattern: np.ndarray, bucket: np.ndarray | None, handle: np.ndarray) -> None:
        """The few ids the first round left (another fingerprint match in the home group, or a
        full home group), ``_SPAN`` groups of their probe sequence at once: every fingerprint
        match in them is checked (a live bucket holding the id is its one entry, wherever it is),
        and an id not found is absent if one of those groups has an empty byte, else goes on."""
        ctrl, handles = self.ctrl, self.handles
        step = 0
        while len(todo):
            groups = (home[:, None] + (step + _SPAN_STEPS)) % self._groups
            words = np.take(ctrl, groups)
            marks = _zero_bytes(words ^ pattern[:, None]).view(np.uint8)
            row, byte = np.nonzero(marks)
            slot = (groups[row, byte // GROUP] << _U3) | (byte % GROUP).astype(np.uint64)
            got = np.take(handles, slot)
            hit = np.take(keys, got, mode="clip") == ids[row]
            row, slot, got = row[hit], slot[hit], got[hit]
            if bucket is not None:
                bucket[todo[row]] = slot
            handle[todo[row]] = got
            if len(row) == len(todo):
                return
            more = (_zero_bytes(words) == 0).all(axis=1)
            more[row] = False
            todo, ids, home, pattern = todo[more], ids[more], home[more], pattern[more]
            step += _SPAN

    # changes ------------------------------------------------------------------------------
    def insert(self, ids: np.ndarray, handles: np.ndarray, keys: np.ndarray) -> None:
        """Add absent, unique ``ids`` with their ``handles`` (``keys[handles] == ids`` already)."""
        if len(ids) == 0:
            return
        if self.used + len(ids) > self.max_load * len(self.handles):
            self._rebuild(self.live + len(ids), keys)
        self._place(ids, np.asarray(handles))

    def _place(self, ids: np.ndarray, handles: np.ndarray) -> None:
        """Each id into the lowest free (empty or deleted) byte of the first group of its probe
        sequence that has one. ``handles`` of any integer dtype: each path casts them once, to
        what it reads (int64 for the C probe, the index's dtype for the numpy rounds).
        Ids racing for one bucket all write its handle; the one that reads back won, the others
        look again (the group's control word now shows the bucket taken)."""
        if _use_compiled:
            self.used += _compiled.place(self.ctrl, self.handles, _i64(ids), _i64(handles), self.groups)
            self.live += len(ids)
            return
        handles = handles.astype(self.dtype, copy=False)
        ctrl, table = self.ctrl, self.handles
        group, fp = self._hash(ids)
        fp = (fp & np.uint64(0xFF)).astype(np.uint8)
        self.live += len(ids)
        while len(group):
            word = np.take(ctrl, group)
            free = _zero_bytes(word) | _zero_bytes(word ^ _LSB)  # empty or deleted
            room = free != 0
            at = np.flatnonzero(room)
            slot = (group[at] << _U3) | _lowest_byte(free[at])
            h = handles[at]
            table[slot] = h
            won = np.take(table, slot) == h
            slot = slot[won]
            self.used += int(np.count_nonzero(self.bytes[slot] == EMPTY))
            self.bytes[slot] = fp[at[won]]
            more = np.ones(len(group), bool)
            more[at[won]] = False
            full = ~room
            group[full] += _U1  # the next group, wrapping at the end
            group[full & (group == self._groups)] = 0
            group, fp, handles = group[more], fp[more], handles[more]

    def remove(self, handles: np.ndarray, keys: np.ndarray) -> int:
        """Drop present handles (by their ids, ``keys[handles]``); returns how many were dropped."""
        if len(handles) == 0:
            return 0
        bucket, _ = self._probe(np.take(keys, np.asarray(handles, np.int64)), keys, buckets=True)
        bucket = np.unique(bucket[bucket >= 0])
        # a group with an empty byte never made a probe go on past it: its bucket can be empty
        # again; in a full group it stays DELETED, or a probe that passed it would stop early
        open_group = _zero_bytes(np.take(self.ctrl, bucket >> 3)) != 0
        self.bytes[bucket] = np.where(open_group, EMPTY, DELETED).astype(np.uint8)
        self.live -= len(bucket)
        self.used -= int(np.count_nonzero(open_group))
        return len(bucket)

    def clear(self) -> None:
        self._reset(_MIN_GROUPS)

    def rebuild(self, ids: np.ndarray, handles: np.ndarray) -> None:
        """Forget everything and index exactly these (unique) ids."""
        self._reset(self._groups_for(len(ids)))
        self._fill(ids, np.asarray(handles).astype(self.dtype, copy=False))

    def _groups_for(self, count: int) -> int:
        """Groups to hold ``count`` ids within 85% of the load factor, so that a rebuild (which
        also drops DELETED bytes) is followed by many inserts before the next."""
        groups = max(_MIN_GROUPS, int(count / (self.max_load * 0.85 * GROUP)) + 1)
        if groups > _MAX_GROUPS:
            raise ValueError(f"{count} ids need more than {_MAX_GROUPS} groups of {GROUP}")
        return groups

    def _rebuild(self, need: int, keys: np.ndarray) -> None:
        live = self.handles[self.bytes >= 0x80]
        self._reset(self._groups_for(need))
        self._fill(np.take(keys, live.astype(np.int64)), live)
        if len(live) >= _TRIM_AFTER:
            del live
            pages.trim()  # the rebuild's temporaries came from the heap: give their pages back

    def _fill(self, ids: np.ndarray, handles: np.ndarray) -> None:
        """Place ids in an empty index at once. The C probe places them one by one (5x faster
        than sorting them, which is what lets the index grow by small steps); the numpy rounds
        sort them by home group, the k-th id of a group taking its byte k, and only the ids past
        a group's 8 race for buckets further on (``_place``)."""
        if len(ids) == 0:
            return
        if _use_compiled:
            self._place(ids, handles)
            return
        group, fp = self._hash(ids)
        if len(self.ctrl) <= 1 << 32:
            group = group.astype(np.uint32)  # sorts faster, and half the temporaries
        order = np.argsort(group)
        home = group[order]
        first = np.ones(len(ids), bool)
        np.not_equal(home[1:], home[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        rank = np.arange(len(ids)) - starts[np.cumsum(first) - 1]
        fits = rank < GROUP
        at = order[fits]
        slot = (home[fits].astype(np.uint64) << _U3) | rank[fits].astype(np.uint64)
        self.handles[slot] = handles[at]
        self.bytes[slot] = (fp[at] & np.uint64(0xFF)).astype(np.uint8)
        self.live += len(at)
        self.used += len(at)
        over = order[~fits]
        if len(over):
            self._place(ids[over], handles[over])


def _i64(a: np.ndarray) -> np.ndarray:
    """``a`` as C-contiguous int64, the layout the C probe reads (no copy when it already is)."""
    return np.ascontiguousarray(a, dtype=np.int64)
