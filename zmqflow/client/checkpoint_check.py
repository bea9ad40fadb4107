"""What a restore checks before it changes anything (and a save, before it commits).

A restore puts many records back, each through several shards; one found bad half-way would leave
some variables restored and others not. So every record is checked first, against the files that
hold it (:func:`check_files`: every part there, dtypes, shapes, row counts, optimizer slots, step
counts) and against what the cluster holds under its name (:func:`check_live`: shape, dtype,
partitioning, table kind, the optimizer whose slots the parts would take). Only headers are read:
the data stays on disk. What is refused names the checkpoint and the variable or table at fault,
and nothing has changed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgument, ResourceExhausted, ShardStateLost, VariableConflict
from ..state import init as _init
from ..state import optim as _optim
from ..state.catalog import attaches
from ..state.partition import row_splits
from ..state.snapshot import entry_tensor
from ..state.store import part_label
from ..state.owners import hash_owner, static_part_rows
from ..wire.dtypes import dtype_from_name, dtype_name
from .checkpoint_files import Piece, fields
from .checkpoint_files import field as read_field

__all__ = ["check_files", "check_live", "check_capacity", "check_saved", "declared_rows", "is_hash"]


def is_hash(record: dict[str, Any]) -> bool:
    """Whether ``record`` is a dynamic (hash) table: its rows are re-hashed, not placed by range."""
    table = record.get("table")
    return bool(table) and table["kind"] == "hash"


def declared_rows(record: dict[str, Any], shards: int) -> list[list[int]]:
    """The part rows a declaration of ``record`` gets on a cluster of ``shards`` ps shards: what
    the catalog compares with a variable it holds, and each part's shape follows from."""
    shape, n = record["shape"], len(record["parts"])
    table = record.get("table")
    if is_hash(record):
        return [[0, 0] for _ in range(shards)]
    if table:
        num = table["num_embeddings"]
        return [[0, r] for r in static_part_rows(num, min(n, num), table["strategy"])]
    return [list(r) for r in row_splits(shape[0], max(1, min(n, shape[0])))] if shape else [[0, 1]]


def check_saved(catalog: str, directory: str, manifest: dict[str, Any]) -> None:
    """What a save is about to commit would restore: every part the catalog (on task
    ``catalog``) records is among what the shard holding it wrote. A shard that restarted empty,
    or the catalog's, writes a file that restores nothing, and committing it would prune the
    checkpoints a recovery needs. ``ShardStateLost``: recover, then save."""
    step, records, shards = manifest["step"], manifest["records"], manifest["shards"]
    wrote = {(sh["task"], e["name"], e["part"]) for sh in shards for e in sh["entries"]}
    for record in records:
        for i, part in enumerate(record["parts"]):
            if (part["task"], record["name"], i) not in wrote:
                raise ShardStateLost(
                    f"checkpoint of step {step} into {directory!r}: {part['task']} holds no "
                    f"{part_label((record['name'], i))} (it restarted without its state); nothing was committed "
                    "or pruned: recover from the last checkpoint", task=part["task"], name=record["name"])
    held = sorted({(sh["task"], e["name"]) for sh in shards for e in sh["entries"]})
    if not records and held:
        raise ShardStateLost(
            f"checkpoint of step {step} into {directory!r}: the catalog on {catalog} records no variables while "
            f"{held[0][0]} holds {held[0][1]!r} (the catalog's shard restarted without its state); nothing was "
            "committed or pruned: recover from the last checkpoint", task=catalog)


