"""A checkpoint directory on disk: its manifests, its shard files, and what they hold.

A checkpoint is a JSON manifest ``checkpoint-<step>.json`` (written last: the commit marker)
naming one shard file per task that held state. Format 2 shard files are safetensors
(:mod:`zmqflow.state.snapshot` names their tensors); format 1 files (``.npz``) are still read.
Nothing here needs a running cluster: restore reads through it, and so does
``zmqflow checkpoint inspect``.

Checkpoints stand in the order they were saved, as TF's ``CheckpointManager`` keeps them, not in
the order of their steps: a run restored to an older checkpoint and trained on saves lower steps
than the checkpoints it left behind, and its saves are the newest. Each manifest carries ``seq``,
one more than the largest in its directory when it was written (manifests from before have none:
0), then ``time``; the latest checkpoint is the last saved, retention keeps the last saved.

A directory is opened once and read through its descriptor (:mod:`zmqflow.state.dirfd`): the
path a caller gives (a directory, or a manifest) is followed as given, but a manifest found by
listing, and every shard file a manifest names, must be a file of the directory itself; a link
there is no checkpoint (never listed, read, kept or pruned as one).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from ..errors import DeadlineExceeded, InvalidArgument, NotFound
from ..state.dirfd import is_file, open_dir, opener as nofollow_opener
from ..state.snapshot import NpzFile, entry_tensor, open_shard_file
from ..state.tensorfile import TensorFile

__all__ = ["FORMAT", "READS", "manifest_name", "checkpoints", "complete", "committed", "load_manifest", "latest",
           "open_manifest", "read", "saved", "Saved", "save_order", "next_seq", "directory_fd",
           "Piece", "pieces", "field", "fields", "describe", "MANIFEST", "plain_name", "named_file", "locked", "LOCK_WAIT"]

FORMAT = 2  # safetensors shard files
READS = (1, 2)  # 1: npz shard files
MANIFEST = re.compile(r"^checkpoint-(\d+)\.json$")

ShardFile = TensorFile | NpzFile
Piece = tuple[dict[str, Any], ShardFile]  # (manifest entry, the file holding it)
Order = tuple[int, float, str]


class Saved(NamedTuple):
    """A complete checkpoint: its manifest's path, the files it names, where it stands in saves."""

    path: str
    files: set[str]
    order: Order


def manifest_name(step: int) -> str:
    return f"checkpoint-{step:010d}.json"


