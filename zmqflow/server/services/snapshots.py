"""Checkpoint ops of the ps service: write this shard's state to a file, put state back."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ...errors import InvalidArgument
from ...observe.metrics import Histogram
from ..checkpoint_roots import CheckpointRoots
from ...state.tables import HashTable
from ...state.snapshot import part_arrays, table_arrays, write_atomic
from ...state.store import PartKey, ShardStore
from ...rpc import CallContext, op
from ...wire.requests import ps as rq

__all__ = ["SnapshotOps"]


class SnapshotOps:
    """Mixed into the ps service, which provides ``store``, ``tables`` and ``checkpoint_roots``."""

    store: ShardStore
    tables: dict[PartKey, HashTable]
    checkpoint_roots: CheckpointRoots
    save_seconds: Histogram

    @op(rq.Save)
    def save(self, ctx: CallContext, req: rq.Save) -> dict[str, Any]:
        """Write every part and table of this shard to ``directory/file``, atomically. Runs on the
        loop without yielding, so the file is one consistent moment of this shard. The directory
        must resolve inside the task's checkpoint roots (else ``PermissionDenied``, nothing
        created); everything after uses the resolved path, not the caller's string."""
        file = req.file
        started = time.perf_counter()
        if os.sep in file or (os.altsep and os.altsep in file) or "\0" in file or file.startswith("."):
            raise InvalidArgument(f"checkpoint file name {file!r} must be a plain name")
        directory = self.checkpoint_roots.confine(req.directory)
        os.makedirs(directory, exist_ok=True)
        arrays: dict[str, np.ndarray] = {}
        entries = []
        for i, ((name, part), p) in enumerate(sorted(self.store.parts.items())):
            key = f"p{i}"
            arrays.update(part_arrays(p, key))
            entries.append({"kind": "part", "name": name, "part": part, "key": key, "rows": list(p.rows)})
        for j, ((name, part), t) in enumerate(sorted(self.tables.items())):
            key = f"t{j}"
            arrays.update(table_arrays(t, key))
            entries.append({"kind": "table", "name": name, "part": part, "key": key, "rows": len(t)})
        write_atomic(os.path.join(directory, file), arrays)
        self.save_seconds.observe(time.perf_counter() - started)
        return {"file": file, "entries": entries}

    @op(rq.RestorePart)
    def restore_part(self, ctx: CallContext, req: rq.RestorePart) -> bool:
        """Put a part's value, optimizer slots, step counts and sync step back (all checked first)."""
        value, steps, sync_step = req.value, req.steps, req.sync_step
        p = self.store.get(req.name, req.part)
        _same(value, p.value, f"{p.label} value")
        slots = req.slots or {}
        for k, v in slots.items():
            if k not in p.slots:
                raise InvalidArgument(f"{p.label} has no optimizer slot {k!r} (slots: {', '.join(p.slots) or 'none'})")
            _same(v, p.slots[k], f"{p.label} slot {k!r}")
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
        table = self.tables.get((req.name, req.part))
        if table is None:
            raise InvalidArgument(f"embedding {req.name!r} part {req.part} is not a dynamic table on this shard")
        return table.load(req.ids.astype(np.int64, copy=False), req.values, req.slots or {}, req.steps)


def _same(x: Any, like: np.ndarray, what: str) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != like.dtype or x.shape != like.shape:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise InvalidArgument(f"{what}: expected {like.dtype} {list(like.shape)}, got {got}")