def check_files(path: str, manifest: dict[str, Any], pieces: dict[tuple[str, int], Piece]) -> None:
    """Every record of the checkpoint at ``path`` is whole and agrees with the files' headers."""
    records = manifest.get("records")
    if not isinstance(records, list):
        raise InvalidArgument(f"checkpoint {path!r} has no list of records", file=path)
    seen: set[str] = set()
    for record in records:
        name = _check_record(path, record)
        if name in seen:
            raise InvalidArgument(f"checkpoint {path!r} holds {name!r} twice", file=path, name=name)
        seen.add(name)
        saved = [_piece(path, name, pieces, i) for i in range(len(record["parts"]))]
        _check_slots(path, record, saved, record.get("optimizer"), "its optimizer in the checkpoint")
        if is_hash(record):
            for i, piece in enumerate(saved):
                _check_table_piece(path, record, i, piece)
        else:
            sizes = [b - a for a, b in declared_rows(record, 0)]
            if len(sizes) != len(saved):
                raise _bad(path, name, f"its {len(saved)} parts cannot split {record['shape'][:1] or [1]} row(s) "
                                       f"as a declaration does ({len(sizes)} parts)")
            for i, (piece, rows) in enumerate(zip(saved, sizes)):
                _check_part_piece(path, record, i, piece, rows)


def check_live(path: str, records: list[dict[str, Any]], pieces: dict[tuple[str, int], Piece],
               live: list[dict[str, Any]], shards: int) -> None:
    """Every record the cluster already holds (``live``: the catalog's records) would be
    declared again as it is, and its parts take every optimizer slot the checkpoint holds."""
    held = {r["name"]: r for r in live}
    for record in records:
        name = record["name"]
        found = held.get(name)
        if found is None:
            continue
        now = (found["shape"], found["dtype"], [list(p["rows"]) for p in found["parts"]], found.get("table"))
        then = (record["shape"], record["dtype"], declared_rows(record, shards), record.get("table"))
        if now != then:
            raise VariableConflict(
                f"cannot restore {name!r} from {path!r}: the cluster holds it as {_kind(found)} {now[1]} {now[0]} in "
                f"{len(now[2])} part(s), the checkpoint as {_kind(record)} {then[1]} {then[0]} in {len(then[2])} "
                f"part(s); nothing was restored", file=path, name=name)
        saved = [pieces[(name, i)] for i in range(len(record["parts"]))]
        _check_slots(path, record, saved, found.get("optimizer"), "its optimizer on the cluster")
        _check_optimizer(path, record, found)


def _check_optimizer(path: str, record: dict[str, Any], found: dict[str, Any]) -> None:
    """The checkpoint's optimizer is the one the cluster holds ``record`` with, as the catalog
    compares them when the restore declares it again (an optimizer named: the same one)."""
    mine, theirs = record.get("optimizer"), found.get("optimizer")
    try:
        same = attaches(mine, theirs)
    except InvalidArgument:
        same = False
    if not same:
        name = record["name"]
        raise VariableConflict(f"cannot restore {name!r} from {path!r}: the cluster holds it with optimizer "
                               f"{theirs or 'none (a plain add)'}, the checkpoint with {mine}; nothing was restored",
                               file=path, name=name)


def check_capacity(path: str, records: list[dict[str, Any]], pieces: dict[tuple[str, int], Piece],
                   live: list[dict[str, Any]], shards: int) -> None:
    """Every dynamic table's saved rows, re-hashed over the parts the restore puts them in, fit
    each part's capacity (a capacity is per part: fewer parts hold more rows each). Reads the
    saved ids, a part at a time."""
    held = {r["name"]: r for r in live}
    for record in records:
        if not is_hash(record) or record["table"].get("capacity") is None:
            continue  # no capacity named: the shard's limits bound the part, and its answer tells
        name, capacity = record["name"], record["table"]["capacity"]
        parts = len(held[name]["parts"]) if name in held else shards
        rows = np.zeros(parts, np.int64)
        for i in range(len(record["parts"])):
            ids = read_field(pieces[(name, i)], "ids")
            if ids is not None and len(ids):
                rows += np.bincount(hash_owner(ids.astype(np.int64, copy=False), parts), minlength=parts)
        part = int(np.argmax(rows))
        if rows[part] > capacity:
            raise ResourceExhausted(
                f"cannot restore table {name!r} from {path!r} onto {parts} part(s): its part {part} would hold "
                f"{int(rows[part])} rows, over its capacity of {capacity} rows a part; restore onto more shards; "
                "nothing was restored", file=path, name=name, part=part, capacity=capacity)


def _kind(record: dict[str, Any]) -> str:
    table = record.get("table")
    return f"a {table['kind']} table" if table else "a variable"


