"""Sharded, atomic checkpoints of everything on the ps shards.

``save`` asks every shard to write its own file (variables, optimizer slots, per-row step counts,
sync steps, dynamic-table rows), then writes a JSON manifest last: the manifest is the commit
marker, so a checkpoint exists only once every shard file it names is complete. Each file goes to
a temporary name, is fsynced and renamed; a crash at any moment leaves the previous checkpoint
intact. Nothing is pickled: arrays are ``.npz`` read back with ``allow_pickle=False``.

``restore`` reads the files (the checkpoint directory is shared, as TF's is) and puts every
variable and table back on the shards of the current cluster, which may have a different number
of ps tasks: parts keep their row ranges and are placed anew; dynamic-table rows are re-hashed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .embedding import create_table_parts
from ..state.tables import hash_owner
from ..errors import InvalidArgument, NotFound, Recovering
from ..observe import timeline
from ..state.partition import fixed_size_partitioner
from ..state.snapshot import TEMP_SUFFIX, abandoned_temporary, crash_point, fsync_dir, read_arrays, write_atomic
from ..state.store import part_label
from ..cluster import TaskId, holder_tasks, shard_tasks
from .placement import device
from .variables import create_parts
from ..wire.requests import cluster as crq
from ..wire.requests import ps as rq

if TYPE_CHECKING:
    from .blocking import Session
    from .session import AsyncSession

__all__ = ["save", "restore", "recover", "fenced", "manifest_name", "async_fenced", "latest", "checkpoints", "async_save", "async_restore", "async_recover",
           "save_store", "restore_store"]

FORMAT = 1
_MANIFEST = re.compile(r"^checkpoint-(\d+)\.json$")
# What a save writes before its manifest (shard files, temporaries): the step is in the name.
_WRITTEN = re.compile(r"^(?:step(\d{10})-.*\.npz|checkpoint-(\d{10})\.json)(?P<tmp>" + TEMP_SUFFIX + ")?$")

log = logging.getLogger("zmqflow.checkpoint")


def manifest_name(step: int) -> str:
    return f"checkpoint-{step:010d}.json"


def checkpoints(directory: str) -> list[str]:
    """Manifests in ``directory`` whose shard files all exist, oldest first."""
    return [path for path, _ in _complete(directory)]


def _complete(directory: str) -> list[tuple[str, set[str]]]:
    """(manifest, the shard files it names) for every complete checkpoint, oldest first; each
    manifest read once."""
    try:
        names = sorted(n for n in os.listdir(directory) if _MANIFEST.match(n))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path) as fh:
                files = {s["file"] for s in json.load(fh).get("shards", [])}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # half-written, or removed meanwhile by another process pruning
        if all(os.path.exists(os.path.join(directory, f)) for f in files):
            out.append((path, files))
    return out


def latest(directory: str) -> str | None:
    """The newest complete checkpoint's manifest, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def _file_tag(step: int) -> str:
    """The start of every file one save writes: its step (what pruning reads), the time, and a
    token of its own, so two writers saving one step at once (a chief handing over, in another
    process or on another host) never write, or name in their manifests, the same file."""
    return f"step{step:010d}-{int(time.time() * 1000)}-{secrets.token_hex(4)}"


@timeline.traced("checkpoint", "save")
async def async_save(sess: "AsyncSession", directory: str, *, step: int | None = None, keep: int = 5) -> str:
    """The shards write first, each where its checkpoint roots allow (a refused directory is
    ``PermissionDenied`` and nothing is created); then the manifest, then pruning."""
    spec = await sess.cluster()
    if step is None:
        step = await _global_step(sess)
    records = await sess.call_catalog("records", crq.Records())
    tag = _file_tag(step)
    tasks = holder_tasks(spec, records)  # the ps tasks and any other task a variable is pinned to
    shards = await asyncio.gather(*(
        sess.call_task(t, "ps", "save", rq.Save(directory=os.path.abspath(directory), file=f"{tag}-{t.job}{t.index}.npz"))
        for t in tasks
    ))
    for task, shard in zip(tasks, shards):
        shard["task"] = str(task)
    crash_point("before-manifest")
    os.makedirs(directory, exist_ok=True)  # the shards made it, unless they write on other hosts
    manifest = {"format": FORMAT, "step": int(step), "time": time.time(), "records": records, "shards": shards}
    path = os.path.join(directory, manifest_name(int(step)))
    write_atomic(path, text=json.dumps(manifest, indent=1))
    _prune(directory, keep)
    return path


