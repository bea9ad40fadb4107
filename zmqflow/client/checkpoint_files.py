"""A checkpoint directory on disk: its manifests, its shard files, and what they hold.

A checkpoint is a JSON manifest ``checkpoint-<step>.json`` (written last: the commit marker)
naming one shard file per task that held state. Format 2 shard files are safetensors
(:mod:`zmqflow.state.snapshot` names their tensors); format 1 files (``.npz``) are still read.
Nothing here needs a running cluster: restore reads through it, and so does
``zmqflow checkpoint inspect``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidArgument, NotFound
from ..state.snapshot import NpzFile, entry_tensor, open_shard_file
from ..state.tensorfile import TensorFile

__all__ = ["FORMAT", "READS", "manifest_name", "checkpoints", "complete", "committed", "load_manifest", "latest", "open_manifest", "read",
           "Piece", "pieces", "field", "fields", "describe", "MANIFEST", "plain_name", "named_file"]

FORMAT = 2  # safetensors shard files
READS = (1, 2)  # 1: npz shard files
MANIFEST = re.compile(r"^checkpoint-(\d+)\.json$")

ShardFile = TensorFile | NpzFile
Piece = tuple[dict[str, Any], ShardFile]  # (manifest entry, the file holding it)


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


def checkpoints(directory: str) -> list[str]:
    """Manifests in ``directory`` whose shard files all exist, oldest first."""
    return [path for path, _ in complete(directory)]


def complete(directory: str) -> list[tuple[str, set[str]]]:
    """(manifest, the shard files it names) for every complete checkpoint, oldest first; each
    manifest read once."""
    return committed(directory, lambda n: MANIFEST.match(n) is not None,
                     lambda m: [s["file"] for s in m.get("shards", [])])


def committed(directory: str, is_manifest: Callable[[str], bool],
              files_of: Callable[[Any], list[str]]) -> list[tuple[str, set[str]]]:
    """(manifest, its files) for every manifest in ``directory`` (names sorted, so oldest first
    for zero-padded steps) whose files all exist: the manifest is the commit marker, written last."""
    try:
        names = sorted(n for n in os.listdir(directory) if is_manifest(n))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path) as fh:
                files = set(files_of(json.load(fh)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # half-written, or removed meanwhile by another process pruning
        if not all(map(plain_name, files)):
            continue  # names a file outside the directory: never read, kept or pruned as a checkpoint
        if all(os.path.exists(os.path.join(directory, f)) for f in files):
            out.append((path, files))
    return out


def latest(directory: str) -> str | None:
    """The newest complete checkpoint's manifest, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def load_manifest(path: str, what: str) -> Any:
    """A manifest's JSON: ``NotFound`` when it is not there, ``InvalidArgument`` naming the file
    when it cannot be read (``what``: checkpoint, delta)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise NotFound(f"no {what} at {path!r}") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {what} manifest {path!r}: {exc}", file=path) from None


def open_manifest(path: str) -> tuple[str, str, dict[str, Any]]:
    """(manifest path, its directory, its contents) for a manifest or a directory's latest."""
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise NotFound(f"no complete checkpoint in {path!r} (no checkpoint-<step>.json whose shard files all exist)")
        path = found
    manifest = load_manifest(path, "checkpoint")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise InvalidArgument(f"{path!r} is not a checkpoint manifest (no list of shards)", file=path)
    if manifest.get("format") not in READS:
        raise InvalidArgument(f"checkpoint {path!r} has format {manifest.get('format')!r}; this version reads "
                              f"{', '.join(map(str, READS))}", file=path)
    return path, os.path.dirname(os.path.abspath(path)), manifest


_READ_TRIES = 3


def read(path: str, opener: Any = open_shard_file) -> tuple[str, dict[str, Any], list[tuple[dict[str, Any], ShardFile]]]:
    """(manifest path, manifest, [(shard entry, its file, opened)]) of the checkpoint at ``path``
    (a manifest, or a directory: its newest). Every file is opened, its header checked, before
    anything changes; the data stays on disk until read. A writer saving into the directory
    meanwhile prunes all but its newest few checkpoints, possibly the one chosen here: then the
    newest is chosen again (a named manifest is never chosen again)."""
    for attempt in range(_READ_TRIES):
        try:
            chosen, directory, manifest = open_manifest(path)
            shards = [(shard, opener(named_file(directory, shard.get("file"), chosen))) for shard in manifest["shards"]]
            return chosen, manifest, shards
        except (NotFound, InvalidArgument):
            if not os.path.isdir(path) or attempt == _READ_TRIES - 1:
                raise
    raise AssertionError("unreachable")


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
