"""Sharded, atomic checkpoints of everything on the ps shards.

``save`` asks every shard to write its own file (variables, optimizer slots, per-row step counts,
sync steps, dynamic-table rows), then writes a JSON manifest last: the manifest is the commit
marker, so a checkpoint exists only once every shard file it names is complete, and only when
they hold every part the catalog records (a shard that restarted empty fails the save, which then
commits and prunes nothing). Each file goes to a temporary name, is fsynced and renamed; a crash
at any moment leaves the previous checkpoint intact. Shard files are safetensors
(:mod:`zmqflow.state.snapshot`): nothing is pickled, and any safetensors reader opens them.

Checkpoints stand in the order they were saved (:mod:`.checkpoint_files`): the latest is the last
saved, whatever its step, and ``keep`` keeps the last saved, as TF's ``CheckpointManager`` does.

``restore`` opens the files (the checkpoint directory is shared, as TF's is) and checks every
record against them and against what the cluster holds (:mod:`.checkpoint_check`) before it
changes anything; then it puts every variable and table back on the shards of the current
cluster, which may have a different number of ps tasks: parts keep their row ranges and are placed
anew; dynamic-table rows are re-hashed. Data is read through the files' memory mappings a part at
a time, so a restore does not hold a second copy of the whole checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import checkpoint_files as ckfiles
from .checkpoint_check import check_capacity, check_files, check_live, check_saved, declared_rows, is_hash
from .checkpoint_files import FORMAT, Saved, checkpoints, field, latest, manifest_name, next_seq
from .embedding import create_table_parts
from ..state.owners import hash_owner
from ..errors import DeadlineExceeded, NotFound, Recovering, ResourceExhausted, ShardStateLost, Unavailable
from ..observe.metrics import record_checkpoint
from ..observe import timeline
from ..state.partition import fixed_size_partitioner
from ..state.dirfd import is_file, opened_dir
from ..state.snapshot import (FILE_FORMAT, TEMP_SUFFIX, abandoned_temporary, crash_point, fsync_dir, open_shard_file,
                              part_prefix, write_atomic)
from ..state.store import part_label
from ..cluster import TaskId, catalog_task, holder_tasks, shard_tasks
from .placement import device
from .variables import create_parts
from .window import Window
from ..wire.dtypes import dtype_from_name
from ..wire.requests import cluster as crq
from ..wire.requests import ps as rq

if TYPE_CHECKING:
    from .blocking import Session
    from .session import AsyncSession

__all__ = ["save", "restore", "recover", "fenced", "manifest_name", "async_fenced", "latest", "checkpoints", "async_save", "async_restore", "async_recover",
           "save_store", "restore_store"]

# What a save writes before its manifest (shard files, temporaries): the step is in the name, and
# in a shard file's the time (ms) its save began.
_WRITTEN = re.compile(r"^(?:step(\d{10})-(?:(?P<ms>\d+)-)?.*\.(?:safetensors|npz)|checkpoint-(\d{10})\.json)"
                      r"(?P<tmp>" + TEMP_SUFFIX + ")?$")
_MANIFEST = ckfiles.MANIFEST

log = logging.getLogger("zmqflow.checkpoint")
# a restore puts back this many variables at once, holding at most this many bytes of their values
# (one alone may hold more): a model of many small ones pays a few round trips in all, not each
RESTORE_WINDOW = 16
RESTORE_BYTES = 256 << 20
SAVE_TIMEOUT = ckfiles.LOCK_WAIT  # what a save may take, waiting for another writer's lock on the directory included


def _file_tag(step: int) -> str:
    """The start of every file one save writes: its step (what pruning reads), the time, and a
    token of its own, so two writers saving one step at once (a chief handing over, in another
    process or on another host) never write, or name in their manifests, the same file."""
    return f"step{step:010d}-{int(time.time() * 1000)}-{secrets.token_hex(4)}"


@timeline.traced("checkpoint", "save")
async def async_save(sess: "AsyncSession", directory: str, *, step: int | None = None, keep: int = 5,
                     timeout: float = SAVE_TIMEOUT) -> str:
    """The shards write first, each where its checkpoint roots allow (a refused directory is
    ``PermissionDenied`` and nothing is created); then the manifest, then pruning, off the loop:
    the directory's lock may be held by another writer, for at most ``timeout`` from the start."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    spec = await sess.cluster()
    if step is None:
        step = await _global_step(sess)
    records = await sess.call_catalog("records", crq.Records())
    tag = _file_tag(step)
    tasks = holder_tasks(spec, records)  # the ps tasks and any other task a variable is pinned to
    shards = await asyncio.gather(*(
        sess.call_task(t, "ps", "save", rq.Save(directory=os.path.abspath(directory), file=f"{tag}-{t.job}{t.index}.safetensors"))
        for t in tasks
    ))
    for task, shard in zip(tasks, shards):
        shard["task"] = str(task)
    crash_point("before-manifest")
    os.makedirs(directory, exist_ok=True)  # the shards made it, unless they write on other hosts
    manifest = {"format": FORMAT, "step": int(step), "time": time.time(), "records": records, "shards": shards}
    # in a thread of its own, which opens (and closes) the directory itself: a save cancelled
    # while it waits for the lock never leaves it a descriptor closed under it
    path = await asyncio.to_thread(_finish, str(catalog_task(spec)), directory, manifest, keep, deadline)
    record_checkpoint("save", time.perf_counter() - started)
    return path