def _bad(path: str, name: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"checkpoint {path!r}: {name!r}: {what}; nothing was restored", file=path, name=name)


def _check_record(path: str, record: Any) -> str:
    """The record's name, once its own fields are well formed."""
    name = record.get("name") if isinstance(record, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"checkpoint {path!r}: a record without a name ({str(record)[:80]})", file=path)
    parts, shape, table = record.get("parts"), record.get("shape"), record.get("table")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) and isinstance(p.get("task"), str)
                                                           for p in parts):
        raise _bad(path, name, f"its parts are not a list of placed parts: {str(parts)[:80]}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise _bad(path, name, f"its shape {shape!r} is not a list of sizes")
    try:
        dtype_from_name(record.get("dtype"))
    except InvalidArgument:
        raise _bad(path, name, f"unknown dtype {record.get('dtype')!r}") from None
    if table is not None:
        ok = isinstance(table, dict) and table.get("kind") in ("hash", "static") and _count(table.get("dim"))
        if ok and table["kind"] == "static":
            ok = _count(table.get("num_embeddings")) and table.get("strategy") in ("mod", "div")
        if ok and table["kind"] == "hash":
            capacity = table.get("capacity")
            ok = _positive(table.get("min_frequency")) and (capacity is None or _positive(capacity))
        if not ok:
            raise _bad(path, name, f"its table description {str(table)[:120]} is not one this version reads")
    _check_specs(path, name, record)
    return name


def _positive(x: Any) -> bool:
    return _count(x) and x > 0


def _check_specs(path: str, name: str, record: dict[str, Any]) -> None:
    """The initializer and optimizer a restore declares ``record`` with are ones this version
    builds (a table's rows come from its initializer; tables take no ``SyncReplicas``)."""
    spec = record.get("initializer")
    if spec is not None:
        try:
            init = _init.from_spec(spec)
        except (InvalidArgument, TypeError) as exc:
            raise _bad(path, name, f"its initializer is not one this version knows: {exc}") from None
        numbers = (init.value, init.mean, init.stddev, init.minval, init.maxval)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) \
                or not _count(init.seed):
            raise _bad(path, name, f"its initializer {str(spec)[:120]} has a field that is not a number")
    try:
        opt = _optim.from_spec(record.get("optimizer"))
    except (InvalidArgument, TypeError) as exc:
        raise _bad(path, name, f"its optimizer is not one this version knows: {exc}") from None
    if record.get("table") and isinstance(opt, _optim.SyncReplicas):
        raise _bad(path, name, "a table with a SyncReplicas optimizer (tables take asynchronous updates)")


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _piece(path: str, name: str, pieces: dict[tuple[str, int], Piece], i: int) -> Piece:
    try:
        return pieces[(name, i)]
    except KeyError:
        raise _bad(path, name, f"no shard file holds its part {i}") from None


def _tensor(piece: Piece, field: str) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, shape) of a field of a piece, from its file's header; None when it has none."""
    entry, f = piece
    tensor = entry_tensor(f, entry, field)
    if tensor not in f:
        return None
    return f.dtype(tensor), tuple(f.shape(tensor))


def _expect(path: str, name: str, i: int, field: str, got: tuple[str, tuple[int, ...]] | None,
            dtype: str | None, shape: tuple[int, ...] | None, *, required: bool = False) -> None:
    """``field`` of part ``i`` is ``dtype`` (None: any integer dtype) and ``shape`` (None: any)."""
    if got is None:
        if required:
            raise _bad(path, name, f"part {i} has no {field} in its file")
        return
    ok = got[0] == dtype if dtype is not None else got[0].startswith(("int", "uint"))
    if not ok or (shape is not None and got[1] != shape):
        want = f"{dtype or 'integers'} {list(shape) if shape is not None else ''}".strip()
        raise _bad(path, name, f"part {i}'s {field} is {got[0]} {list(got[1])} in its file, expected {want}")