def _prune(directory: str, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints: remove a manifest first, then its files. Files no
    manifest names, from saves older than the newest checkpoint, are what a save that crashed
    before its manifest left behind: they go too. Another process pruning the same directory at
    the same time (a chief handing over) may remove a file first; that is not an error."""
    found = _complete(directory)
    kept = found[-keep:] if keep > 0 else found
    needed = {f for _, files in kept for f in files}
    for path, files in found[:-keep] if keep > 0 else []:
        _remove(path)
        for f in files - needed:
            _remove(os.path.join(directory, f))
    _remove_unfinished(directory, kept)
    fsync_dir(directory)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _remove_unfinished(directory: str, kept: list[tuple[str, set[str]]]) -> None:
    if not kept:
        return
    newest = int(_MANIFEST.match(os.path.basename(kept[-1][0])).group(1))  # type: ignore[union-attr]
    named = {os.path.basename(path) for path, _ in kept} | {f for _, files in kept for f in files}
    for name in os.listdir(directory):
        m = _WRITTEN.match(name)
        # strictly older than the newest checkpoint: a save in progress now writes a newer step, or
        # is a writer beside this one (a chief handing over): its temporaries stay while it lives
        if not m or name in named or int(m.group(1) or m.group(2)) >= newest:
            continue
        path = os.path.join(directory, name)
        if m["tmp"] is None or abandoned_temporary(path):
            _remove(path)


async def _global_step(sess: "AsyncSession") -> int:
    step = await sess.global_step()
    if step:
        return step
    try:
        return int(await (await sess.get("global_step", timeout=0)).read())
    except NotFound:
        return 0


def _open_manifest(path: str) -> tuple[str, str, dict[str, Any]]:
    """(manifest path, its directory, its contents) for a manifest or a directory's latest."""
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise NotFound(f"no complete checkpoint in {path!r}")
        path = found
    try:
        with open(path) as fh:
            return path, os.path.dirname(os.path.abspath(path)), json.load(fh)
    except FileNotFoundError:
        raise NotFound(f"no checkpoint at {path!r}") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read checkpoint manifest {path!r}: {exc}") from None


Shard = tuple[dict[str, Any], dict[str, np.ndarray]]
_READ_TRIES = 3


def _read(path: str) -> tuple[str, dict[str, Any], list[Shard]]:
    """(manifest path, manifest, [(shard entry, its arrays)]) of the checkpoint at ``path`` (a
    manifest, or a directory: its newest), every file read before anything changes. A writer
    saving into the directory meanwhile prunes all but its newest few checkpoints, possibly the
    one chosen here: then the newest is chosen again (a named manifest is never chosen again)."""
    for attempt in range(_READ_TRIES):
        try:
            chosen, directory, manifest = _open_manifest(path)
            shards = [(shard, read_arrays(os.path.join(directory, shard["file"]))) for shard in manifest["shards"]]
            return chosen, manifest, shards
        except (NotFound, InvalidArgument):
            if not os.path.isdir(path) or attempt == _READ_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _entries(shards: list[Shard]) -> dict[tuple[str, int], Shard]:
    """{(name, part): (entry, its arrays without the entry's key prefix)}."""
    out: dict[tuple[str, int], Shard] = {}
    for shard, arrays in shards:
        for entry in shard["entries"]:
            prefix = entry["key"] + "."
            out[(entry["name"], entry["part"])] = (entry, {k[len(prefix):]: v for k, v in arrays.items()
                                                           if k.startswith(prefix)})
    return out


def _load(path: str) -> tuple[dict[str, Any], dict[tuple[str, int], Shard]]:
    """(manifest, {(name, part): (entry, arrays)}), every file read and checked before anything changes."""
    chosen, manifest, shards = _read(path)
    if manifest.get("format") != FORMAT:
        raise InvalidArgument(f"checkpoint {chosen!r} has format {manifest.get('format')!r}; this version reads {FORMAT}")
    return manifest, _entries(shards)


@timeline.traced("checkpoint", "restore")
async def async_restore(sess: "AsyncSession", path: str) -> int:
    """Put the checkpoint at ``path`` (a manifest, or a directory: its latest) back; returns its step."""
    return await _put_back(sess, *_load(path))


async def _put_back(sess: "AsyncSession", manifest: dict[str, Any], pieces: dict) -> int:
    for record in manifest["records"]:
        if record.get("table") and record["table"]["kind"] == "hash":
            await _restore_table(sess, record, pieces)
        else:
            await _restore_variable(sess, record, pieces)
    sess.step = int(manifest["step"])
    return int(manifest["step"])


@timeline.traced("checkpoint", "recover")
async def async_recover(sess: "AsyncSession", path: str) -> int:
    """Restore onto a running cluster whose shards hold newer or partial state (a shard died and
    came back empty). The checkpoint is read first; then every shard is fenced, so no worker
    reads or pushes a half-restored state; every part the checkpoint holds is dropped and made
    afresh (a hash table's rows added since would otherwise survive the restore), as is every
    part the catalog does not place on a shard (left over when the catalog itself was lost);
    then the checkpoint is restored and the fences lifted. On failure the shards stay fenced:
    the caller recovers again, and nobody trains on mixed state meanwhile."""
    manifest, pieces = _load(path)
    spec = await sess.cluster()
    # every task the catalog or the checkpoint places a part on (a variable pinned to a worker)
    before = await sess.call_catalog("records", crq.Records(pending=True))
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
            if not (r.get("table") and r["table"]["kind"] == "hash") and (p["task"], r["name"], i) not in have]


