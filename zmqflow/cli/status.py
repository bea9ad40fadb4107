"""``zmqflow status``: which tasks answer, and what each has been doing."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import click

from ..cluster import ClusterSpec, resolve
from ..errors import ConfigError
from ..loop import run
from ..rpc import RpcClient
from ..rpc.health import probe
from ..transport.curve import KEYS_ENV, Keys, keys_from
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail

__all__ = ["status", "cluster_status", "format_status"]


async def cluster_status(spec: ClusterSpec, timeout: float, keys: Keys | None = None) -> list[dict[str, Any]]:
    """One row per task: its status when it answered within ``timeout``, else ``reachable: False``."""
    if keys is not None:
        keys.learn(spec)
    client = RpcClient(identity=f"status-{uuid.uuid4().hex[:8]}", default_timeout=timeout, keys=keys)
    try:
        replies = await asyncio.gather(*(probe(client, spec, t, timeout) for t in spec.tasks))
    finally:
        client.close()
    rows = []
    for task, reply in zip(spec.tasks, replies):
        row: dict[str, Any] = {"task": str(task), "address": str(spec.address(task)), "reachable": reply is not None}
        if reply is not None:
            row.update({k: v for k, v in reply.items() if k not in ("task", "address")})
        rows.append(row)
    return rows


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(rows: list[dict[str, Any]]) -> str:
    header = ["TASK", "ADDRESS", "UP", "ROLES", "PID", "UPTIME", "MSGS IN/OUT", "BYTES IN/OUT", "ERRORS", "STATE"]
    table = [header]
    for r in rows:
        if r["reachable"]:
            c = r.get("counters", {})
            table.append([
                r["task"], r["address"], "yes", ",".join(r.get("roles", [])), str(r.get("pid", "")),
                f"{r.get('uptime_s', 0):.1f}s", f"{c.get('msgs_in', 0)}/{c.get('msgs_out', 0)}",
                f"{_size(c.get('bytes_in', 0))}/{_size(c.get('bytes_out', 0))}", str(c.get("errors", 0)),
                "; ".join(r.get("state", {}).values()) or "-",
            ])
        else:
            table.append([r["task"], r["address"], "NO", "-", "-", "-", "-", "-", "-", "down"])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


@click.command()
@click.option("--cluster", metavar="PATH|JSON", help="Cluster spec file or inline JSON (else ZMQFLOW_CLUSTER, TF_CONFIG).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--timeout", type=click.FloatRange(min=0.01), default=2.0, show_default=True, help="Seconds to wait for each task.")
@click.option("--keys", metavar="DIR", envvar=KEYS_ENV, type=click.Path(file_okay=False),
              help="CurveZMQ key directory (else ZMQFLOW_KEYS): asks as the client key.")
def status(cluster: str | None, as_json: bool, timeout: float, keys: str | None) -> None:
    """Show every task of a cluster; exit 0 only when all are reachable."""
    try:
        spec, _ = resolve(cluster, None, require_task=False)
        loaded = keys_from(keys, env={})
    except ConfigError as exc:
        fail("status", exc, EXIT_USAGE)
    rows = run(cluster_status(spec, timeout, loaded))
    up = all(r["reachable"] for r in rows)
    if as_json:
        click.echo(json.dumps({"all_reachable": up, "tasks": rows}, indent=2))
    else:
        click.echo(format_status(rows))
        down = [r["task"] for r in rows if not r["reachable"]]
        if down:
            click.echo(f"\n{len(down)} of {len(rows)} tasks unreachable: {', '.join(down)}")
    raise SystemExit(EXIT_OK if up else EXIT_FAILURE)