def _finish(catalog: str, directory: str, manifest: dict[str, Any], keep: int, deadline: float) -> str:
    """Commit what the shards wrote, once it is known to restore (``check_saved``); a save
    refused here removes the files it wrote: nothing of it stays, nothing is pruned."""
    with opened_dir(directory) as fd:
        try:
            check_saved(catalog, directory, manifest)
            return _commit(directory, fd, manifest, keep, deadline)
        except (ShardStateLost, DeadlineExceeded):
            for shard in manifest["shards"]:
                if ckfiles.plain_name(shard.get("file")):
                    _remove(fd, shard["file"])
            raise


def _commit(directory: str, fd: int, manifest: dict[str, Any], keep: int, deadline: float | None = None) -> str:
    """Write the manifest (``seq``: after every save in the directory), then prune; both through
    ``fd``, a descriptor of the directory, so both act on the directory the manifest went into.
    Under an exclusive lock on the directory: two writers (a chief handing over beside its
    successor) would otherwise read the same newest ``seq``, and the later commit of a step could
    carry a lower one than an earlier step's, which would then stand as the latest."""
    path = os.path.join(directory, manifest_name(int(manifest["step"])))
    with ckfiles.locked(fd, directory, deadline):
        gone = [sh["file"] for sh in manifest["shards"] if not is_file(fd, sh["file"])]
        if gone:  # a manifest is committed whole or not at all
            raise Unavailable(f"checkpoint of step {manifest['step']}: {gone[0]!r} was removed by another writer "
                              f"saving into {directory!r} at the same time (a save begun later pruned it); "
                              "nothing was committed: save again")
        manifest["seq"] = next_seq(ckfiles.saved(directory, fd))
        write_atomic(path, text=json.dumps(manifest, indent=1), dir_fd=fd)
        _prune(directory, fd, keep)
    return path


def _prune(directory: str, fd: int, keep: int) -> None:
    """Keep the last ``keep`` checkpoints saved: remove a manifest first, then its files. Files no
    manifest names, from saves begun before the last saved checkpoint's, are what a save that
    crashed before its manifest left behind: they go too. Another process pruning the same
    directory at the same time (a chief handing over) may remove a file first; not an error."""
    found = ckfiles.saved(directory, fd)
    kept = found[-keep:] if keep > 0 else found
    needed = {f for s in kept for f in s.files}
    for s in found[:-keep] if keep > 0 else []:
        _remove(fd, os.path.basename(s.path))
        for f in s.files - needed:
            _remove(fd, f)
    _remove_unfinished(fd, kept)
    fsync_dir(fd)


def _remove(fd: int, name: str) -> None:
    try:
        os.remove(name, dir_fd=fd)
    except FileNotFoundError:
        pass