def plain_name(name: Any) -> bool:
    """A file name that stays in its directory: no separator, not ``.`` or ``..``, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def named_file(directory: str, name: Any, manifest: str) -> str:
    """The path of a file ``manifest`` names, which must be a plain name in its ``directory``: a
    manifest is data on disk, and a name that leads elsewhere would be read, or pruned, there."""
    if not plain_name(name):
        raise InvalidArgument(f"{manifest!r} names the file {name!r}, not a plain name in its directory", file=manifest)
    return os.path.join(directory, name)


def save_order(name: str, manifest: Any) -> Order:
    """Where a checkpoint stands among its directory's saves: ``seq``, then ``time``, then name.
    ``ValueError`` for a ``seq`` that is not a whole number, or a ``time`` that is not a finite
    one (a hand edit; JSON carries ``Infinity``): such a manifest is no checkpoint to order."""
    def number(key: str) -> Any:
        v = manifest.get(key, 0) if isinstance(manifest, dict) else 0
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                or (key == "seq" and not isinstance(v, int)):
            raise ValueError(f"{name!r}: its {key} {v!r} is not a {'whole' if key == 'seq' else 'finite'} number")
        return v

    return int(number("seq")), float(number("time")), name


@contextmanager
def directory_fd(directory: str) -> Iterator[int | None]:
    """A descriptor of ``directory``, closed after; None when it is not there (or not a directory)."""
    try:
        fd = open_dir(directory)
    except (FileNotFoundError, NotADirectoryError):
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def saved(directory: str, dir_fd: int | None = None) -> list[Saved]:
    """Every complete checkpoint in ``directory`` (through ``dir_fd`` when given), oldest save first."""
    if dir_fd is None:
        with directory_fd(directory) as fd:
            return [] if fd is None else saved(directory, fd)
    return [Saved(path, files, order) for order, path, files in _scan(
        dir_fd, directory, lambda n: MANIFEST.match(n) is not None,
        lambda m: [s["file"] for s in m.get("shards", [])], save_order)]


def checkpoints(directory: str) -> list[str]:
    """Manifests in ``directory`` whose shard files all exist, oldest save first."""
    return [s.path for s in saved(directory)]


def complete(directory: str) -> list[tuple[str, set[str]]]:
    """(manifest, the shard files it names) for every complete checkpoint, oldest save first."""
    return [(s.path, s.files) for s in saved(directory)]


def next_seq(found: list[Saved]) -> int:
    """The ``seq`` of a manifest written now: one more than any in its directory."""
    return 1 + max((s.order[0] for s in found), default=0)


def committed(directory: str, is_manifest: Callable[[str], bool],
              files_of: Callable[[Any], list[str]]) -> list[tuple[str, set[str]]]:
    """(manifest, its files) for every manifest in ``directory`` (names sorted, so oldest first
    for zero-padded names) whose files all exist: the manifest is the commit marker, written last."""
    with directory_fd(directory) as fd:
        if fd is None:
            return []
        return [(path, files) for _, path, files in _scan(fd, directory, is_manifest, files_of, lambda n, m: n)]


def _scan(fd: int, directory: str, is_manifest: Callable[[str], bool], files_of: Callable[[Any], list[str]],
          order: Callable[[str, Any], Any]) -> list[tuple[Any, str, set[str]]]:
    """(order, path, files) of every committed manifest listed in ``fd``, sorted by order."""
    out = []
    for name in os.listdir(fd):
        if not is_manifest(name):
            continue
        try:
            with open(name, opener=nofollow_opener(fd)) as fh:
                manifest = json.load(fh)
            files = set(files_of(manifest))
            where = order(name, manifest)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # half-written, removed meanwhile by another process pruning, a link, or no order
        if not all(map(plain_name, files)):
            continue  # names a file outside the directory: never read, kept or pruned as a checkpoint
        if all(is_file(fd, f) for f in files):
            out.append((where, os.path.join(directory, name), files))
    out.sort(key=lambda found: found[0])
    return out


def latest(directory: str) -> str | None:
    """The last saved complete checkpoint's manifest, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def load_manifest(path: str, what: str, dir_fd: int | None = None, *, follow: bool = True) -> Any:
    """A manifest's JSON: ``NotFound`` when it is not there, ``InvalidArgument`` naming the file
    when it cannot be read (``what``: checkpoint, delta). With ``dir_fd``, ``path``'s last name is
    opened in that directory; ``follow=False``: not when it is a link."""
    name = path if dir_fd is None else os.path.basename(path)
    flags_of = (lambda flags: flags) if follow else (lambda flags: flags | os.O_NOFOLLOW)
    try:
        with open(name, opener=lambda n, flags: os.open(n, flags_of(flags), dir_fd=dir_fd)) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise NotFound(f"no {what} at {path!r}") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {what} manifest {path!r}: {exc}", file=path) from None


def open_manifest(path: str, dir_fd: int | None = None) -> tuple[str, str, dict[str, Any]]:
    """(manifest path, its directory, its contents) for a manifest or a directory's latest
    (``dir_fd``: a descriptor of that directory, or of the manifest's)."""
    if dir_fd is None:
        with directory_fd(_directory_of(path)) as fd:
            if fd is None:
                raise NotFound(f"no checkpoint at {path!r}")
            return open_manifest(path, fd)
    chosen = path
    if os.path.isdir(path):
        found = saved(path, dir_fd)
        if not found:
            raise NotFound(f"no complete checkpoint in {path!r} (no checkpoint-<step>.json whose shard files all exist)")
        chosen = found[-1].path
    manifest = load_manifest(chosen, "checkpoint", dir_fd, follow=chosen == path)  # the caller's own name: as given
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise InvalidArgument(f"{chosen!r} is not a checkpoint manifest (no list of shards)", file=chosen)
    if manifest.get("format") not in READS:
        raise InvalidArgument(f"checkpoint {chosen!r} has format {manifest.get('format')!r}; this version reads "
                              f"{', '.join(map(str, READS))}", file=chosen)
    _check_structure(chosen, manifest)
    return chosen, os.path.dirname(os.path.abspath(chosen)), manifest