def _placeable(spec: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A checkpoint's records whose every part names a task of ``spec`` (a checkpoint taken on
    another cluster places its parts anew)."""
    return [r for r in records if all(p["task"] in spec for p in r["parts"])]


def _placed(records: list[dict[str, Any]], task: str) -> list[list[Any]]:
    return [[r["name"], i] for r in records for i, part in enumerate(r["parts"]) if part["task"] == task]


def _sweep(records: list[dict[str, Any]], task: str) -> rq.Sweep:
    return rq.Sweep(keep=[rq.Pair(name, i) for name, i in _placed(records, task)])


def _slots(saved: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[len("slot."):]: v for k, v in saved.items() if k.startswith("slot.")}


def _assemble(record: dict[str, Any], pieces: dict, field: str) -> np.ndarray | None:
    arrays = [pieces[(record["name"], i)][1].get(field) for i in range(len(record["parts"]))]
    if any(a is None for a in arrays):
        return None
    return arrays[0] if not record["shape"] else np.concatenate(arrays)


async def _restore_variable(sess: "AsyncSession", record: dict[str, Any], pieces: dict) -> None:
    name = record["name"]
    value = _assemble(record, pieces, "value")
    if value is None:
        raise InvalidArgument(f"checkpoint has no value for every part of {name!r}")
    # Parts are (re)created wherever the catalog places them: a shard that restarted empty gets
    # its parts back; parts that survived are kept and then overwritten below. A variable pinned
    # to a task outside the default shards goes back there when the catalog has to place it anew.
    with device(_pinned(await sess.cluster(), record)):
        tasks = await _declare_again(sess, record, value)
    calls = []
    for i, task in enumerate(tasks):
        _, saved = pieces[(name, i)]
        body = rq.RestorePart(name=name, part=i, value=saved["value"], slots=_slots(saved), steps=saved.get("steps"),
                              sync_step=int(saved["sync_step"]) if "sync_step" in saved else None)
        calls.append(sess.call_task(task, "ps", "restore_part", body))
    await asyncio.gather(*calls)


def _pinned(spec: Any, record: dict[str, Any]) -> str | None:
    """The task every part of ``record`` was on, when it is a task of ``spec`` that default
    placement would not choose (a variable pinned with ``zf.device`` to a worker); else None."""
    where = {p["task"] for p in record["parts"]}
    if len(where) != 1:
        return None
    task = next(iter(where))
    return task if task in spec and TaskId.parse(task) not in shard_tasks(spec) else None


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


async def _restore_table(sess: "AsyncSession", record: dict[str, Any], pieces: dict) -> None:
    t = record["table"]
    n_old = len(record["parts"])
    saved = [pieces[(record["name"], i)][1] for i in range(n_old)]
    with device(_pinned(await sess.cluster(), record)):
        emb = await sess.embedding(record["name"], None, t["dim"], dtype=record["dtype"],
                                   initializer=record.get("initializer"), optimizer=record.get("optimizer"),
                                   min_frequency=t["min_frequency"], capacity=t["capacity"])
    await create_table_parts(sess, emb.info, record)
    ids = np.concatenate([s["ids"] for s in saved])
    values = np.concatenate([s["value"] for s in saved])
    steps = np.concatenate([s["steps"] for s in saved])
    slots = {k: np.concatenate([_slots(s)[k] for s in saved]) for k in _slots(saved[0])}
    owner = hash_owner(ids, emb.info.parts)
    calls = []
    for p, task in enumerate(emb.info.tasks):
        m = owner == p
        calls.append(sess.call_task(task, "ps", "emb_restore", rq.EmbRestore(
            name=record["name"], part=p, ids=ids[m], values=values[m], slots={k: v[m] for k, v in slots.items()},
            steps=steps[m],
        )))
    await asyncio.gather(*calls)


def save(sess: "Session", directory: str, *, step: int | None = None, keep: int = 5) -> str:
    """Write a checkpoint of every shard into ``directory``; returns its manifest's path."""
    return sess.run_on_loop(async_save(sess.async_session, directory, step=step, keep=keep), 600)


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
    for i, ((name, part), p) in enumerate(sorted(store.parts.items())):
        arrays.update(part_arrays(p, f"p{i}"))
        entries.append({"kind": "part", "name": name, "part": part, "key": f"p{i}", "rows": list(p.rows)})
        records.append({"name": name, "shape": list(p.full_shape), "dtype": str(p.dtype), "parts": [{"task": "local", "rows": list(p.rows)}],
                        "optimizer": None if p.optimizer is None else p.optimizer.spec(), "table": None})
    file = f"{_file_tag(step)}-replica.npz"
    write_atomic(os.path.join(directory, file), arrays)
    crash_point("before-manifest")
    manifest = {"format": FORMAT, "step": int(step), "time": time.time(), "records": records,
                "shards": [{"task": "local", "file": file, "entries": entries}]}
    path = os.path.join(directory, manifest_name(int(step)))
    write_atomic(path, text=json.dumps(manifest, indent=1))
    _prune(directory, keep)
    return path


def restore_store(path: str) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
    """(step, {name: {"value", "slot.*", "steps"}}) from a replica checkpoint (single-part variables)."""
    _, manifest, shards = _read(path)
    return int(manifest["step"]), {name: arrays for (name, _), (_, arrays) in _entries(shards).items()}
