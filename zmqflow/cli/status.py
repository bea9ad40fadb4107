"""``zmqflow status``: which tasks answer, and what each has been doing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from ..cluster import ClusterSpec, TaskId, resolve
from ..errors import ConfigError
from ..loop import run
from ..observe.status_reply import clean_status
from ..transport.curve import KEYS_ENV, Keys, keys_from
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, FiniteFloatRange, fail
from .probe_client import probe_client
from .status_watch import json_value, probe_rows, watch

__all__ = ["status", "cluster_status", "format_status"]


async def cluster_status(spec: ClusterSpec, timeout: float, keys: Keys | None = None,
                         tasks: Sequence[TaskId] | None = None) -> list[dict[str, Any]]:
    """One row per task (``tasks``, else every one): its status when it answered within
    ``timeout``, else ``reachable: False``."""
    if keys is not None:
        keys.learn(spec)
    client = probe_client("status", timeout, keys)
    try:
        return await probe_rows(client, spec, list(spec.tasks if tasks is None else tasks), timeout)
    finally:
        client.close()


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`cluster_status` as a plain-text table, one line per task."""
    header = ["TASK", "ADDRESS", "UP", "ROLES", "PID", "UPTIME", "STEP", "RESTARTS", "MSGS IN/OUT", "BYTES IN/OUT",
              "ERRORS", "STATE"]
    table = [header]
    for row in rows:
        r = clean_status(row)  # a field of another type (an odd peer's reply) shows as absent
        task, address = r.get("task", "?"), r.get("address", "?")
        if r.get("reachable"):
            c, p = r.get("counters", {}), r.get("progress", {})
            table.append([
                task, address, "yes", ",".join(r.get("roles", [])), str(r.get("pid", "")),
                f"{r.get('uptime_s', 0):.1f}s", str(p.get("step", "-")), str(p.get("restarts", 0)),
                f"{c.get('msgs_in', 0)}/{c.get('msgs_out', 0)}",
                f"{_size(c.get('bytes_in', 0))}/{_size(c.get('bytes_out', 0))}", str(c.get("errors", 0)),
                "; ".join(r.get("state", {}).values()) or "-",
            ])
        else:
            table.append([task, address, "NO", "-", "-", "-", "-", "-", "-", "-", "-", r.get("error", "down")])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def _tasks(spec: ClusterSpec, names: Sequence[str]) -> list[TaskId] | None:
    """The tasks ``--task`` names (each must be in the cluster), or None for every task."""
    if not names:
        return None
    tasks = []
    for name in names:
        task = TaskId.parse(name)
        spec.address(task)  # a ConfigError naming the cluster's tasks when it has no such one
        if task not in tasks:
            tasks.append(task)
    return tasks


@click.command()
@click.option("--cluster", metavar="PATH|JSON", help="Cluster spec file or inline JSON (else ZMQFLOW_CLUSTER, TF_CONFIG).")
@click.option("--task", "task_names", metavar="JOB:INDEX", multiple=True,
              help="Probe only this task (repeatable); no other task is contacted. For readiness probes.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table (with --watch: one line per refresh).")
@click.option("--timeout", type=FiniteFloatRange(min=0.01), default=2.0, show_default=True,
              help="Seconds to wait for each task.")
@click.option("--watch", "watching", is_flag=True, help="Refresh a live table (step, rates, restarts, last error) until Ctrl-C.")
@click.option("--interval", type=FiniteFloatRange(min=0.05), default=None,
              help="Seconds between refreshes with --watch [default: 2].")
@click.option("--count", type=click.IntRange(min=1), default=None, help="With --watch: stop after this many refreshes.")
@click.option("--keys", metavar="DIR", envvar=KEYS_ENV, type=click.Path(file_okay=False),
              help="CurveZMQ key directory (else ZMQFLOW_KEYS): asks as the client key.")
def status(cluster: str | None, task_names: tuple[str, ...], as_json: bool, timeout: float, watching: bool,
           interval: float | None, count: int | None, keys: str | None) -> None:
    """Show the tasks of a cluster; exit 0 only when all shown are reachable (1 if not, 2 on bad
    options). With --watch, refresh until Ctrl-C or --count, then exit 0."""
    try:
        if not watching and (interval is not None or count is not None):
            raise ConfigError("--interval and --count go with --watch")
        spec, _ = resolve(cluster, None, require_task=False)
        tasks = _tasks(spec, task_names)
        loaded = keys_from(keys, env={})
    except ConfigError as exc:
        fail("status", exc, EXIT_USAGE)
    if watching:
        try:
            run(watch(spec, tasks or spec.tasks, timeout, 2.0 if interval is None else interval, count, loaded, as_json))
        except KeyboardInterrupt:
            pass
        raise SystemExit(EXIT_OK)
    rows = run(cluster_status(spec, timeout, loaded, tasks))
    up = all(r["reachable"] for r in rows)
    if as_json:
        click.echo(json.dumps({"all_reachable": up, "tasks": rows}, indent=2, default=json_value, skipkeys=True))
    else:
        click.echo(format_status(rows))
        down = [r["task"] for r in rows if not r["reachable"]]
        if down:
            click.echo(f"\n{len(down)} of {len(rows)} tasks unreachable: {', '.join(down)}")
    raise SystemExit(EXIT_OK if up else EXIT_FAILURE)