def _remove_unfinished(fd: int, kept: list[Saved]) -> None:
    if not kept:
        return
    newest = _began(kept[-1])
    named = {os.path.basename(s.path) for s in kept} | {f for s in kept for f in s.files}
    for name in os.listdir(fd):
        m = _WRITTEN.match(name)
        # begun before the last saved checkpoint's save: a save in progress now began later, or is
        # a writer beside this one (a chief handing over): its temporaries stay while it lives
        if not m or name in named or not _older(m, newest):
            continue
        if m["tmp"] is None or abandoned_temporary(name, fd):
            _remove(fd, name)


def _began(newest: Saved) -> tuple[int, int | None]:
    """(step, the time in ms its save began, when its files' names say) of a checkpoint."""
    step = int(_MANIFEST.match(os.path.basename(newest.path)).group(1))  # type: ignore[union-attr]
    times = [int(m["ms"]) for m in map(_WRITTEN.match, newest.files) if m is not None and m["ms"] is not None]
    return step, min(times) if times else None


def _older(m: re.Match[str], newest: tuple[int, int | None]) -> bool:
    """Whether what ``m`` names was written by a save begun before ``newest``'s: by the times in
    the names where both have one (saves are ordered by when they were made, not by step), else
    by step."""
    if m["ms"] is not None and newest[1] is not None:
        return int(m["ms"]) < newest[1]
    return int(m.group(1) or m.group(3)) < newest[0]


async def _global_step(sess: "AsyncSession") -> int:
    step = await sess.global_step()
    if step:
        return step
    try:
        return int(await (await sess.get("global_step", timeout=0)).read())
    except NotFound:
        return 0


Shard = ckfiles.Piece
Loaded = tuple[str, dict[str, Any], dict[tuple[str, int], Shard]]


def _load(path: str) -> Loaded:
    """(the manifest's path, the manifest, {(name, part): (entry, its open file)}), every file's
    header and every record checked against them before anything changes (a truncated or
    foreign file, a part missing, a dtype or shape that disagrees, is refused here, naming it)."""
    chosen, manifest, shards = ckfiles.read(path, open_shard_file)
    pieces = ckfiles.pieces(shards)
    check_files(chosen, manifest, pieces)
    return chosen, manifest, pieces


@timeline.traced("checkpoint", "restore")
async def async_restore(sess: "AsyncSession", path: str) -> int:
    """Put the checkpoint at ``path`` (a manifest, or a directory: its last saved) back; returns its
    step. Everything that can be checked is, before anything changes: every file and record
    (:func:`_load`), then every record against what the cluster holds under its name; a bad
    checkpoint is refused, naming what is at fault, and the cluster is as it was. Then the records
    go back, several at a time, each over several shards: this part is not atomic. A shard that
    dies meanwhile, or the catalog or a shard refusing for its own limits (a memory budget), leaves
    the records before restored and the rest not: restore again, or ``recover``."""
    started = time.perf_counter()
    loaded = _load(path)
    await _check(sess, loaded, await sess.call_catalog("records", crq.Records(pending=True)))
    step = await _put_back(sess, loaded[1], loaded[2])
    record_checkpoint("restore", time.perf_counter() - started)
    return step


async def _check(sess: "AsyncSession", loaded: Loaded, live: list[dict[str, Any]]) -> None:
    """Refuse a checkpoint the cluster cannot take as it is (``live``: the catalog's records)."""
    chosen, manifest, pieces = loaded
    shards = len(shard_tasks(await sess.cluster()))
    check_live(chosen, manifest["records"], pieces, live, shards)
    check_capacity(chosen, manifest["records"], pieces, live, shards)


async def _put_back(sess: "AsyncSession", manifest: dict[str, Any], pieces: dict) -> int:
    """Put every record back (all checked already): variables and static tables several at a
    time (``RESTORE_WINDOW``, at most ``RESTORE_BYTES`` of their values), a hash table alone (its
    rows are re-hashed in memory, a saved part at a time)."""
    spec = await sess.cluster()
    window = Window(RESTORE_WINDOW, RESTORE_BYTES)
    for record in manifest["records"]:
        if is_hash(record):
            await window.drain()
            await _restore_table(sess, spec, record, pieces)
        else:
            nbytes = math.prod(record["shape"]) * dtype_from_name(record["dtype"]).itemsize  # its pieces unread
            await window.add(_restore_variable(sess, spec, record, pieces), nbytes)
    await window.drain()
    sess.step = int(manifest["step"])
    return int(manifest["step"])


