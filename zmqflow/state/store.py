"""The variable store of one parameter-server shard, sans-IO.

A shard holds parts of variables: a part is rows ``[r0, r1)`` (axis 0) of a variable's full
shape, kept as one owned numpy array with its optimizer slots beside it (in float32 for a
float16 or bfloat16 part: :func:`zmqflow.state.optim.slot_dtype`). Every operation checks
its input completely before it writes, so bad input changes nothing; each runs to completion
without awaiting, so it is atomic on the shard.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from . import init as _init
from . import optim as _optim
from ..errors import InvalidArgument, NotFound, ResourceExhausted, VariableConflict
from ..wire.dtypes import dtype_from_name
from .limits import DEFAULT_STATE_LIMITS, StateLimits, check_count, check_variable
from .kernels import add_into
from .sparse import unique_sum
from .sync import SyncState

__all__ = ["Part", "Plan", "ShardStore", "PartKey", "Rows", "Sparse", "build"]

PartKey = tuple[str, int]
_ASSIGN_MODES = frozenset(("set", "add", "sub"))


def part_label(key: PartKey) -> str:
    return key[0] if key[1] == 0 else f"{key[0]} (part {key[1]})"


@dataclass(eq=False)
class Part:
    name: str
    index: int
    full_shape: tuple[int, ...]
    rows: tuple[int, int]
    dtype: np.dtype
    value: np.ndarray
    optimizer: _optim.Optimizer | None
    slots: dict[str, np.ndarray] = field(default_factory=dict)
    steps: np.ndarray | None = None  # per-row update counts (Adam's t)
    sync: SyncState | None = None
    num_parts: int = 1

    @property
    def label(self) -> str:
        return part_label((self.name, self.index))

    @functools.cached_property
    def nrows(self) -> int:  # ``rows`` never change; a push reads this three times an item
        return self.rows[1] - self.rows[0]

    @property
    def part_shape(self) -> tuple[int, ...]:
        return (self.nrows, *self.full_shape[1:]) if self.full_shape else ()

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of the one item, for a scalar)."""
        return self.dtype.itemsize * math.prod(self.full_shape[1:])

    @functools.cached_property
    def cols(self) -> int:
        """Items in one row (1 for a scalar): a part's shape never changes."""
        return math.prod(self.full_shape[1:]) if self.full_shape else 1

    def grid(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` (this part's shape, or rows of it) seen as 2-D: rows x everything else (a view)."""
        return arr.reshape(arr.shape[0] if arr.ndim else 1, self.cols)

    @property
    def nbytes(self) -> int:
        steps = self.steps.nbytes if self.steps is not None else 0
        # a copy of the slots: a scrape reads this on its own thread while the loop may add one
        return self.value.nbytes + sum(s.nbytes for s in list(self.slots.values())) + steps

    def own(self) -> None:
        """Call before writing ``value`` in place. Pulls send views of ``value`` zero-copy, and
        until ZeroMQ has sent them their frames hold references to it; a write then would tear
        the bytes on the wire, so it goes to a fresh copy instead (copy-on-write). The count is
        exact: ``value`` owns its memory, and every view of it refers to it, not to another view."""
        if sys.getrefcount(self.value) > _OWN_REFS:
            self.value = self.value.copy()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "part": self.index,
            "shape": list(self.full_shape),
            "rows": list(self.rows),
            "dtype": str(self.dtype),
            "optimizer": None if self.optimizer is None else self.optimizer.spec(),
            "sync": None if self.sync is None else self.sync.describe(),
            "bytes": self.nbytes,
        }


def _own_refs() -> int:
    """References ``Part.own`` sees on a value nothing else holds (measured: it varies by Python)."""
    probe = Part("", 0, (1,), (0, 1), np.dtype("float64"), np.zeros(1), None)
    return sys.getrefcount(probe.value)


_OWN_REFS = _own_refs()


@dataclass(frozen=True, slots=True)
class Plan:
    """A part checked and reserved, not yet allocated: :func:`build` makes it, on any thread."""

    key: PartKey
    part: Part
    value: np.ndarray | None
    init: _init.Initializer | None
    salt: int
    nbytes: int


def build(plan: Plan) -> Part:
    """Allocate and initialize a planned part. Touches nothing shared, so a big one can run in an
    executor while the shard's loop keeps answering; the OS refusing memory is ResourceExhausted."""
    src = plan.part
    p = Part(src.name, src.index, src.full_shape, src.rows, src.dtype, src.value, src.optimizer, sync=src.sync,
             num_parts=src.num_parts)
    try:
        if plan.value is not None:
            # C order always: updates work on row views of the stored array, never on copies
            p.value = np.array(plan.value, dtype=p.dtype, order="C")
        else:
            assert plan.init is not None
            p.value = _init.build(plan.init, p.full_shape, p.rows, p.dtype, plan.salt)
        opt = p.optimizer
        if opt is not None:
            for slot in opt.slot_names:
                p.slots[slot] = np.full(p.part_shape, opt.slot_init(slot), dtype=_optim.slot_dtype(p.dtype))
            if opt.uses_step:
                p.steps = np.zeros(max(p.nrows, 1) if p.full_shape else 1, dtype=np.int64)
    except MemoryError:
        raise ResourceExhausted(f"variable {p.label}: the shard could not allocate its {plan.nbytes} bytes",
                                name=p.name, bytes=plan.nbytes) from None
    return p


class Rows(NamedTuple):
    """Rows ``[start, stop)`` of a part and a value of exactly their shape and the part's dtype.
    Made by :meth:`ShardStore.rows` (checked there, once) or from values already checked. A named
    tuple: made on every write, and a frozen dataclass's ``__init__`` costs several times more."""

    part: Part
    start: int
    stop: int
    value: np.ndarray


class Sparse(NamedTuple):
    """Part-local row indices (int64, in range) and one row each, of the part's dtype; made by
    :meth:`ShardStore.sparse` (checked there, once) or from values already checked."""

    part: Part
    indices: np.ndarray
    rows: np.ndarray


class ShardStore:
    """All parts held by one shard, by (name, part index). Writes check their input completely
    (``rows``, ``sparse``) and then apply it (``write``, ``apply``), so a caller with many items
    checks them all before it applies any, and nothing is checked twice."""

    def __init__(self, limits: StateLimits = DEFAULT_STATE_LIMITS) -> None:
        self.parts: dict[PartKey, Part] = {}
        self.limits = limits
        self._reserved: dict[PartKey, int] = {}  # parts being built: their bytes
        self._held = 0  # bytes of ``parts``, counted on commit
        self._held_parts = 0

    # lifecycle --------------------------------------------------------------------------
    def create(self, name: str, part: int, shape: list[int], rows: list[int], dtype: str, *, num_parts: int = 1,
               optimizer: Any = None, initializer: Any = None, value: np.ndarray | None = None, salt: int = 0) -> bool:
        """Create the part unless it exists; True when this call created it. Conflicts raise."""
        plan = self.plan(name, part, shape, rows, dtype, num_parts=num_parts, optimizer=optimizer,
                         initializer=initializer, value=value, salt=salt)
        if plan is None:
            return False
        try:
            built = build(plan)
        finally:
            self.release(plan)
        return self.commit(built)

    def plan(
        self,
        name: str,
        part: int,
        shape: list[int],
        rows: list[int],
        dtype: str,
        *,
        num_parts: int = 1,
        optimizer: Any = None,
        initializer: Any = None,
        value: np.ndarray | None = None,
        salt: int = 0,
        extra_bytes: int = 0,
    ) -> "Plan | None":
        """Everything checked, nothing allocated: the part to build, its bytes reserved against
        the shard's budget until :meth:`release`; None when the part exists as declared.
        ``extra_bytes``: what the shard holds outside the store (dynamic tables)."""
        dt = _dtype(dtype, name)
        full = _shape(shape, name)
        r0, r1 = _rows(rows, full, name)
        key = (name, int(part))
        existing = self.parts.get(key)
        if existing is not None:
            mine = (existing.full_shape, existing.rows, existing.dtype, existing.num_parts)
            theirs = (full, (r0, r1), dt, int(num_parts))
            if mine != theirs:
                raise VariableConflict(
                    f"variable {existing.label} exists as shape {list(existing.full_shape)} {existing.dtype} "
                    f"rows {list(existing.rows)} of {existing.num_parts} parts; declared as shape {list(full)} {dt} "
                    f"rows {[r0, r1]} of {num_parts} parts"
                )
            if optimizer is not None:  # none named: attach to the part as it is (get-or-create)
                _same_optimizer(existing, _optim.from_spec(optimizer))
            return None
        limits = self.limits
        check_variable(name, full, dt.itemsize, limits)
        check_count(name, len(self.parts) + len(self._reserved), limits.max_variables, "this shard")
        opt = _optim.from_spec(optimizer)
        _optim.check_dtype(opt, dt, part_label(key))
        sync = None
        if isinstance(opt, _optim.SyncReplicas):
            sync = SyncState(opt.replicas_to_aggregate, opt.total_num_replicas, opt.drop_dead_replicas)
            opt = opt.optimizer
        p = Part(name, int(part), full, (r0, r1), dt, np.empty(0, dt), opt, sync=sync, num_parts=int(num_parts))
        if value is not None:
            value = _check_array(value, p.part_shape, dt, "initial value", p)
        init = None if value is not None else _init.from_spec(initializer) if initializer is not None else _init.zeros()
        nbytes = math.prod(p.part_shape) * _optim.held_itemsize(opt, dt)
        if opt is not None and opt.uses_step:
            nbytes += 8 * (max(p.nrows, 1) if p.full_shape else 1)  # each row's step count (int64)
        held = self.held_bytes() + extra_bytes
        if held + nbytes > limits.max_shard_bytes:
            raise ResourceExhausted(
                f"variable {p.label}: its {nbytes} bytes (value, optimizer slots, step counts) would bring this "
                f"shard to {held + nbytes} bytes, over its limit of {limits.max_shard_bytes}",
                name=name, bytes=nbytes, limit=limits.max_shard_bytes)
        if key in self._reserved:
            raise VariableConflict(f"variable {p.label} is being created by another request; declare it again")
        plan = Plan(key, p, value, init, salt, nbytes)
        self._reserved[key] = nbytes
        return plan

    def release(self, plan: "Plan") -> None:
        """Give back the bytes :meth:`plan` reserved (after :meth:`commit`, or when it failed)."""
        self._reserved.pop(plan.key, None)

    def commit(self, p: Part) -> bool:
        """Add a built part; False when one was added meanwhile (the first one wins)."""
        key = (p.name, p.index)
        if key in self.parts:
            return False
        self.parts[key] = p
        self._held += p.nbytes
        self._held_parts += 1
        return True

    def held_bytes(self) -> int:
        """Bytes of the parts held and being built. O(1): recounted only after parts were removed
        from ``parts`` directly (a sweep), which the running count cannot see."""
        if self._held_parts != len(self.parts):
            self._held = sum(p.nbytes for p in self.parts.values())
            self._held_parts = len(self.parts)
        return self._held + sum(self._reserved.values())

    def get(self, name: str, part: int = 0) -> Part:
        found = self.parts.get((name, int(part)))
        if found is None:
            raise NotFound(f"no variable {part_label((name, int(part)))!r} on this shard")
        return found

    @property
    def nbytes(self) -> int:
        """Bytes held by every part; over a copy of the parts, so another thread (a scrape) may read it."""
        return sum(p.nbytes for p in list(self.parts.values()))

    # reads and writes -------------------------------------------------------------------
    def read(self, name: str, part: int = 0, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """A copy of rows ``[start, stop)`` (part-local)."""
        p = self.get(name, part)
        a, b = _local_range(p, start, stop)
        return p.value.copy() if not p.full_shape else p.value[a:b].copy()

    def view(self, name: str, part: int = 0, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """A read-only view of rows ``[start, stop)``, to send zero-copy: writes made while it is
        alive go to a copy of the part (``Part.own``), so its bytes never change under it."""
        p = self.get(name, part)
        return self.view_rows(p, *_local_range(p, start, stop))

    @staticmethod
    def view_rows(p: Part, a: int, b: int) -> np.ndarray:
        """``view`` of part ``p``'s local rows ``[a, b)``, checked already (``row_range``)."""
        if p.value.base is not None:  # views must refer to ``value`` itself for ``own`` to count them
            p.value = p.value.copy()
        v = p.value[...] if not p.full_shape else p.value[a:b]
        v.flags.writeable = False
        return v

    # checking ---------------------------------------------------------------------------
    def row_range(self, name: str, part: int, start: int | None, stop: int | None) -> tuple[Part, int, int]:
        """The part and its checked local rows ``[start, stop)`` (None: from the start, to the end)."""
        p = self.get(name, part)
        return (p, *_local_range(p, start, stop))

    def rows(self, name: str, part: int, start: int | None, stop: int | None, value: object, what: str) -> Rows:
        """``value`` checked as rows ``[start, stop)`` of the part (None: the whole part)."""
        p = self.get(name, part)
        a, b = _local_range(p, start, stop)
        shape = p.value.shape if not p.full_shape else (b - a, *p.full_shape[1:])
        return Rows(p, a, b, _check_array(value, shape, p.dtype, what, p))

    def sparse(self, name: str, part: int, indices: object, rows: object, what: str) -> Sparse:
        """``indices`` (part-local) and ``rows`` checked against the part."""
        p = self.get(name, part)
        label = f"{what} of {p.label}"
        if not p.full_shape:
            raise InvalidArgument(f"{label}: a scalar variable has no rows to index")
        idx = np.asarray(indices)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise InvalidArgument(f"{label}: indices must be a 1-D integer array, got {idx.dtype} of shape {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= p.nrows):  # part-local indices, named as such
            bad = int(idx[(idx < 0) | (idx >= p.nrows)][0])
            where = "" if p.num_parts == 1 else f" (rows {p.rows[0]}..{p.rows[1]} of the variable)"
            raise InvalidArgument(f"{label}: index {bad} out of range [0, {p.nrows}){where}")
        x = _check_array(rows, (len(idx), *p.full_shape[1:]), p.dtype, what, p)
        return Sparse(p, idx.astype(np.int64, copy=False), x)

    # writing checked input ----------------------------------------------------------------
    def write(self, r: Rows, mode: str = "set") -> None:
        """Set, add or subtract checked rows."""
        if mode not in _ASSIGN_MODES:
            raise InvalidArgument(f"unknown assign mode {mode!r}")
        p = r.part
        p.own()
        target = p.value if not p.full_shape else p.value[r.start:r.stop]
        if mode == "set":
            target[...] = r.value
        elif not add_into(target, r.value, 1.0 if mode == "add" else -1.0):
            if mode == "add":
                target += r.value
            else:
                target -= r.value

    def write_sparse(self, s: Sparse, mode: str = "add") -> None:
        """Rows by index: ``add`` sums duplicates; ``update`` keeps the last."""
        if mode not in ("add", "update"):
            raise InvalidArgument(f"unknown scatter mode {mode!r}")
        p = s.part
        p.own()
        if mode == "add":
            uniq, summed = unique_sum(s.indices, s.rows)
            p.value[uniq] += summed
        else:
            p.value[s.indices] = s.rows

    def apply(self, update: Rows | Sparse, learning_rate: float | None = None) -> None:
        """The part's optimizer on checked rows (a plain add without one, which has no rate to
        change); sparse rows touch only their rows, duplicates summed first, nothing densified.
        ``learning_rate``: the push's own, in place of the optimizer's."""
        p = update.part
        if isinstance(update, Sparse):
            uniq, summed = unique_sum(update.indices, update.rows)
            p.own()
            if p.optimizer is None:
                p.value[uniq] += summed
            else:
                self._update(p, uniq, p.grid(summed), learning_rate)
            return
        p.own()
        if p.optimizer is None:
            if not p.full_shape:
                p.value += update.value
            else:
                p.value[update.start:update.stop] += update.value
            return
        rows = slice(update.start, update.stop) if p.full_shape else slice(0, 1)
        self._update(p, rows, p.grid(update.value), learning_rate)

    # checking and writing in one call ----------------------------------------------------
    def assign(self, name: str, part: int, value: np.ndarray, mode: str = "set", start: int | None = None, stop: int | None = None) -> None:
        if mode not in ("set", "add", "sub"):
            raise InvalidArgument(f"unknown assign mode {mode!r}")
        self.write(self.rows(name, part, start, stop, value, mode), mode)

    def scatter(self, name: str, part: int, indices: np.ndarray, rows: np.ndarray, mode: str = "add") -> None:
        """Rows by part-local index: ``add`` sums duplicates; ``update`` keeps the last."""
        checked = self.sparse(name, part, indices, rows, f"scatter_{mode}")
        self.write_sparse(checked, mode)

    # optimizer updates ------------------------------------------------------------------
    def apply_dense(self, name: str, part: int, grad: np.ndarray, start: int | None = None, stop: int | None = None) -> None:
        """Apply the part's optimizer to rows ``[start, stop)`` (plain add without one)."""
        self.apply(self.rows(name, part, start, stop, grad, "gradient"))

    def apply_sparse(self, name: str, part: int, indices: np.ndarray, rows: np.ndarray) -> None:
        """Apply the optimizer to the touched rows only (duplicates summed first); nothing densified."""
        self.apply(self.sparse(name, part, indices, rows, "sparse gradient"))

    def _update(self, p: Part, rows: slice | np.ndarray, grad2d: np.ndarray, learning_rate: float | None) -> None:
        assert p.optimizer is not None
        grid = p.grid
        value2d = grid(p.value)
        fancy = not isinstance(rows, slice)
        # rows by index: gathered into new arrays (``take``: twice as fast as indexing, which copies too)
        param = np.take(value2d, rows, axis=0) if fancy else value2d[rows]
        slots: dict[str, np.ndarray] = {}  # SGD has none: no comprehension (it costs more than ``apply``'s check)
        if p.slots:
            slots = {k: (np.take(grid(s), rows, axis=0) if fancy else grid(s)[rows]) for k, s in p.slots.items()}
        t = None
        if p.steps is not None:  # only for an optimizer that reads them (Adam's t)
            p.steps[rows] += 1
            t = p.steps[rows]
        optimizer = p.optimizer if learning_rate is None else p.optimizer.at(learning_rate)
        out = optimizer.apply(param, grad2d, slots, t)
        if fancy or out is not param:
            value2d[rows] = out
        if fancy:
            for k, s in slots.items():
                p.grid(p.slots[k])[rows] = s

# validation ---------------------------------------------------------------------------------


def _same_optimizer(p: Part, declared: "_optim.Optimizer | _optim.SyncReplicas | None") -> None:
    """VariableConflict unless ``declared`` is the optimizer (and synchronous replication) ``p`` has."""
    have: _optim.Optimizer | _optim.SyncReplicas | None = p.optimizer
    if p.sync is not None and p.optimizer is not None:
        have = _optim.SyncReplicas(p.optimizer, p.sync.replicas_to_aggregate, p.sync.total_num_replicas,
                                   p.sync.drop_dead)
    if have != declared:
        def spec(o: Any) -> Any:
            return "none (a plain add)" if o is None else o.spec()
        raise VariableConflict(f"variable {p.label} exists with optimizer {spec(have)}; declared with {spec(declared)}")


def _dtype(name: object, var: str) -> np.dtype:
    try:
        return dtype_from_name(name)
    except InvalidArgument:
        raise InvalidArgument(f"variable {var!r}: unknown dtype {name!r}") from None


def _shape(shape: object, var: str) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidArgument(f"variable {var!r}: shape must be a list of non-negative ints, got {shape!r}")
    return tuple(shape)


def _rows(rows: object, full: tuple[int, ...], var: str) -> tuple[int, int]:
    dim = full[0] if full else 1
    if not isinstance(rows, (list, tuple)) or len(rows) != 2 or not (0 <= rows[0] <= rows[1] <= dim):
        raise InvalidArgument(f"variable {var!r}: rows {rows!r} are not a range within [0, {dim}]")
    return int(rows[0]), int(rows[1])


def _local_range(p: Part, start: int | None, stop: int | None) -> tuple[int, int]:
    if start is None and stop is None:  # the whole part (a scalar's one item)
        return 0, p.rows[1] - p.rows[0]
    a = 0 if start is None else start
    b = p.nrows if stop is None else stop
    if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= max(p.nrows, 0)):
        raise InvalidArgument(f"rows [{start}, {stop}) out of range for {p.label} with {p.nrows} rows")
    return a, b


def _check_array(x: object, shape: tuple[int, ...], dtype: np.dtype, what: str, p: Part) -> np.ndarray:
    """``x`` as ``what`` of part ``p`` (named in the error, formatted only then); ``shape`` is a tuple."""
    if not isinstance(x, np.ndarray):
        raise InvalidArgument(f"{what} of {p.label}: expected an array of shape {list(shape)} {dtype}, got {type(x).__name__}")
    if x.dtype != dtype:
        raise InvalidArgument(f"{what} of {p.label}: expected dtype {dtype}, got {x.dtype}")
    if x.shape != shape:
        if math.prod(x.shape) == math.prod(shape) and x.size == 0:
            return x.reshape(shape)
        raise InvalidArgument(f"{what} of {p.label}: expected shape {list(shape)}, got {list(x.shape)}")
    return x
