"""Checkpoint ops of the ps service: write this shard's state to a file, put state back, write
an embedding delta. Every file goes where the task's checkpoint roots allow, nowhere else."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidArgument
from ...observe.metrics import Histogram
from ..checkpoint_roots import CheckpointRoots
from ...state.optim import restorable_slot
from ...state.tables import HashTable
from ...state.snapshot import (FILE_FORMAT, check_file_name, part_arrays, part_prefix, table_arrays,
                               table_prefix, write_atomic)
from ...state.store import PartKey, ShardStore
from ...state.tensorfile import Chunked
from ...rpc import CallContext, op
from ...wire.requests import ps as rq

__all__ = ["SnapshotOps"]


class SnapshotOps:
    """Mixed into the ps service, which provides ``store``, ``tables`` and ``checkpoint_roots``."""

    store: ShardStore
    tables: dict[PartKey, HashTable]
    checkpoint_roots: CheckpointRoots
    save_seconds: Histogram
    _room: Callable[[], int]  # the ps service's (TableOps): bytes its budget has left for table rows

    @op(rq.Save)
    def save(self, ctx: CallContext, req: rq.Save) -> dict[str, Any]:
        """Write every part and table of this shard to ``directory/file``, atomically. Runs on the
        loop without yielding, so the file is one consistent moment of this shard. The directory
        must resolve inside the task's checkpoint roots (else ``PermissionDenied``, nothing
        created); the file is written through a descriptor of that directory, reached from its
        root without following a link, never through the caller's string or a path again."""
        started = time.perf_counter()
        file, directory, dir_fd = self._target(req.file, req.directory)
        try:
            return self._save(file, directory, dir_fd, started)
        finally:
            os.close(dir_fd)

    def _save(self, file: str, directory: str, dir_fd: int, started: float) -> dict[str, Any]:
        arrays: dict[str, np.ndarray | Chunked] = {}
        entries = []
        for (name, part), p in sorted(self.store.parts.items()):
            key = part_prefix(p, name, part)
            arrays.update(part_arrays(p, key))
            entries.append({"kind": "part", "name": name, "part": part, "key": key, "rows": list(p.rows),
                            "shape": list(p.full_shape), "dtype": p.dtype.name, "slots": list(p.slots)})
        for (name, part), t in sorted(self.tables.items()):
            key = table_prefix(name, part)
            arrays.update(table_arrays(t, key))
            entries.append({"kind": "table", "name": name, "part": part, "key": key, "rows": len(t),
                            "dim": t.dim, "dtype": t.dtype.name, "clock": t.step, "slots": list(t.slots)})
        write_atomic(os.path.join(directory, file), arrays, dir_fd=dir_fd,
                     metadata={"format": FILE_FORMAT, "entries": json.dumps(entries)})
        self.save_seconds.observe(time.perf_counter() - started)
        return {"file": file, "entries": entries}

    def _target(self, file: str, directory: str) -> tuple[str, str, int]:
        """(file, the confined real directory, created, a descriptor of it for the caller to
        close): the file a plain name, the directory inside the checkpoint roots (else
        ``PermissionDenied``, nothing created)."""
        if os.sep in file or (os.altsep and os.altsep in file) or "\0" in file or file.startswith("."):
            raise InvalidArgument(f"checkpoint file name {file!r} must be a plain name")
        check_file_name(file)
        real, fd = self.checkpoint_roots.open_dir(directory)
        return file, real, fd

    @op(rq.EmbExportDelta)
    def emb_export_delta(self, ctx: CallContext, req: rq.EmbExportDelta) -> dict[str, Any]:
        """Write the rows of a dynamic table part changed at steps >= ``since`` and the ids it
        dropped since (``ids``, ``values``, ``dropped``), atomically, where the checkpoint roots
        allow. Runs on the loop without yielding: one consistent moment of the part."""
        table = self.tables.get((req.name, req.part))
        if table is None:
            raise InvalidArgument(f"embedding {req.name!r} part {req.part} is not a dynamic table on this shard: "
                                  f"only dynamic tables track changed rows")
        delta = table.delta(req.since)  # refused (too old) before anything is created
        file, directory, dir_fd = self._target(req.file, req.directory)
        info = {"kind": "delta", "name": req.name, "part": req.part, "since": req.since, "step": delta["step"],
                "rows": len(delta["ids"]), "dropped": len(delta["dropped"]), "dim": table.dim, "dtype": table.dtype.name}
        try:
            write_atomic(os.path.join(directory, file), {k: delta[k] for k in ("ids", "values", "dropped")},
                         metadata={"format": "zmqflow-delta/1", "delta": json.dumps(info)}, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        return {"file": file, **info}

    @op(rq.RestorePart)
    def restore_part(self, ctx: CallContext, req: rq.RestorePart) -> bool:
        """Put a part's value, optimizer slots, step counts and sync step back (all checked first).
        A half-precision part's slots are float32; a checkpoint written when they were kept in the
        part's own dtype restores too, its slots widened to float32 here (exactly)."""
        value, steps, sync_step = req.value, req.steps, req.sync_step
        p = self.store.get(req.name, req.part)
        _same(value, p.value, f"{p.label} value")
        slots = req.slots or {}
        for k, v in slots.items():
            if k not in p.slots:
                raise InvalidArgument(f"{p.label} has no optimizer slot {k!r} (slots: {', '.join(p.slots) or 'none'})")
            _same(v, p.slots[k], f"{p.label} slot {k!r}", saved_in=p.dtype)
        if steps is not None and p.steps is not None:
            _same(steps, p.steps, f"{p.label} steps")
        p.own()
        p.value[...] = value
        for k, v in slots.items():
            p.slots[k][...] = v
        if steps is not None and p.steps is not None:
            p.steps[...] = steps
        if sync_step is not None and p.sync is not None:
            p.sync.discard()  # drop what was pending for the old step
            p.sync.step = sync_step
        return True

    @op(rq.EmbRestore)
    def emb_restore(self, ctx: CallContext, req: rq.EmbRestore) -> int:
        """Put saved rows and pending sightings into a hash table part; returns the rows it took.
        With ``replace`` the part is made afresh first, as a new declaration makes it: rows and
        sightings it held before the restore do not survive it."""
        key = (req.name, req.part)
        table = self.tables.get(key)
        if table is None:
            raise InvalidArgument(f"embedding {req.name!r} part {req.part} is not a dynamic table on this shard")
        what = f"embedding {req.name!r} part {req.part}"
        changed = req.changed
        if changed is not None and len(changed) != len(req.ids):
            raise InvalidArgument(f"{what}: {len(changed)} change steps for {len(req.ids)} ids")
        pending = _pending(what, req.pending_ids, req.pending_counts)
        if req.replace:  # made afresh, kept once the rows are known to fit it (load checks them first)
            table = _fresh(table, req.part, self._room)
        taken = table.load(req.ids.astype(np.int64, copy=False), req.values, req.slots or {}, req.steps,
                           changed=changed, clock=req.clock)
        self.tables[key] = table
        if pending is not None:
            _add_pending(table, *pending)
        return taken


def _fresh(table: HashTable, part: int, room: Callable[[], int]) -> HashTable:
    """An empty part of the same table, as its declaration made it (its capacity already the one
    the shard's limits allowed)."""
    return HashTable(table.dim, table.dtype, initializer=table.init, optimizer=table.optimizer,
                     min_frequency=table.min_frequency, capacity=table.capacity, seed_salt=part + 1,
                     max_pending=table.max_pending, room=room)


def _pending(what: str, ids: np.ndarray | None, counts: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Saved ids pending admission and their sightings, checked: as many counts as ids, none
    negative, no id twice."""
    if ids is None and counts is None:
        return None
    if ids is None or counts is None or len(ids) != len(counts):
        raise InvalidArgument(f"{what}: pending ids and their sighting counts must come together, one count an id")
    ids, counts = ids.astype(np.int64, copy=False), counts.astype(np.int64, copy=False)
    if len(counts) and counts.min() < 0:
        raise InvalidArgument(f"{what}: a pending id's sighting count is negative")
    if len(np.unique(ids)) != len(ids):
        raise InvalidArgument(f"{what}: a pending id is listed twice")
    return ids, counts


def _add_pending(table: HashTable, ids: np.ndarray, counts: np.ndarray) -> None:
    """Add saved sightings of ids not admitted to ``table``'s (short of admission: an id reaches
    its ``min_frequency`` by a sighting, as it would have in the run that saved it)."""
    if table.min_frequency <= 1:
        return
    keep = (counts > 0) & (table.index.find(ids, table.ids) < 0)  # an id with a row is admitted already
    table.sightings.add(ids[keep], counts[keep], table.min_frequency - 1)
    table.pending_pruned += table.sightings.bound(table.max_pending)


def _same(x: Any, like: np.ndarray, what: str, saved_in: np.dtype | None = None) -> None:
    """``x`` has ``like``'s dtype and shape; with ``saved_in`` (an optimizer slot's variable
    dtype), any dtype a slot of such a variable restores from (``optim.restorable_slot``)."""
    if isinstance(x, np.ndarray) and saved_in is not None:
        dtype_ok = restorable_slot(saved_in, x.dtype)
    else:
        dtype_ok = isinstance(x, np.ndarray) and x.dtype == like.dtype
    if not dtype_ok or x.shape != like.shape:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise InvalidArgument(f"{what}: expected {like.dtype} {list(like.shape)}, got {got}")