@timeline.traced("checkpoint", "recover")
async def async_recover(sess: "AsyncSession", path: str) -> int:
    """Restore onto a running cluster whose shards hold newer or partial state (a shard died and
    came back empty). The checkpoint is read and checked first, against the catalog too; then
    every shard is fenced, so no worker reads or pushes a half-restored state; every part the
    checkpoint holds is dropped and made afresh (a hash table's rows added since would otherwise
    survive the restore), as is every part the catalog does not place on a shard (left over when
    the catalog itself was lost); then the checkpoint is restored and the fences lifted. On
    failure the shards stay fenced: the caller recovers again, and nobody trains on mixed state
    meanwhile."""
    started = time.perf_counter()
    loaded = _load(path)
    _, manifest, pieces = loaded
    spec = await sess.cluster()
    # every task the catalog or the checkpoint places a part on (a variable pinned to a worker)
    before = await sess.call_catalog("records", crq.Records(pending=True))
    await _check(sess, loaded, before)
    tasks = holder_tasks(spec, [*before, *_placeable(spec, manifest["records"])])
    epochs = await asyncio.gather(*(sess.call_task(t, "ps", "fence", rq.Empty()) for t in tasks))
    records = await sess.call_catalog("records", crq.Records(pending=True))
    restored = {r["name"] for r in manifest["records"]}
    kept = [r for r in records if r["name"] not in restored]
    swept = await asyncio.gather(*(sess.call_task(t, "ps", "sweep", _sweep(kept, str(t))) for t in tasks))
    stale = sorted({part_label((name, part)) for dropped in swept for name, part in dropped if name not in restored})
    if stale:
        log.warning("dropped %d part(s) no longer in the catalog: %s", len(stale), ", ".join(stale))
    step = await _put_back(sess, manifest, pieces)
    lifted = await asyncio.gather(*(sess.call_task(t, "ps", "unfence", rq.Unfence(epoch=e)) for t, e in zip(tasks, epochs)))
    if not all(lifted):
        late = [str(t) for t, ok in zip(tasks, lifted) if not ok]
        raise Recovering(f"another recovery fenced {', '.join(late)} while this one restored step {step}", tasks=late)
    missing = await _missing_parts(sess, tasks, kept)
    if missing:
        log.warning("not in checkpoint %s and lost with a shard (created since): %s", path, ", ".join(missing))
    record_checkpoint("restore", time.perf_counter() - started)
    return step


async def async_fenced(sess: "AsyncSession") -> list[str]:
    """The shards a recovery has fenced (and not lifted yet)."""
    tasks = holder_tasks(await sess.cluster(), await sess.call_catalog("records", crq.Records(pending=True)))
    states = await asyncio.gather(*(sess.call_task(t, "ps", "status", rq.Empty()) for t in tasks))
    return [str(t) for t, st in zip(tasks, states) if st.get("fenced")]


async def _missing_parts(sess: "AsyncSession", tasks: list[Any], records: list[dict[str, Any]]) -> list[str]:
    held = await asyncio.gather(*(sess.call_task(t, "ps", "variables", rq.Empty()) for t in tasks))
    have = {(str(t), v["name"], v["part"]) for t, vs in zip(tasks, held) for v in vs}
    return [f"{r['name']} part {i} on {p['task']}" for r in records for i, p in enumerate(r["parts"])
            if not is_hash(r) and (p["task"], r["name"], i) not in have]


