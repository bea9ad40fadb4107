"""The catalog of variable names, sans-IO: one record per variable, saying where its parts live.

Every declaration goes through the catalog, which serializes them: two sessions declaring one
name concurrently get the same record, and the placement counter (round-robin) or byte counts
(greedy) see every variable of the cluster, as a single ``replica_device_setter`` would.

Until a record is ready, one declarer at a time holds a claim on it: the right to create its
parts. Others wait for it to become ready. Were every declarer to create the parts it found
missing, each from what it holds, one attaching by shape would make zeros where the creator gave
a value, and workers with different random values would mix them part by part. A claim passes on
only when its lease lapses (its holder died or hangs) or its holder gives it up; a declarer with
neither a value nor a record initializer to build from never gets one.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

import msgpack

from . import optim as _optim
from ..cluster import TaskId
from ..errors import ConfigError, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, VariableConflict
from ..wire.dtypes import dtype_from_name
from .limits import DEFAULT_STATE_LIMITS, StateLimits, check_count, check_variable, table_capacity
from .tables import HashTable

__all__ = ["Catalog", "Claim", "Pending", "attaches", "MAX_CATALOG_PARTS", "MAX_SPEC_BYTES", "canonical_device",
           "check_tiling"]

# Records are kept for good and a part costs its record a few hundred bytes, so the parts of all
# records have a bound of their own beside the count of names; and each spec a client hands over
# (optimizer, initializer, table) is plain data of a few fields, kept as sent.
MAX_CATALOG_PARTS = 1 << 20
MAX_SPEC_BYTES = 4096


@dataclass
class Claim:
    """The right to create a not-ready record's parts. ``owner`` is the caller as the RPC edge
    names it (with keys, its key's name), so a token that reaches another caller is of no use to
    it; ``token`` is unguessable and handed to the holder only; ``until`` is when the lease lapses;
    ``overwrite``: the holder writes its value over the parts it finds (see ``Pending``)."""

    owner: str
    token: str
    until: float
    overwrite: bool = False


@dataclass
class Pending:
    """What the catalog keeps of a record until it is ready. ``counted``: per part, its task and
    the bytes it added to ``Catalog.bytes`` and ``Catalog.held``, given back if it is abandoned.
    ``defaulted``: made by a declaration that gave neither a value nor an initializer (zeros): a
    declaration with a value takes it over, as it would have made it had it come first; its parts
    may then hold zeros already, so every later holder has to ``overwrite`` them. So does every
    holder after the first of a record made from a value (``handed``: a claim was handed out):
    its parts may hold another declarer's value, which must not mix with this one's part by part."""

    counted: list[tuple[str, int, int]]
    claim: Claim | None = None
    defaulted: bool = False
    overwrite: bool = False
    handed: bool = False


class Catalog:
    def __init__(self, shards: list[str], limits: StateLimits = DEFAULT_STATE_LIMITS):
        if not shards:
            raise InvalidArgument("a catalog needs at least one shard")
        self.limits = limits
        self.shards = list(shards)
        self.records: dict[str, dict[str, Any]] = {}
        self._next = 0
        self.bytes = {s: 0 for s in self.shards}  # value bytes placed per shard (greedy placement)
        self.held: dict[str, int] = {}  # bytes placed per shard with optimizer slots (its budget)
        self.parts = 0  # parts of all records
        self.pending: dict[str, Pending] = {}  # records not ready, by name

    def declare(
        self,
        name: str,
        shape: list[int],
        dtype: str,
        part_rows: list[list[int]],
        part_bytes: list[int],
        *,
        device: str | None = None,
        policy: str = "round_robin",
        optimizer: Any = None,
        initializer: Any = None,
        table: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The variable's record, created (with placement) on first declaration. ``table``
        describes an embedding table (kind, strategy, sizes); it must match on redeclaration."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"variable name must be a non-empty string, got {name!r}")
        if device is not None:
            device = canonical_device(name, device)
        if len(part_rows) != len(part_bytes) or not part_rows:
            raise InvalidArgument(f"variable {name!r}: {len(part_rows)} part row ranges but {len(part_bytes)} part sizes")
        found = self.records.get(name)
        if found is not None:
            mine = (found["shape"], found["dtype"], [p["rows"] for p in found["parts"]])
            theirs = (list(shape), dtype, [list(r) for r in part_rows])
            if found.get("table") != table:
                raise VariableConflict(f"{name!r} exists as {_kind(found.get('table'))}; declared as {_kind(table)}")
            if mine != theirs:
                raise VariableConflict(
                    f"variable {name!r} exists with shape {mine[0]} {mine[1]} in {len(mine[2])} part(s) {mine[2]}; "
                    f"declared with shape {theirs[0]} {theirs[1]} in {len(theirs[2])} part(s) {theirs[2]}"
                )
            if not attaches(optimizer, found["optimizer"]):
                have = found["optimizer"] or "none (a plain add)"
                raise VariableConflict(f"variable {name!r} exists with optimizer {have}; declared with {optimizer}",
                                       name=name)
            return found
        for what, spec in (("optimizer", optimizer), ("initializer", initializer), ("table", table)):
            _check_spec(name, what, spec)
        held = self._check_new(name, shape, dtype, part_rows, optimizer, table)
        tasks = self._placed(name, device, policy, part_bytes, held)
        record = {
            "name": name,
            "shape": list(shape),
            "dtype": dtype,
            "parts": [{"task": t, "rows": list(r)} for t, r in zip(tasks, part_rows)],
            "optimizer": optimizer,
            "initializer": initializer,
            "table": table,
            "ready": False,
        }
        self.records[name] = record
        self.parts += len(part_rows)
        self.pending[name] = Pending([(t, int(b), h) for t, b, h in zip(tasks, part_bytes, held)])
        return record

    def _check_new(self, name: str, shape: list[int], dtype: str, part_rows: list[list[int]], optimizer: Any,
                   table: dict[str, Any] | None) -> list[int]:
        """A new variable's limits, checked before anything is recorded; the bytes a shard holds
        for each part (computed here, not taken from the peer): its value and optimizer slots,
        which are float32 for a half-precision variable (``optim.slot_dtype``)."""
        limits = self.limits
        check_count(name, len(self.records), limits.max_variables, "the catalog")
        if self.parts + len(part_rows) > MAX_CATALOG_PARTS:
            raise ResourceExhausted(f"variable {name!r}: its {len(part_rows)} parts would bring the catalog to "
                                    f"{self.parts + len(part_rows)} parts, over its limit of {MAX_CATALOG_PARTS}",
                                    name=name, limit=MAX_CATALOG_PARTS)
        try:
            itemsize = dtype_from_name(dtype).itemsize
        except InvalidArgument:
            raise InvalidArgument(f"variable {name!r}: unknown dtype {dtype!r}") from None
        check_variable(name, shape, itemsize, limits)
        opt = _optim.from_spec(optimizer)
        _optim.check_dtype(opt, dtype_from_name(dtype), repr(name))
        held = _optim.held_itemsize(opt, dtype_from_name(dtype))  # per element; the value's is ``itemsize``
        dim0 = shape[0] if shape else 1
        row_held = (math.prod(shape[1:]) if shape else 1) * held
        if table is not None and table.get("kind") == "hash":
            capacity = table.get("capacity")
            if capacity is not None and not isinstance(capacity, int):
                raise InvalidArgument(f"embedding {name!r}: capacity must be an int or None, got {capacity!r}")
            table_capacity(name, capacity, HashTable.row_size(shape[-1] if shape else 1, dtype_from_name(dtype), optimizer),
                           limits)
            return [0 for _ in part_rows]  # rows are made on demand, up to the capacity
        if table is None:
            check_tiling(name, part_rows, dim0)
        for r in part_rows:  # a table's parts count their rows each from 0
            if not (0 <= r[0] <= r[1] <= dim0):
                raise InvalidArgument(f"variable {name!r}: part rows {r} are not a range within [0, {dim0}]")
        return [(r[1] - r[0]) * row_held for r in part_rows]

    def _placed(self, name: str, device: str | None, policy: str, part_bytes: list[int], held_bytes: list[int]) -> list[str]:
        """The parts' tasks, placed by the sizes the declaring client gave (a heuristic); refused,
        with no placement counted, when a shard would pass its byte budget, counted from the sizes
        computed here (values and optimizer slots)."""
        if device is None and policy not in ("greedy", "round_robin"):
            raise InvalidArgument(f"unknown placement policy {policy!r} (round_robin, greedy)")
        saved = (dict(self.bytes), self._next)
        tasks = [self._place(device, policy, b) for b in part_bytes]
        held = dict(self.held)
        for task, nbytes in zip(tasks, held_bytes):
            held[task] = held.get(task, 0) + nbytes
        over = [t for t in set(tasks) if held[t] > self.limits.max_shard_bytes]
        if over:
            self.bytes, self._next = saved
            task = sorted(over)[0]
            raise ResourceExhausted(
                f"variable {name!r}: its parts would bring shard {task} to {held[task]} bytes (values and optimizer "
                f"slots), over the limit of {self.limits.max_shard_bytes} bytes per shard", name=name, task=task,
                bytes=held[task], limit=self.limits.max_shard_bytes)
        self.held = held
        return tasks

    def _place(self, device: str | None, policy: str, nbytes: int) -> str:
        if device is not None:
            task = device
        elif policy == "greedy":
            task = min(self.shards, key=lambda s: (self.bytes[s], self.shards.index(s)))
        elif policy == "round_robin":
            task = self.shards[self._next % len(self.shards)]
            self._next += 1
        else:
            raise InvalidArgument(f"unknown placement policy {policy!r} (round_robin, greedy)")
        self.bytes[task] = self.bytes.get(task, 0) + int(nbytes)
        return task

    def claim(self, name: str, owner: str, now: float, lease: float, *, creator: bool = False,
              has_value: bool = False, defaulted: bool = False) -> Claim | None:
        """The claim on a not-ready record for ``owner``, or None: someone else holds it, or
        ``owner`` has nothing to build parts from (neither a value nor, in the record, an
        initializer). Its creator gets it (``defaulted``: it gave neither a value nor an
        initializer), as does its holder again (a retry renews the lease); past the lease, or once
        given up, any declarer that can build (writing over what it finds, when the parts come
        from values); at once, a declarer with a value when the record is defaulted. Sessions that
        share one caller name (a key, a task) count as one declarer."""
        record = self.lookup(name)
        pending = self.pending.get(name)
        if record["ready"] or pending is None or not (creator or has_value or record["initializer"] is not None):
            return None
        held = pending.claim
        if creator:
            pending.defaulted = defaulted
        elif has_value and pending.defaulted:  # its parts come from this value now, over any made meanwhile
            pending.defaulted, pending.overwrite = False, True
            record["initializer"] = None
            held = None
        if held is not None and held.owner == owner:
            held.until = now + lease
            return held
        if held is not None and held.until > now:
            return None
        if pending.handed and record["initializer"] is None:  # an earlier holder may have made parts of its value
            pending.overwrite = True
        pending.handed = True
        pending.claim = Claim(owner, secrets.token_hex(16), now + lease, pending.overwrite)
        return pending.claim

    def may_claim(self, name: str, has_value: bool) -> bool:
        """Whether a declarer could take the claim on ``name`` once it lapses: it has something
        to build the parts from."""
        record = self.records.get(name)
        return record is not None and (has_value or record["initializer"] is not None)

    def holder(self, name: str) -> Claim | None:
        """The claim on ``name`` (lapsed or not); None when nobody holds one."""
        pending = self.pending.get(name)
        return None if pending is None else pending.claim

    def _check_claim(self, name: str, token: str | None, owner: str, op: str) -> Pending | None:
        """What is kept of ``name`` while it is not ready, when ``token`` is its claim's and
        ``owner`` its holder; PermissionDenied naming the holder otherwise."""
        self.lookup(name)
        pending = self.pending.get(name)
        held = None if pending is None else pending.claim
        if held is None and token is None:  # never claimed: made here, not through the service
            return pending
        if held is None or held.token != token or held.owner != owner:
            who = "nobody" if held is None else repr(held.owner)
            raise PermissionDenied(f"catalog.{op} of {name!r}: this caller holds no claim on it (the claim is "
                                   f"held by {who}: it lapsed and passed on, or was given up)", name=name)
        return pending

    def claimed_parts(self, name: str, token: str, owner: str) -> list[tuple[str, int]]:
        """Each part of ``name`` as (task, part index), for the holder of its claim only (the
        parts its declarer made are to be dropped before it abandons the record)."""
        record, _ = self._abandoning(name, token, owner)
        return [(p["task"], i) for i, p in enumerate(record["parts"])]

    def _abandoning(self, name: str, token: str, owner: str) -> tuple[dict[str, Any], Pending | None]:
        """The record of ``name`` and what is kept of it, when ``owner`` holds its claim and it is
        not ready: only such a record may be abandoned."""
        record = self.lookup(name)
        if record["ready"]:
            raise InvalidArgument(f"catalog.abandon of {name!r}: the variable is ready; only a record whose parts "
                                  "are still being created can be abandoned", name=name)
        return record, self._check_claim(name, token, owner, "abandon")

    def mark_ready(self, name: str, token: str | None = None, owner: str = "") -> dict[str, Any]:
        """The record, made ready by its claim's holder (once every part exists)."""
        record = self.lookup(name)
        if record["ready"]:
            return record
        self._check_claim(name, token, owner, "mark_ready")
        record["ready"] = True
        self.pending.pop(name, None)
        return record

    def abandon(self, name: str, token: str, owner: str, *, keep: bool = False) -> bool:
        """Give up the claim on a not-ready record: with ``keep``, the record stays for the next
        declarer (a shard was out: a retry goes on); else the record goes, and with it what it
        counted against the shards' budgets (a shard refused a part: the name is free again).
        True when the record went."""
        record, pending = self._abandoning(name, token, owner)
        if pending is not None:
            pending.claim = None
        if keep:
            return False
        for task, placed, held in [] if pending is None else pending.counted:
            self.bytes[task] = self.bytes.get(task, 0) - placed
            left = self.held.get(task, 0) - held
            if left:
                self.held[task] = left
            else:
                self.held.pop(task, None)
        self.pending.pop(name, None)
        self.parts -= len(record["parts"])
        del self.records[name]
        return True

    def lookup(self, name: str) -> dict[str, Any]:
        found = self.records.get(name)
        if found is None:
            raise NotFound(f"no variable named {name!r}")
        return found

    def ready(self, name: str) -> bool:
        found = self.records.get(name)
        return bool(found and found["ready"])

    def uninitialized(self, names: list[str]) -> list[str]:
        return [n for n in names if not self.ready(n)]


def attaches(declared: Any, held: Any) -> bool:
    """Whether a declaration naming optimizer spec ``declared`` attaches to a record held with
    ``held``: one naming none attaches as it is (get-or-create); else only the same optimizer."""
    return declared is None or _optim.from_spec(declared) == _optim.from_spec(held)


def check_tiling(name: str, part_rows: Any, dim0: int) -> None:
    """``part_rows`` as a variable's parts: ranges that cover ``[0, dim0)`` in order, each starting
    where the one before ends. Any gap would be read as memory no part ever wrote; any overlap
    would be two shards' rows for one row."""
    end = 0
    for r in part_rows:
        if not (isinstance(r, (list, tuple)) and len(r) == 2 and r[0] == end and r[0] <= r[1] <= dim0):
            raise InvalidArgument(f"variable {name!r}: part rows {list(part_rows)} do not cover [0, {dim0}) in order, "
                                  f"each part starting where the one before ends (at {r!r})", name=name)
        end = r[1]
    if end != dim0:
        raise InvalidArgument(f"variable {name!r}: part rows {list(part_rows)} end at row {end}, not at {dim0}",
                              name=name)


def canonical_device(name: str, device: object) -> str:
    """``device`` as the task name records hold (``job:index``): an alias ('/job:ps/task:0',
    '/job:ps/replica:0/task:0/device:CPU:0') names the same shard, so it must count against the
    same byte budget and be found by whoever looks the shard's parts up by task."""
    try:
        return str(TaskId.parse(device))  # type: ignore[arg-type]
    except ConfigError:
        raise InvalidArgument(f"variable {name!r}: device {device!r} is not a task ('job:index' or "
                              "'/job:name/task:index')", name=name) from None


def _kind(table: dict[str, Any] | None) -> str:
    if table is None:
        return "a variable"
    return "an embedding table " + ", ".join(f"{k}={v}" for k, v in sorted(table.items()))


def _check_spec(name: str, what: str, spec: Any) -> None:
    """A spec the catalog keeps: plain data of at most ``MAX_SPEC_BYTES`` as msgpack."""
    if spec is None:
        return
    try:
        size = len(msgpack.packb(spec, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"variable {name!r}: its {what} spec must be plain data (maps, lists, numbers, "
                              f"strings)") from None
    if size > MAX_SPEC_BYTES:
        raise InvalidArgument(f"variable {name!r}: its {what} spec takes {size} bytes, over the limit of "
                              f"{MAX_SPEC_BYTES}")
