"""``zmqflow status --watch``: every task's step, samples/s, bytes/s, restarts and last error, live.

Each refresh probes the tasks (``master.status``, concurrently, on one client kept open) and
computes rates from the successive replies (:mod:`zmqflow.observe.rates`). On a terminal the table
is redrawn in place (rich ``Live``); elsewhere (a pipe, a log) each refresh prints one table, or
with ``--json`` one JSON line, so scripts and tests read it as text. Ctrl-C ends it with exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from ..cluster import ClusterSpec, TaskId
from ..observe.rates import RateTracker, Reading, Rates
from ..observe.status_reply import MALFORMED, clean_status
from ..rpc import RpcClient
from ..rpc.health import probe
from ..transport.curve import Keys
from .probe_client import probe_client

__all__ = ["probe_rows", "watch", "watch_cells", "WATCH_HEADER", "rate_text", "error_text", "json_value"]

WATCH_HEADER = ("TASK", "UP", "ROLES", "STEP", "STEPS/S", "SAMPLES/S", "BYTES/S", "RESTARTS", "LAST ERROR")
ERROR_CELL_CHARS = 60  # the table's last-error cell; --json carries the whole (already bounded) text
NON_TERMINAL_WIDTH = 160  # a pipe has no width: wide enough for one row per task


async def probe_rows(client: RpcClient, spec: ClusterSpec, tasks: Sequence[TaskId], timeout: float) -> list[dict[str, Any]]:
    """One row per task in ``tasks`` (only those are contacted): its status reply when it answered
    within ``timeout``, else ``reachable: False``."""
    replies = await asyncio.gather(*(probe(client, spec, t, timeout) for t in tasks))
    rows = []
    for task, reply in zip(tasks, replies):
        ours = {"task": str(task), "address": str(spec.address(task)), "reachable": isinstance(reply, dict)}
        row: dict[str, Any] = dict(ours)
        if isinstance(reply, dict):  # str keys only: the row is printed as JSON
            row.update((k, v) for k, v in reply.items() if isinstance(k, str))
        elif reply is not None:  # it answered, but not with a map: whatever it is, it is no status
            row["error"] = MALFORMED
        row.update(ours)  # last: a reply cannot claim another task, address or reachability
        rows.append(row)
    return rows


def json_value(value: Any) -> str:
    """What ``--json`` prints for a value of a reply that JSON has no form for (bytes, say)."""
    return f"<{type(value).__name__}>"


def _si(x: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(x) < 1000 or unit == "G":
            return f"{x:.1f}{unit}" if unit or x < 100 else f"{x:.0f}"
        x /= 1000
    return f"{x:.1f}"


def rate_text(value: float | None, unit: str = "") -> str:
    """A rate for a cell: ``-`` when there is no basis yet."""
    return "-" if value is None else _si(value) + unit


def error_text(progress: dict[str, Any], limit: int = ERROR_CELL_CHARS) -> str:
    """The last error for a cell: how long ago, then its text cut to ``limit`` characters. The
    age is the one the task measured on its own monotonic clock (``error_age_s``): the watcher's
    wall clock minus the task's would be off by however far the two hosts' clocks disagree."""
    text = progress.get("error")
    if not text:
        return "-"
    age_s = progress.get("error_age_s")
    age = f"{max(0.0, age_s):.0f}s ago: " if isinstance(age_s, (int, float)) else ""
    cell = age + str(text)
    return cell if len(cell) <= limit else cell[: limit - 3] + "..."


def watch_cells(row: dict[str, Any], rates: Rates) -> list[str]:
    """One table row: what a task said and the rates since its earlier replies."""
    r = clean_status(row)
    task = r.get("task", "?")
    if not r.get("reachable"):
        return [task, "NO", "-", "-", "-", "-", "-", "-", r.get("error", "-")]
    p = r.get("progress", {})
    step = p.get("step")
    return [task, "yes", ",".join(r.get("roles", [])), "-" if step is None else str(step),
            rate_text(rates.steps), rate_text(rates.samples), rate_text(rates.bytes, "B"),
            str(p.get("restarts", 0)), error_text(p)]


def _rates_of(tracker: RateTracker, rows: list[dict[str, Any]]) -> list[Rates]:
    out = []
    for row in rows:
        if row["reachable"]:
            out.append(tracker.update(row["task"], Reading.from_status(row)))
        else:
            tracker.forget(row["task"])
            out.append(Rates())
    return out


def _table(rows: list[dict[str, Any]], rates: list[Rates], title: str) -> Any:
    from rich.table import Table  # rich only when watching: a readiness probe stays quick to start

    table = Table(title=title, title_justify="left", expand=False)
    for name in WATCH_HEADER:
        table.add_column(name, no_wrap=name != "LAST ERROR", justify="right" if "/S" in name or name in ("STEP", "RESTARTS") else "left")
    for row, r in zip(rows, rates):
        table.add_row(*watch_cells(row, r))
    return table


def _json_line(n: int, rows: list[dict[str, Any]], rates: list[Rates]) -> str:
    tasks = [{**row, "rates": {"steps_per_s": r.steps, "samples_per_s": r.samples, "bytes_per_s": r.bytes}}
             for row, r in zip(rows, rates)]
    return json.dumps({"refresh": n, "time": time.time(), "tasks": tasks}, separators=(",", ":"),
                      default=json_value, skipkeys=True)


async def watch(spec: ClusterSpec, tasks: Sequence[TaskId], timeout: float, interval: float, count: int | None,
                keys: Keys | None = None, as_json: bool = False, out: TextIO | None = None) -> int:
    """Refresh every ``interval`` seconds, ``count`` times (None: until cancelled); the refreshes done."""
    from rich.console import Console
    from rich.live import Live

    stream = out or sys.stdout
    terminal = stream.isatty() and not as_json
    width = None if terminal or os.environ.get("COLUMNS") else NON_TERMINAL_WIDTH
    console = Console(file=stream, width=width)
    if keys is not None:
        keys.learn(spec)
    client = probe_client("status", timeout, keys)
    tracker = RateTracker()
    live = Live(console=console, auto_refresh=False) if terminal else None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    interrupts = _on_interrupt(loop, stop.set)
    n = 0
    try:
        if live is not None:
            live.start()
        while count is None or n < count:
            started = loop.time()
            rows = await _until(stop, probe_rows(client, spec, tasks, timeout))
            if rows is None:
                break
            rates = _rates_of(tracker, rows)
            n += 1
            up = sum(r["reachable"] for r in rows)
            title = f"zmqflow status: {up}/{len(rows)} up, refresh {n} at {time.strftime('%H:%M:%S')}"
            if as_json:
                stream.write(_json_line(n, rows, rates) + "\n")
                stream.flush()
            elif live is not None:
                live.update(_table(rows, rates, title), refresh=True)
            else:
                console.print(_table(rows, rates, title))
                stream.flush()
            if count is not None and n >= count:
                break
            if await _until(stop, asyncio.sleep(max(0.0, interval - (loop.time() - started)), True)) is None:
                break
    finally:
        interrupts()
        if live is not None:
            live.stop()
        client.close()
    return n


def _on_interrupt(loop: asyncio.AbstractEventLoop, stop: Any) -> Any:
    """Ctrl-C (SIGINT) calls ``stop`` on the loop, in the main thread; returns the undo. A watch
    ends on its own event rather than on the runner's cancellation of the main task, whose one
    cancel a call finishing at that instant can absorb."""
    import signal

    try:
        loop.add_signal_handler(signal.SIGINT, stop)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals here
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGINT)


async def _until(stop: asyncio.Event, coro: Any) -> Any:
    """``coro``'s result, or None once ``stop`` is set first (``coro`` is then cancelled)."""
    work = asyncio.ensure_future(coro)
    halt = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    return None if stop.is_set() else work.result()