def _placeable(spec: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A checkpoint's records whose every part names a task of ``spec`` (a checkpoint taken on
    another cluster places its parts anew)."""
    return [r for r in records if all(p["task"] in spec for p in r["parts"])]


def _placed(records: list[dict[str, Any]], task: str) -> list[list[Any]]:
    return [[r["name"], i] for r in records for i, part in enumerate(r["parts"]) if part["task"] == task]


def _sweep(records: list[dict[str, Any]], task: str) -> rq.Sweep:
    return rq.Sweep(keep=[rq.Pair(name, i) for name, i in _placed(records, task)])


def _slots(piece: Shard) -> dict[str, np.ndarray]:
    return {k[len("slot."):]: field(piece, k) for k in ckfiles.fields(piece) if k.startswith("slot.")}


def _pinned(spec: Any, record: dict[str, Any]) -> str | None:
    """The task every part of ``record`` was on, when it is a task of ``spec`` that default
    placement would not choose (a variable pinned with ``zf.device`` to a worker); else None."""
    where = {p["task"] for p in record["parts"]}
    if len(where) != 1:
        return None
    task = next(iter(where))
    return task if task in spec and TaskId.parse(task) not in shard_tasks(spec) else None


def _assemble(record: dict[str, Any], pieces: dict) -> np.ndarray:
    arrays = [field(pieces[(record["name"], i)], "value") for i in range(len(record["parts"]))]
    return arrays[0] if not record["shape"] else np.concatenate(arrays)  # type: ignore[arg-type]


async def _restore_variable(sess: "AsyncSession", spec: Any, record: dict[str, Any], pieces: dict) -> None:
    name = record["name"]
    value = _assemble(record, pieces)
    # Parts are (re)created wherever the catalog places them: a shard that restarted empty gets
    # its parts back; parts that survived are kept and then overwritten below. A variable pinned
    # to a task outside the default shards goes back there when the catalog has to place it anew.
    with device(_pinned(spec, record)):
        tasks = await _declare_again(sess, record, value)
    calls = []
    start = 0
    for i, (task, (r0, r1)) in enumerate(zip(tasks, declared_rows(record, 0))):
        piece = pieces[(name, i)]
        # a part's value is a view of the assembled one: no second copy of the variable
        part_value = value[start: start + r1 - r0] if record["shape"] else value
        start += r1 - r0
        sync = field(piece, "sync_step")
        body = rq.RestorePart(name=name, part=i, value=np.require(part_value, requirements="C"), slots=_slots(piece),
                              steps=field(piece, "steps"), sync_step=None if sync is None else int(sync.reshape(-1)[0]))
        calls.append(sess.call_task(task, "ps", "restore_part", body))
    await asyncio.gather(*calls)


async def _declare_again(sess: "AsyncSession", record: dict[str, Any], value: np.ndarray) -> list[Any]:
    """Get-or-create the variable (or static table) of ``record`` and its parts; their tasks."""
    name = record["name"]
    table = record.get("table")
    if table:  # a static embedding table: parts are row sets by strategy, one per part
        emb = await sess.embedding(name, table["num_embeddings"], table["dim"], partitions=len(record["parts"]),
                                   partition_strategy=table["strategy"], dtype=record["dtype"],
                                   initializer=record.get("initializer"), optimizer=record.get("optimizer"))
        await create_table_parts(sess, emb.info, record)
        return list(emb.info.tasks)
    var = await sess.variable(name, value, optimizer=record.get("optimizer"),
                              partitioner=fixed_size_partitioner(len(record["parts"])) if record["shape"] else None)
    await create_parts(sess, var.info, value)
    return [t for t, _, _ in var.info.parts]


async def _restore_table(sess: "AsyncSession", spec: Any, record: dict[str, Any], pieces: dict) -> None:
    t = record["table"]
    saved = [pieces[(record["name"], i)] for i in range(len(record["parts"]))]
    with device(_pinned(spec, record)):
        emb = await sess.embedding(record["name"], None, t["dim"], dtype=record["dtype"],
                                   initializer=record.get("initializer"), optimizer=record.get("optimizer"),
                                   min_frequency=t["min_frequency"], capacity=t["capacity"])
    await create_table_parts(sess, emb.info, record)
    clock = max(int(entry.get("clock", 0)) for entry, _ in saved)
    for n, piece in enumerate(saved):  # one saved part in memory at a time, its rows re-hashed over today's parts
        ids = field(piece, "ids")
        values, steps, changed = field(piece, "value"), field(piece, "steps"), field(piece, "changed")
        slots = _slots(piece)
        owner = hash_owner(ids, emb.info.parts)
        pending, counts = field(piece, "pending_ids"), field(piece, "pending_counts")
        waiting = None if pending is None or counts is None else hash_owner(pending, emb.info.parts)
        calls = []
        for p, task in enumerate(emb.info.tasks):
            m = owner == p
            w = None if waiting is None else waiting == p
            # the first call to each part replaces what it held: it ends with the checkpoint's rows alone
            calls.append(sess.call_task(task, "ps", "emb_restore", rq.EmbRestore(
                name=record["name"], part=p, ids=ids[m], values=values[m], slots={k: v[m] for k, v in slots.items()},
                steps=None if steps is None else steps[m], changed=None if changed is None else changed[m],
                clock=clock, replace=n == 0, pending_ids=None if w is None else pending[w],
                pending_counts=None if w is None else counts[w],
            )))
        taken = await asyncio.gather(*calls)
        sent = np.bincount(owner, minlength=emb.info.parts)
        for p, (task, got) in enumerate(zip(emb.info.tasks, taken)):
            if got != sent[p]:
                raise ResourceExhausted(
                    f"restoring table {record['name']!r}: its part {p} on {task} took {got} of {int(sent[p])} rows "
                    f"(its capacity of {t['capacity'] or 'the shard limits allow'} rows a part, or the shard's memory "
                    "budget, is full): the table is incomplete; restore onto more shards",
                    name=record["name"], part=p, task=str(task))


def save(sess: "Session", directory: str, *, step: int | None = None, keep: int = 5,
         timeout: float = SAVE_TIMEOUT) -> str:
    """Write a checkpoint of every shard into ``directory``; returns its manifest's path."""
    return sess.run_on_loop(async_save(sess.async_session, directory, step=step, keep=keep, timeout=timeout),
                            timeout)


