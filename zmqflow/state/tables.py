"""Embedding tables on a shard, sans-IO: the dynamic hash table.

Each static part is an ordinary store part (rows x dim) with its optimizer slots; which part owns
an id is :mod:`zmqflow.state.owners`' to say. Dynamic tables take any int64 id, spread over parts by a
hash of the id, and create rows on demand, after ``min_frequency`` sightings, up to ``capacity``
rows per part (``DEFAULT_CAPACITY`` when none is named: never unbounded) with least-recently-used
eviction. Ids still counting towards admission are bounded too (``max_pending``): past it, the
ids first sighted longest ago are forgotten, so a stream of ids seen once cannot grow the shard's
memory.
Both the rows and the pending ids are found through numpy open-addressing indexes
(:mod:`zmqflow.state.hash_index`): a batch of ids is resolved in a few vectorised probing rounds,
at a few bytes per id, where a dict would take a Python loop and about 100 bytes per id.

A dynamic part keeps a clock (``HashTable.step``): a push that carries the pusher's step moves
it to that step (never back), a push without one advances it by one. Each row remembers the
clock when it last changed (created, pushed, restored: ``updated_step``, the int64 every row
already had for eviction by age, so change tracking costs no byte more per row), and dropped ids
go to a bounded log (:mod:`zmqflow.state.droplog`): :meth:`HashTable.delta` answers "which rows
changed, and which went, at steps >= N" for online serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import init as _init
from . import optim as _optim
from . import pages
from .admission import Sightings
from .droplog import DEFAULT_DROP_LOG, DropLog
from .hash_index import HashIndex
from .sparse import has_repeats, unique_sum
from ..errors import InvalidArgument
from .limits import DEFAULT_STATE_LIMITS

__all__ = ["HashTable", "DEFAULT_CAPACITY", "DEFAULT_MAX_PENDING", "MAX_CLOCK"]

DEFAULT_CAPACITY = DEFAULT_STATE_LIMITS.table_capacity  # rows per part: 16M (4 GiB of float32 rows of 64)
DEFAULT_MAX_PENDING = DEFAULT_STATE_LIMITS.max_pending_admission  # ids counting towards admission, per part


# The most a table's clock counts: past any training's steps, with int64 room to spare for the
# one-per-push increments (a step past it is refused; the clock stops there rather than overflow).
MAX_CLOCK = 2**62
_FREE = np.iinfo(np.int64).max  # ``last_used`` of a slot that holds no row: never the least recently used


def _first_seen(ids: np.ndarray) -> np.ndarray:
    """``ids`` without repeats, in order of first appearance (the order a loop over them sees);
    ``ids`` itself when it has none (clients send unique ids: one sort tells)."""
    if len(ids) < 2:
        return ids
    ordered = np.sort(ids)
    if not (ordered[1:] == ordered[:-1]).any():
        return ids
    first = np.unique(ids, return_index=True)[1]
    return ids[np.sort(first)]


class HashTable:
    """One part of a dynamic table: id -> row, created on demand, with admission and eviction.

    Rows live in slots of the row arrays; ``index`` maps an id to its slot (the slot's id is
    ``ids[slot]``, which the index compares against, so it holds no copy of the ids). A slot that
    holds no row has ``last_used == _FREE``; slots at or past ``fresh`` never held one. Freed
    slots are reused before fresh ones. Ids may repeat within a batch: a repeat is one sighting.
    """

    def __init__(self, dim: int, dtype: np.dtype, *, initializer: Any = None, optimizer: Any = None,
                 min_frequency: int = 1, capacity: int | None = None, seed_salt: int = 0,
                 max_pending: int = DEFAULT_MAX_PENDING, drop_log: int | None = None,
                 room: Callable[[], int] | None = None):
        """``room``: the bytes the shard's budget has left for more rows, asked each time rows are
        made: where it runs out before ``capacity``, least recently used rows make way as they do
        at the capacity (None: the capacity alone bounds the part)."""
        if dim < 1:
            raise InvalidArgument(f"embedding dim must be >= 1, got {dim}")
        if min_frequency < 1:
            raise InvalidArgument(f"min_frequency must be >= 1, got {min_frequency}")
        if capacity is not None and capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1 or None, got {capacity}")
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be >= 1, got {max_pending}")
        self.dim = int(dim)
        self.dtype = np.dtype(dtype)
        self.init = _init.from_spec(initializer) if initializer is not None else _init.zeros()
        opt = _optim.from_spec(optimizer)
        if isinstance(opt, _optim.SyncReplicas):
            raise InvalidArgument("dynamic embedding tables take asynchronous updates only")
        self.optimizer: _optim.Optimizer | None = opt
        self.min_frequency = int(min_frequency)
        self.capacity = DEFAULT_CAPACITY if capacity is None else int(capacity)
        self._room = room
        self.max_pending = int(max_pending)
        self.pending_pruned = 0
        self._rng = np.random.default_rng([self.init.seed, 0x5EED, seed_salt])
        self.index = HashIndex(np.int32 if self.capacity <= 1 << 31 else np.int64)
        self.sightings = Sightings()
        n = min(1024, self.capacity)
        self.ids = np.zeros(n, np.int64)
        self.values = np.zeros((n, self.dim), self.dtype)
        wide = _optim.slot_dtype(self.dtype)  # float32 for a half-precision table
        self.slots = {k: np.zeros((n, self.dim), wide) for k in (opt.slot_names if opt else ())}
        # per-row update counts only for an optimizer that reads them (Adam's t): 8 B a row otherwise idle
        self.steps: np.ndarray | None = np.zeros(n, np.int64) if opt is not None and opt.uses_step else None
        self.last_used = np.zeros(n, np.int64)  # lookup/push tick, for LRU
        self.updated_step = np.zeros(n, np.int64)
        self.updated_time = np.zeros(n, np.float64)
        self.fresh = 0  # slots below it have held a row
        self._freed = np.zeros(0, np.int64)  # a stack of slots given back, the top at _nfreed - 1
        self._nfreed = 0
        self.tick = 0
        self.step = 0  # the clock: the latest step pushes carried, or one more per push without one
        # a quarter of the capacity (at most 4 bytes per row the part may hold), within 64..1M entries
        self.drops = DropLog(max(64, min(DEFAULT_DROP_LOG, self.capacity // 4)) if drop_log is None else drop_log)
        self.dropped_pushes = 0
        self.evicted = 0
        self._layout = 0  # counts changes of which slots hold rows: a kept export order is stale after one
        self._order: tuple[int, np.ndarray, np.ndarray] | None = None  # (layout, live slots by ascending id, ids)

    # bookkeeping ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.index)

    ROW_OVERHEAD = 8 * 4  # id, last use, last update step and time
    STEP_BYTES = 8  # a row's update count, kept for an optimizer that reads it (``uses_step``)

    @classmethod
    def row_size(cls, dim: int, dtype: np.dtype, optimizer: Any = None) -> int:
        """Bytes of one row with its optimizer slots and bookkeeping (known before any table is made)."""
        opt = _optim.from_spec(optimizer)
        if isinstance(opt, _optim.SyncReplicas):
            opt = opt.optimizer
        steps = cls.STEP_BYTES if opt is not None and opt.uses_step else 0
        return int(dim) * _optim.held_itemsize(opt, dtype) + cls.ROW_OVERHEAD + steps

    @property
    def row_bytes(self) -> int:
        return self.row_size(self.dim, self.dtype, self.optimizer)

    @property
    def nbytes(self) -> int:
        return len(self.index) * self.row_bytes

    @property
    def index_bytes(self) -> int:
        """Bytes of the id index, the pending-admission counts and the free-slot stack."""
        return self.index.nbytes + self.sightings.nbytes + int(self._freed.nbytes) + self.drops.nbytes

    def live_slots(self) -> np.ndarray:
        """The slots holding rows, ascending."""
        return np.flatnonzero(self.last_used[: self.fresh] != _FREE)

    def _grow(self) -> None:
        """Double the row arrays, never past the capacity (which bounds them). The new arrays
        are mappings of their own: the old ones go back to the OS, and rows not yet used are
        not resident (:mod:`zmqflow.state.pages`)."""
        old = len(self.ids)
        new = min(old * 2, self.capacity)
        for name in ("ids", "steps", "last_used", "updated_step", "updated_time"):
            arr = getattr(self, name)
            if arr is None:
                continue
            grown = pages.zeros(new, arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        grown_v = pages.zeros((new, self.dim), self.dtype)
        grown_v[:old] = self.values
        self.values = grown_v
        for k, s in self.slots.items():
            g = pages.zeros((new, self.dim), s.dtype)
            g[:old] = s
            self.slots[k] = g
        if new >= 1 << 20:
            pages.trim()  # what the requests that filled the table left free in the heap

    def _take_slots(self, count: int) -> np.ndarray:
        """``count`` free slots: the last given back first, then fresh ones (growing the arrays)."""
        reuse = min(count, self._nfreed)
        taken = self._freed[self._nfreed - reuse: self._nfreed][::-1]
        self._nfreed -= reuse
        fresh = count - reuse
        while self.fresh + fresh > len(self.ids):
            self._grow()
        out = np.concatenate([taken, np.arange(self.fresh, self.fresh + fresh, dtype=np.int64)])
        self.fresh += fresh
        return out

    def _create(self, new_ids: np.ndarray) -> np.ndarray:
        """Rows for ``new_ids`` (unique, absent), evicting the least recently used past the
        capacity; returns their slots (fewer when there are more new ids than the capacity)."""
        cap = self._capacity_now()
        excess = len(self.index) + len(new_ids) - cap
        if excess > 0:
            self._evict_lru(excess)
        new_ids = new_ids[:cap]
        self._layout += 1
        reused = min(len(new_ids), self._nfreed)
        slots = self._take_slots(len(new_ids))
        self.ids[slots] = new_ids
        self.index.insert(new_ids, slots, self.ids)
        if len(self.sightings):
            self.sightings.discard(new_ids)
        if reused == 0 and len(slots):  # fresh slots only: one run of rows, initialized where they are
            self._initial(len(slots), self.values[slots[0]: slots[0] + len(slots)])
        else:
            self.values[slots] = self._initial(len(slots))
        opt = self.optimizer
        for k, s in self.slots.items():
            s[slots] = opt.slot_init(k) if opt else 0.0
        if self.steps is not None:
            self.steps[slots] = 0
        self.last_used[slots] = self.tick
        self.updated_step[slots] = self.step
        self.updated_time[slots] = time.time()
        if len(new_ids) * self.dim * self.dtype.itemsize >= pages.SCRATCH_MIN_BYTES:
            pages.trim()  # the initializer's temporaries of a big batch: not kept resident in the heap
        return slots

    def _initial(self, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Initial values of ``n`` new rows, written into ``out`` (rows of ``values``) when given:
        a batch of new rows then needs no temporary of its size, which the heap would keep."""
        if self.init.kind == "constant":  # no draw: the table's seed sequence is for random initializers
            return _init.build(self.init, (n, self.dim), (0, n), self.dtype, out=out)
        seed = int(self._rng.integers(0, 2**62))
        return _init.build(_init.Initializer(**{**self.init.spec(), "seed": seed}), (n, self.dim), (0, n), self.dtype,
                           out=out)

    def _admit(self, unseen: np.ndarray) -> np.ndarray:
        """One more sighting of each of ``unseen`` (unique, absent); create those that reach
        ``min_frequency``. Returns the slot of each (-1 where none was created)."""
        slots = np.full(len(unseen), -1, np.int64)
        admit = np.flatnonzero(self.sightings.sight(unseen, self.min_frequency)) if self.min_frequency > 1 \
            else np.arange(len(unseen))
        if len(admit):
            made = self._create(unseen[admit])
            slots[admit[: len(made)]] = made
        return slots

    def _release(self, slots: np.ndarray) -> None:
        self._layout += 1
        self.drops.record(self.ids[slots], self.step)
        self.index.remove(slots, self.ids)
        self.last_used[slots] = _FREE
        end = self._nfreed + len(slots)
        if end > len(self._freed):
            grown = pages.zeros(max(end, 2 * len(self._freed), 64), np.int64)
            grown[: self._nfreed] = self._freed[: self._nfreed]
            self._freed = grown
        self._freed[self._nfreed: end] = slots
        self._nfreed = end
        self.evicted += len(slots)

    def _capacity_now(self) -> int:
        """The rows this part may hold now: its capacity, or fewer where the shard's budget ends first."""
        if self._room is None:
            return self.capacity
        return max(0, min(self.capacity, len(self.index) + self._room() // self.row_bytes))

    def _evict_lru(self, count: int) -> None:
        """Drop the ``count`` least recently used rows; of rows used at the same tick, the lowest
        slots (the older rows, unless slots were reused) go first."""
        if count >= len(self.index):
            self._release(self.live_slots())
            return
        used = self.last_used[: self.fresh]
        kth = np.partition(used, count - 1)[count - 1]
        below = np.flatnonzero(used < kth)
        ties = np.flatnonzero(used == kth)[: count - len(below)]
        self._release(np.concatenate([below, ties]))

    # operations -------------------------------------------------------------------------
    def lookup(self, ids: np.ndarray, create: bool = True) -> np.ndarray:
        """Rows for ``ids``; unknown ids get the default (zero) row, and are created (or counted
        towards admission, once per call however often they repeat in it) when ``create``."""
        self.tick += 1
        ids = np.asarray(ids, dtype=np.int64)
        slots = self.index.find(ids, self.ids)
        if create:
            miss = np.flatnonzero(slots < 0)
            if len(miss):
                self.last_used[slots[slots >= 0]] = self.tick  # this batch's rows are the last to make room
                evicted = self.evicted
                unseen = _first_seen(ids[miss])
                made = self._admit(unseen)
                if self.evicted != evicted:  # rows of this very batch may have made room
                    slots = self.index.find(ids, self.ids)
                elif len(unseen) == len(miss):  # no repeats: the new slots line up with the misses
                    slots[miss] = made
                else:
                    slots[miss] = self.index.find(ids[miss], self.ids)
            self.pending_pruned += self.sightings.bound(self.max_pending)
        hit = slots >= 0
        if hit.all():
            # mode="clip": with out=, the default mode fills a heap copy first (slots are all valid here)
            out = np.take(self.values, slots, axis=0, out=pages.scratch((len(ids), self.dim), self.dtype), mode="clip")
        else:
            out = pages.scratch((len(ids), self.dim), self.dtype)
            out[~hit] = 0
            slots = slots[hit]
            out[hit] = np.take(self.values, slots, axis=0)
        self.last_used[slots] = self.tick
        return out

    def check_push(self, ids: np.ndarray, grads: Any, step: int | None = None) -> None:
        """InvalidArgument unless :meth:`push` would take these (it checks them itself too)."""
        if not isinstance(grads, np.ndarray) or grads.dtype != self.dtype or grads.shape != (len(ids), self.dim):
            got = f"{grads.dtype} {list(grads.shape)}" if isinstance(grads, np.ndarray) else type(grads).__name__
            raise InvalidArgument(f"gradients must be {self.dtype} {[len(ids), self.dim]}, got {got}")
        if step is not None:
            _check_clock(int(step), "step")

    def push(self, ids: np.ndarray, grads: np.ndarray, step: int | None = None) -> int:
        """Apply the optimizer to the rows of ``ids`` that exist; the rest are dropped and
        counted. Returns how many rows were applied. A repeated id's gradients are summed first
        (a client sends unique ids; a peer that does not must not lose all but one of them to the
        fancy-indexed update). ``grads`` is checked here, the one place that knows the table's
        dtype and width. ``step``, the pusher's step, moves the clock to it (never back); without
        one the clock advances by one."""
        self.check_push(ids, grads, step)
        ids = np.asarray(ids, dtype=np.int64)
        if has_repeats(ids):
            ids, grads = unique_sum(ids, grads)
        self.tick += 1
        self.step = min(self.step + 1, MAX_CLOCK) if step is None else max(self.step, int(step))
        slots = self.index.find(ids, self.ids)
        hit = slots >= 0
        found = int(np.count_nonzero(hit))
        self.dropped_pushes += len(ids) - found
        if not found:
            return 0
        g = grads
        if found < len(ids):
            slots, g = slots[hit], grads[hit]
        if self.optimizer is None:
            self.values[slots] += g
        else:
            param = np.take(self.values, slots, axis=0)  # new arrays, as indexing makes, in half its time
            slot_rows = {k: np.take(s, slots, axis=0) for k, s in self.slots.items()} if self.slots else {}
            t = None
            if self.steps is not None:
                self.steps[slots] += 1
                t = self.steps[slots]
            self.values[slots] = self.optimizer.apply(param, g, slot_rows, t)
            for k, rows in slot_rows.items():
                self.slots[k][slots] = rows
        self.last_used[slots] = self.tick
        self.updated_step[slots] = self.step
        self.updated_time[slots] = time.time()
        return found

    def evict(self, older_than_step: int | None = None, older_than_seconds: float | None = None, now: float | None = None) -> int:
        """Drop rows not updated in the last ``older_than_step`` pushes or ``older_than_seconds``."""
        live = self.live_slots()
        old = np.zeros(len(live), bool)
        if older_than_step is not None:
            old |= self.updated_step[live] < self.step - int(older_than_step)
        if older_than_seconds is not None:
            old |= self.updated_time[live] < (time.time() if now is None else now) - float(older_than_seconds)
        victims = live[old]
        self._release(victims)
        return len(victims)

    def load(self, ids: np.ndarray, values: np.ndarray, slots: dict[str, np.ndarray], steps: np.ndarray | None,
             changed: np.ndarray | None = None, clock: int | None = None) -> int:
        """Put rows back (from a checkpoint): ids with their values, slots, step counts and the
        step each last changed (the clock now, when not given). ``clock``, the saved clock, moves
        this one forward; deletions before it are unknown, so the drop log starts there. Slot rows
        are in the slots' dtype, or in the table's own (half-precision slots of older checkpoints:
        widened to float32 here, exactly)."""
        ids = np.asarray(ids, dtype=np.int64)
        if values.shape != (len(ids), self.dim) or values.dtype != self.dtype:
            raise InvalidArgument(f"rows must be {self.dtype} {[len(ids), self.dim]}, got {values.dtype} {list(values.shape)}")
        unknown = set(slots) - set(self.slots)
        if unknown:
            raise InvalidArgument(f"the table has no optimizer slots {sorted(unknown)}")
        for k, v in slots.items():  # all checked before anything changes
            ok = isinstance(v, np.ndarray) and v.shape == values.shape and _optim.restorable_slot(self.dtype, v.dtype)
            if not ok:
                got = f"{v.dtype} {list(v.shape)}" if isinstance(v, np.ndarray) else type(v).__name__
                raise InvalidArgument(f"slot {k!r} rows must be {self.slots[k].dtype} {list(values.shape)}, got {got}")
        for what, a in (("step counts", steps), ("change steps", changed)):
            if a is not None and (not isinstance(a, np.ndarray) or a.shape != ids.shape or a.dtype.kind not in "iu"):
                got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                raise InvalidArgument(f"{what} must be integers of shape {list(ids.shape)}, got {got}")
        if clock is not None:
            self.step = max(self.step, _check_clock(int(clock), "clock"))
        self.drops.reset(self.step)
        at = self.index.find(ids, self.ids)
        if (at < 0).any():
            self._create(_first_seen(ids[at < 0]))
            at = self.index.find(ids, self.ids)
        keep = at >= 0
        at = at[keep]
        self.values[at] = values[keep]
        for k, v in slots.items():
            self.slots[k][at] = v[keep]
        if steps is not None and self.steps is not None:  # saved counts an optimizer without them does not read
            self.steps[at] = np.asarray(steps)[keep]
        self.updated_step[at] = self.step if changed is None else np.asarray(changed, np.int64)[keep]
        return int(keep.sum())

    def delta(self, since: int) -> dict[str, Any]:
        """Rows that changed at steps >= ``since`` (ids ascending, their current values) and the
        ids dropped since then that are not back: what a serving copy needs to catch up.
        ``InvalidArgument`` when the drop log does not reach back to ``since``."""
        dropped = self.drops.since_step(int(since), "embedding delta")
        live = self.live_slots()
        live = live[self.updated_step[live] >= since]
        live = live[np.argsort(self.ids[live], kind="stable")]
        if len(dropped):
            dropped = dropped[self.index.find(dropped, self.ids) < 0]
        return {"ids": self.ids[live].copy(), "values": self.values[live].copy(), "dropped": dropped,
                "since": int(since), "step": self.step}

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, row), ids ascending."""
        ids, rows, _ = self.export_page(0, len(self.index))
        return ids, rows

    def export_page(self, start: int, limit: int, after: int | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
        """Up to ``limit`` (id, row) pairs in ascending id order from position ``start``, or with
        ``after``, of the lowest ids above it (a cursor that rows made or dropped between pages do
        not shift); and whether more follow. The order is sorted once and kept while no row is
        made or dropped, so paging through the table costs one sort, not one (and a copy of every
        row) a page."""
        if self._order is None or self._order[0] != self._layout:
            live = self.live_slots()
            live = live[np.argsort(self.ids[live], kind="stable")]
            self._order = (self._layout, live, self.ids[live])
        _, order, ids = self._order
        if after is not None:
            start = int(np.searchsorted(ids, after, side="right"))
        page = order[start: start + limit]
        more = start + limit < len(order)
        if not more:
            self._order = None  # the last page: not held until the next export
        return ids[start: start + limit].copy(), self.values[page], more

    def stats(self) -> dict[str, Any]:
        return {
            "rows": len(self.index),
            "bytes": self.nbytes,
            "capacity": self.capacity,
            "pending_admission": len(self.sightings),
            "pending_pruned": self.pending_pruned,
            "dropped_pushes": self.dropped_pushes,
            "evicted": self.evicted,
            "index_bytes": self.index_bytes,
            "step": self.step,
            "drop_log": len(self.drops),
            "drop_log_since": self.drops.since,
        }


def _check_clock(value: int, what: str) -> int:
    """``value``, a step a request moves a table's clock to; InvalidArgument past ``MAX_CLOCK``."""
    if value > MAX_CLOCK:
        raise InvalidArgument(f"{what} {value} is past the most a table's clock counts ({MAX_CLOCK})")
    return value
