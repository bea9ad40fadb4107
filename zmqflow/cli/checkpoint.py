"""``zmqflow checkpoint inspect DIR``: what a checkpoint (or an embedding delta) holds, read from
its manifest and file headers only; no cluster needed."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from ..client.checkpoint_files import MANIFEST, checkpoints, describe
from ..client.embedding_delta import delta_manifests, describe_delta
from ..errors import InvalidArgument, NotFound
from .common import EXIT_FAILURE, EXIT_OK, fail

__all__ = ["checkpoint", "inspect_path", "format_inspect"]


def inspect_path(path: str) -> dict[str, Any]:
    """``{"checkpoint": ... or None, "deltas": [...]}`` for a checkpoint directory (its newest
    checkpoint and every delta in it), a checkpoint manifest, or a delta manifest."""
    base = os.path.basename(path)
    if os.path.isfile(path) and base.startswith("delta-") and base.endswith(".json"):
        return {"checkpoint": None, "deltas": [describe_delta(path)]}
    if os.path.isfile(path):
        return {"checkpoint": describe(path), "deltas": []}
    if not os.path.isdir(path):
        raise NotFound(f"{path!r} does not exist")
    deltas = [describe_delta(p) for p in delta_manifests(path)]
    has_manifest = any(MANIFEST.match(n) for n in os.listdir(path))
    if not deltas and not has_manifest:
        raise NotFound(f"{path!r} is not a checkpoint directory: it holds no checkpoint-<step>.json and no delta-*.json")
    if has_manifest and not checkpoints(path):
        raise InvalidArgument(f"{path!r} holds no complete checkpoint: every manifest is unreadable or names a "
                              f"missing shard file")
    return {"checkpoint": describe(path) if has_manifest else None, "deltas": deltas}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_inspect(info: dict[str, Any]) -> str:
    out: list[str] = []
    c = info["checkpoint"]
    if c is not None:
        out.append(f"checkpoint {c['path']}: step {c['step']}, format {c['format']}, {len(c['files'])} file(s), "
                   f"{_size(c['bytes'])}")
        if c["variables"]:
            rows = [["VARIABLE", "DTYPE", "SHAPE", "PARTS", "PARTITIONING", "SLOTS", "BYTES", "SHARDS"]]
            for v in c["variables"]:
                rows.append([v["name"], v["dtype"], "x".join(map(str, v["shape"])) or "scalar", str(v["parts"]),
                             " ".join(f"{a}:{b}" for a, b in v["partitioning"]) or "-", ",".join(v["slots"]) or "-",
                             _size(v["bytes"]), ",".join(v["shards"])])
            out += ["", *_table(rows)]
        if c["tables"]:
            rows = [["TABLE", "DTYPE", "ROWS", "DIM", "PARTS", "SLOTS", "STEP", "BYTES", "SHARDS"]]
            for t in c["tables"]:
                rows.append([t["name"], str(t["dtype"]), str(t["rows"]), str(t["dim"]), str(t["parts"]),
                             ",".join(t["slots"]) or "-", str(t["step"]), _size(t["bytes"]), ",".join(t["shards"])])
            out += ["", *_table(rows)]
        rows = [["FILE", "TASK", "FORMAT", "BYTES"]]
        rows += [[f["file"], str(f["task"] or "-"), f["format"] or "-", _size(f["bytes"])] for f in c["files"]]
        out += ["", *_table(rows), "", f"total {_size(c['bytes'])}"]
    for d in info["deltas"]:
        if out:
            out.append("")
        out.append(f"delta {d['path']}: table {d['table']!r} dim {d['dim']} {d['dtype']}, steps >= {d['since']} "
                   f"up to {d['step']}: {d['rows']} row(s) changed, {d['dropped']} id(s) dropped, {_size(d['bytes'])}")
        rows = [["PART", "TASK", "ROWS", "DROPPED", "FILE", "BYTES"]]
        rows += [[str(p["part"]), str(p["task"] or "-"), str(p["rows"]), str(p["dropped"]), p["file"], _size(p["bytes"])]
                 for p in d["parts"]]
        out += _table(rows)
    return "\n".join(out)


@click.group("checkpoint")
def checkpoint() -> None:
    """Look into checkpoints on disk (no cluster needed)."""


@checkpoint.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(path: str, as_json: bool) -> None:
    """What the checkpoint in PATH holds (a directory: its newest checkpoint and any embedding
    deltas; or a checkpoint-<step>.json or delta-*.json): step, variables (dtype, shape,
    partitioning, slots, bytes, shards), tables (rows, dim), files, total bytes."""
    try:
        info = inspect_path(path)
    except (NotFound, InvalidArgument) as exc:
        fail("checkpoint inspect", exc, EXIT_FAILURE)
    click.echo(json.dumps(info, indent=1) if as_json else format_inspect(info))
    raise SystemExit(EXIT_OK)