def restore(sess: "Session", path: str) -> int:
    """Restore the latest checkpoint in a directory (or a given manifest); returns its step."""
    return sess.run_on_loop(async_restore(sess.async_session, path), 600)


def fenced(sess: "Session") -> list[str]:
    """The shards a recovery has fenced and not lifted (its restorer died): recover them again."""
    return sess.run_on_loop(async_fenced(sess.async_session))


def recover(sess: "Session", path: str) -> int:
    """Fence every shard, restore the checkpoint at ``path`` onto them, lift the fences; returns its step."""
    return sess.run_on_loop(async_recover(sess.async_session, path), 600)


def save_store(store: Any, directory: str, step: int, keep: int = 5) -> str:
    """Checkpoint a replica held in this process (a ``ShardStore``): one file, then the manifest."""
    from ..state.snapshot import part_arrays

    os.makedirs(directory, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    entries = []
    records = []
    for (name, part), p in sorted(store.parts.items()):
        key = part_prefix(p, name, part)
        arrays.update(part_arrays(p, key))
        entries.append({"kind": "part", "name": name, "part": part, "key": key, "rows": list(p.rows),
                        "shape": list(p.full_shape), "dtype": p.dtype.name, "slots": list(p.slots)})
        records.append({"name": name, "shape": list(p.full_shape), "dtype": str(p.dtype), "parts": [{"task": "local", "rows": list(p.rows)}],
                        "optimizer": None if p.optimizer is None else p.optimizer.spec(), "table": None})
    file = f"{_file_tag(step)}-replica.safetensors"
    with opened_dir(directory) as fd:
        write_atomic(os.path.join(directory, file), arrays, dir_fd=fd,
                     metadata={"format": FILE_FORMAT, "entries": json.dumps(entries)})
        crash_point("before-manifest")
        manifest = {"format": FORMAT, "step": int(step), "time": time.time(), "records": records,
                    "shards": [{"task": "local", "file": file, "entries": entries}]}
        return _commit(directory, fd, manifest, keep)


def restore_store(path: str) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
    """(step, {name: {"value", "slot.*", "steps"}}) from a replica checkpoint (single-part variables)."""
    _, manifest, shards = ckfiles.read(path, open_shard_file)
    return int(manifest["step"]), {name: {k: field(piece, k) for k in ckfiles.fields(piece)}
                                   for (name, _), piece in ckfiles.pieces(shards).items()}