def _check_part_piece(path: str, record: dict[str, Any], i: int, piece: Piece, rows: int) -> None:
    name, shape, dtype = record["name"], record["shape"], record["dtype"]
    part_shape = (rows, *shape[1:]) if shape else ()
    entry = piece[0]
    saved_rows = entry.get("rows")
    if saved_rows is not None and (not isinstance(saved_rows, list) or len(saved_rows) != 2
                                   or not all(_count(r) for r in saved_rows) or saved_rows[1] - saved_rows[0] != rows):
        raise _bad(path, name, f"part {i} holds rows {saved_rows}, expected {rows} row(s)")
    _expect(path, name, i, "value", _tensor(piece, "value"), dtype, part_shape, required=True)
    for field in fields(piece):
        if field.startswith("slot."):
            got = _tensor(piece, field)
            _expect(path, name, i, field, got, _slot_dtype(dtype, got), part_shape)
    steps = (max(rows, 1),) if shape else (1,)
    _expect(path, name, i, "steps", _tensor(piece, "steps"), "int64", steps)
    sync = _tensor(piece, "sync_step")
    if sync is not None and sync[1] not in ((), (1,)):
        raise _bad(path, name, f"part {i}'s sync_step has shape {list(sync[1])}, expected one number")
    _expect(path, name, i, "sync_step", sync, None, None)


def _slot_dtype(dtype: str, got: tuple[str, tuple[int, ...]] | None) -> str:
    """The dtype a slot of a variable of ``dtype`` may have in a file: its slots' dtype
    (``optim.slot_dtype``: float32 for half precision), or the variable's own (files written when
    half-precision slots were kept in it; the shards widen them). The file's when it is one of
    them, else the slots' dtype, named in the refusal."""
    if got is not None and got[0] in (dtype, dtype_name(_optim.slot_dtype(dtype_from_name(dtype)))):
        return got[0]
    return dtype_name(_optim.slot_dtype(dtype_from_name(dtype)))


def _check_table_piece(path: str, record: dict[str, Any], i: int, piece: Piece) -> None:
    name, dtype, dim = record["name"], record["dtype"], record["table"]["dim"]
    ids = _tensor(piece, "ids")
    if ids is None or len(ids[1]) != 1:
        raise _bad(path, name, f"part {i} has no list of ids in its file")
    _expect(path, name, i, "ids", ids, None, None)
    n = ids[1][0]
    _expect(path, name, i, "values", _tensor(piece, "value"), dtype, (n, dim), required=True)
    for field in fields(piece):
        if field.startswith("slot."):
            got = _tensor(piece, field)
            _expect(path, name, i, field, got, _slot_dtype(dtype, got), (n, dim))
    for field in ("steps", "changed"):
        _expect(path, name, i, field, _tensor(piece, field), None, (n,))
    pending = [_tensor(piece, f) for f in ("pending_ids", "pending_counts")]
    if (pending[0] is None) != (pending[1] is None) or (pending[0] is not None and len(pending[0][1]) != 1):
        raise _bad(path, name, f"part {i} has no list of pending ids with one sighting count each")
    if pending[0] is not None:
        _expect(path, name, i, "pending_ids", pending[0], None, None)
        _expect(path, name, i, "pending_counts", pending[1], None, pending[0][1])
    if not _count(piece[0].get("clock", 0)):
        raise _bad(path, name, f"part {i}'s clock {piece[0].get('clock')!r} is not a step")


def _check_slots(path: str, record: dict[str, Any], saved: list[Piece], optimizer: Any, whose: str) -> None:
    """The optimizer slots the checkpoint holds for ``record`` are slots ``optimizer`` has."""
    name = record["name"]
    try:
        opt = _optim.from_spec(optimizer)
    except InvalidArgument as exc:
        raise _bad(path, name, f"{whose} is not one this version knows: {exc}") from None
    if isinstance(opt, _optim.SyncReplicas):
        opt = opt.optimizer
    has = set(opt.slot_names) if opt is not None else set()
    held = {k[len("slot."):] for piece in saved for k in fields(piece) if k.startswith("slot.")}
    if held - has:
        raise _bad(path, name, f"the checkpoint holds optimizer slots {sorted(held - has)}, which {whose} "
                               f"({type(opt).__name__ if opt is not None else 'none'}) does not have")