def _check_structure(path: str, manifest: dict[str, Any]) -> None:
    """The manifest's shards, their entries and its records have the fields every reader takes
    from them: else ``InvalidArgument`` naming the file and the field, before any file is opened."""
    def refuse(where: str, what: str) -> InvalidArgument:
        return InvalidArgument(f"checkpoint {path!r}: {where} {what}", file=path, field=where)

    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            raise refuse(f"shards[{i}]", f"is {type(shard).__name__}, not a map")
        entries = shard.get("entries")
        if not isinstance(entries, list):
            raise refuse(f"shards[{i}].entries", "is not a list of entries")
        for j, entry in enumerate(entries):
            if not _entry_ok(entry):
                raise refuse(f"shards[{i}].entries[{j}]", f"is not an entry this version reads: {str(entry)[:120]}")
    records = manifest.get("records", [])
    if not isinstance(records, list):
        raise refuse("records", "is not a list of records")
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("name"), str):
            raise refuse(f"records[{i}]", f"is not a record with a name: {str(record)[:120]}")


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry_ok(entry: Any) -> bool:
    """A shard entry: its kind, name, part and tensor prefix, and (where given) rows, clock, slots."""
    if not isinstance(entry, dict) or entry.get("kind") not in ("part", "table"):
        return False
    if not (isinstance(entry.get("name"), str) and _whole(entry.get("part")) and isinstance(entry.get("key"), str)):
        return False
    rows = entry.get("rows")
    if entry["kind"] == "table":
        rows_ok = rows is None or _whole(rows)
    else:
        rows_ok = rows is None or (isinstance(rows, list) and len(rows) == 2 and all(map(_whole, rows)))
    slots = entry.get("slots", [])
    return (rows_ok and _whole(entry.get("clock", 0)) and isinstance(slots, list)
            and all(isinstance(k, str) for k in slots))


_LOCK_POLL_S = (0.01, 0.25)  # the first and the longest wait between tries for a directory's lock
LOCK_WAIT = 600.0  # how long a writer waits for a directory's lock when its caller sets no deadline


@contextmanager
def locked(fd: int, directory: str, deadline: float | None = None) -> Iterator[None]:
    """``flock`` on the directory's descriptor, held for the block: tried without blocking until
    ``deadline`` (``time.monotonic``; None: ``LOCK_WAIT`` from now), then ``DeadlineExceeded``
    naming the directory, nothing done. Where the file system takes no such lock (some network ones), the block runs unlocked,
    as every save did before. Blocks its thread while it waits: never call it on an event loop."""
    pause, held = _LOCK_POLL_S[0], True
    deadline = time.monotonic() + LOCK_WAIT if deadline is None else deadline
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"checkpoint directory {directory!r} stayed locked by another writer past "
                                       "the save's deadline; nothing was committed", directory=directory) from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, _LOCK_POLL_S[1])
        except OSError:
            held = False
            break
    try:
        yield
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)


_READ_TRIES = 3


