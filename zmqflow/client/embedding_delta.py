"""Embedding deltas for online serving: the rows of a dynamic table changed since a step, and
the ids it dropped, written by each shard where its checkpoint roots allow.

A delta is a directory entry of ``delta-<tag>.json`` (written last: the commit marker, as a
checkpoint's manifest is) naming one safetensors file per table part, each holding ``ids``
(int64, ascending), ``values`` (their current rows) and ``dropped`` (int64 ids to forget).
``since`` is inclusive: a row whose last change was at step ``since`` is in the delta, so a
server that asks for ``since = <the previous delta's step>`` misses nothing (a row at that step
may arrive twice; applying a delta is idempotent).
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
from ..wire.requests import ps as rq
from .port import SessionPort

__all__ = ["DELTA_FORMAT", "export_delta", "delta_manifests"]

DELTA_FORMAT = "zmqflow-delta/1"


def delta_manifests(directory: str) -> list[str]:
    """The delta manifests in ``directory`` whose files all exist, oldest first."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("delta-") and n.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path) as fh:
                parts = json.load(fh)["parts"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if all(os.path.exists(os.path.join(directory, p["file"])) for p in parts):
            out.append(path)
    return out


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
                "dim": dim, "dtype": dtype, "time": time.time(), "rows": sum(p["rows"] for p in parts),
                "dropped": sum(p["dropped"] for p in parts), "parts": parts}
    os.makedirs(directory, exist_ok=True)  # the shards made it, unless they write on other hosts
    path = os.path.join(directory, f"delta-{tag}.json")
    write_atomic(path, text=json.dumps(manifest, indent=1))
    return path
