"""Embedding deltas for online serving: the rows of a dynamic table changed since a step, and
the ids it dropped, written by each shard where its checkpoint roots allow.

A delta is a directory entry of ``delta-<tag>.json`` (written last: the commit marker, as a
checkpoint's manifest is) naming one safetensors file per table part, each holding ``ids``
(int64, ascending), ``values`` (their current rows) and ``dropped`` (int64 ids to forget).
``since`` is inclusive: a row whose last change was at step ``since`` is in the delta. Each
part keeps its own clock (the latest step its pushes carried), and a part that saw no push for a
while lags: a row it creates is stamped with its lagging clock. So the manifest's ``next_since``
is the smallest part clock at export time, and a server that asks next for
``since = next_since`` misses nothing (some rows arrive twice; applying a delta is idempotent).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from typing import Any

from ..errors import InvalidArgument
from ..state.snapshot import write_atomic
from ..state.tensorfile import TensorFile
from ..wire.requests import ps as rq
from .checkpoint_files import committed, load_manifest, named_file
from .port import SessionPort

__all__ = ["DELTA_FORMAT", "export_delta", "delta_manifests", "describe_delta"]

DELTA_FORMAT = "zmqflow-delta/1"


def delta_manifests(directory: str) -> list[str]:
    """The delta manifests in ``directory`` whose files all exist, oldest first."""
    return [path for path, _ in committed(directory, lambda n: n.startswith("delta-") and n.endswith(".json"),
                                          lambda m: [p["file"] for p in m["parts"]])]


async def export_delta(session: SessionPort, name: str, tasks: tuple[Any, ...], since: int, directory: str, *,
                       dim: int, dtype: str, timeout: float | None = None) -> str:
    """Every part writes its delta file, then the manifest goes in; returns the manifest's path.
    A shard whose drop log no longer reaches ``since`` refuses (``InvalidArgument``: take a full
    export instead), and then no manifest is written."""
    if isinstance(since, bool) or not isinstance(since, int) or since < 0:
        raise InvalidArgument(f"export_delta of {name!r}: since_step must be an integer >= 0, got {since!r}")
    tag = f"{since:010d}-{int(time.time() * 1000)}-{secrets.token_hex(4)}"
    absolute = os.path.abspath(directory)
    parts = await asyncio.gather(*(
        session.call_task(task, "ps", "emb_export_delta", rq.EmbExportDelta(
            name=name, part=p, since=since, directory=absolute, file=f"delta-{tag}-part{p:05d}.safetensors"),
            timeout=timeout)
        for p, task in enumerate(tasks)
    ))
    for task, part in zip(tasks, parts):
        part["task"] = str(task)
    manifest = {"format": DELTA_FORMAT, "table": name, "since": since, "step": max(p["step"] for p in parts),
                "next_since": min(p["step"] for p in parts),
                "dim": dim, "dtype": dtype, "time": time.time(), "rows": sum(p["rows"] for p in parts),
                "dropped": sum(p["dropped"] for p in parts), "parts": parts}
    os.makedirs(directory, exist_ok=True)  # the shards made it, unless they write on other hosts
    path = os.path.join(directory, f"delta-{tag}.json")
    write_atomic(path, text=json.dumps(manifest, indent=1))
    return path


def describe_delta(path: str) -> dict[str, Any]:
    """What the delta at ``path`` (its manifest) holds, from the manifest and file headers: the
    table, ``since``, the step it reaches, rows and dropped ids per part, files and bytes."""
    manifest = load_manifest(path, "delta")
    if not isinstance(manifest, dict) or manifest.get("format") != DELTA_FORMAT:
        raise InvalidArgument(f"{path!r} is not a delta manifest of format {DELTA_FORMAT}", file=path)
    directory = os.path.dirname(os.path.abspath(path))
    parts = []
    for p in manifest["parts"]:
        f = TensorFile(named_file(directory, p.get("file"), path))  # header checked: a truncated file is named
        parts.append({"part": p["part"], "task": p.get("task"), "file": p["file"], "bytes": f.size,
                      "rows": f.shape("ids")[0], "dropped": f.shape("dropped")[0], "step": p.get("step")})
    return {"path": path, "table": manifest["table"], "since": manifest["since"], "step": manifest["step"],
            "next_since": manifest.get("next_since"),
            "dim": manifest.get("dim"), "dtype": manifest.get("dtype"), "rows": sum(p["rows"] for p in parts),
            "dropped": sum(p["dropped"] for p in parts), "parts": parts, "bytes": sum(p["bytes"] for p in parts)}