def read(path: str, opener: Any = open_shard_file) -> tuple[str, dict[str, Any], list[tuple[dict[str, Any], ShardFile]]]:
    """(manifest path, manifest, [(shard entry, its file, opened)]) of the checkpoint at ``path``
    (a manifest, or a directory: its last saved). The directory is opened once; the manifest and
    every file are read through it (``opener(path, dir_fd)``), headers checked, before anything
    changes; the data stays on disk until read. A writer saving into the directory meanwhile
    prunes all but its newest few checkpoints, possibly the one chosen here: then the newest is
    chosen again (a named manifest is never chosen again)."""
    directory = _directory_of(path)
    for attempt in range(_READ_TRIES):
        try:
            with directory_fd(directory) as fd:
                if fd is None:
                    raise NotFound(f"no checkpoint at {path!r}")
                chosen, _, manifest = open_manifest(path, fd)
                shards = [(shard, opener(named_file(directory, _file_of(shard, chosen), chosen), fd))
                          for shard in manifest["shards"]]
            return chosen, manifest, shards
        except (NotFound, InvalidArgument):
            if not os.path.isdir(path) or attempt == _READ_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _directory_of(path: str) -> str:
    """The directory a checkpoint ``path`` (a directory, or a manifest in one) is read from."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def _file_of(shard: Any, manifest: str) -> Any:
    if not isinstance(shard, dict):
        raise InvalidArgument(f"{manifest!r}: a shard is {type(shard).__name__}, not a map", file=manifest)
    return shard.get("file")


def pieces(shards: list[tuple[dict[str, Any], ShardFile]]) -> dict[tuple[str, int], Piece]:
    """{(name, part): (entry, the file holding it)}."""
    return {(e["name"], e["part"]): (e, f) for shard, f in shards for e in shard["entries"]}


def field(piece: Piece, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray | None:
    """``name`` (``value``, ``slot.m``, ``steps``, ``ids``, ...) of a piece, or rows of it, read
    from its file's mapping; None when the file holds none."""
    entry, f = piece
    tensor = entry_tensor(f, entry, name)
    return f.read(tensor, start, stop) if tensor in f else None


def fields(piece: Piece) -> list[str]:
    """The fields a piece has in its file."""
    entry, f = piece
    if isinstance(f, NpzFile):
        prefix = entry["key"] + "."
        return [k[len(prefix):] for k in f.keys() if k.startswith(prefix)]
    known = ["value", "steps", "sync_step", "ids", "changed", "pending_ids", "pending_counts",
             *(f"slot.{s}" for s in entry.get("slots", []))]
    return [k for k in known if entry_tensor(f, entry, k) in f]


def describe(path: str) -> dict[str, Any]:
    """What the checkpoint at ``path`` (a directory: its newest; or a manifest) holds, read from
    its manifest and file headers only: step, variables, tables, files, bytes."""
    chosen, manifest, shards = read(path)
    by_key = pieces(shards)
    records = {r["name"]: r for r in manifest.get("records", [])}
    files = [{"file": s["file"], "task": s.get("task"), "bytes": f.size,
              "format": f.metadata.get("format", "")} for s, f in shards]
    variables, tables = [], []
    for name in sorted({n for n, _ in by_key}):
        parts = sorted((p, by_key[(n, p)]) for n, p in by_key if n == name)
        record = records.get(name, {})
        nbytes = sum(f.nbytes(entry_tensor(f, e, k)) for _, (e, f) in parts for k in fields((e, f)))
        slots = sorted({k[5:] for _, piece in parts for k in fields(piece) if k.startswith("slot.")})
        where = sorted({s.get("task") or s["file"] for s, f in shards for e in s["entries"] if e["name"] == name})
        first = parts[0][1]
        if first[0]["kind"] == "table":
            rows = sum(int(e.get("rows", 0)) for _, (e, _f) in parts)
            dim = (record.get("table") or {}).get("dim") or first[0].get("dim")
            tables.append({"name": name, "rows": rows, "dim": dim, "dtype": record.get("dtype") or first[0].get("dtype"),
                           "parts": len(parts), "slots": slots, "bytes": nbytes, "shards": where,
                           "step": max(int(e.get("clock", 0)) for _, (e, _f) in parts)})
        else:
            entry, f = first
            dtype = record.get("dtype") or f.dtype(entry_tensor(f, entry, "value"))
            shape = record.get("shape") or entry.get("shape") or list(f.shape(entry_tensor(f, entry, "value")))
            variables.append({"name": name, "dtype": dtype, "shape": list(shape), "parts": len(parts),
                              "partitioning": [list(e.get("rows", [])) for _, (e, _f) in parts],
                              "slots": slots, "bytes": nbytes, "shards": where})
    return {"path": chosen, "step": int(manifest.get("step", 0)), "format": manifest.get("format"),
            "time": manifest.get("time"), "variables": variables, "tables": tables, "files": files,
            "bytes": sum(f["bytes"] for f in files)}
