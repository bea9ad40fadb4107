"""``zmqflow serve``: one task's server, until SIGTERM or SIGINT, ``zmqflow stop``, or (with
``--exit-when-done``) the end of training; each stops it the same way and exits 0."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
from fractions import Fraction
from typing import Any

import click

from ..cluster import ClusterSpec, TaskId, resolve
from ..errors import AddressInUse, ConfigError, ZmqflowError
from ..loop import run
from ..observe.endpoint import start_for as start_metrics
from ..server.idle_trim import IDLE_TRIM
from ..server.limits import ServerLimits
from ..server.task import AsyncServer
from ..transport.memory import keep_big_blocks, settle_gc
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, LOG_LEVELS, FiniteFloatRange, fail, setup_logging

log = logging.getLogger("zmqflow.serve")

STOP_TIMEOUT = 1.5  # the process must be gone within 2 s of the signal
MAX_SIZE = (1 << 63) - 1  # libzmq takes sizes (MAXMSGSIZE) as int64


class SizeParam(click.ParamType):
    """A ``--max-*-bytes`` value: a usage error naming the flag, not a traceback from libzmq."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        if size < 1:
            self.fail(f"{value!r} is under one byte", param, ctx)
        return size


SIZE = SizeParam()


@click.command()
@click.option("--cluster", "cluster", metavar="PATH|JSON", help="Cluster spec file or inline JSON (else ZMQFLOW_CLUSTER, TF_CONFIG).")
@click.option("--task", "task", metavar="JOB:INDEX", help="This process's task (else ZMQFLOW_TASK, TF_CONFIG).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--allow-module", "allow_modules", multiple=True, metavar="MODULE",
              help="Modules (and their submodules) whose functions sessions may run here; repeatable "
                   "(else ZMQFLOW_ALLOW_MODULES, comma-separated).")
@click.option("--debug", is_flag=True, help="Error replies carry the server's tracebacks (never on an open network).")
@click.option("--max-deadline", type=FiniteFloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Longest any request may run; the deadline of one naming none (3600).")
@click.option("--max-in-flight", type=click.IntRange(min=1), metavar="N",
              help="Requests one peer may have running at once (4096).")
@click.option("--max-run-threads", type=click.IntRange(min=1), metavar="N",
              help="Plain functions worker.run may have running at once, each until it returns (128).")
@click.option("--max-frame-bytes", type=SIZE, metavar="SIZE",
              help="Largest tensor frame taken (2GiB); libzmq cuts frames 64 MiB over it.")
@click.option("--max-variable-bytes", type=SIZE, metavar="SIZE", help="Largest variable, all parts (256GiB).")
@click.option("--max-shard-bytes", type=SIZE, metavar="SIZE",
              help="Bytes a shard may hold, values and optimizer slots (physical memory).")
@click.option("--max-variables", type=click.IntRange(min=1), metavar="N",
              help="Variables in the catalog, and parts per shard (262144).")
@click.option("--table-capacity", type=click.IntRange(min=1), metavar="ROWS",
              help="Rows per dynamic table part that names no capacity (16777216).")
@click.option("--keys", "keys", metavar="DIR", envvar="ZMQFLOW_KEYS", type=click.Path(file_okay=False),
              help="CurveZMQ key directory (zmqflow keys generate; else ZMQFLOW_KEYS): only listed keys get in.")
@click.option("--insecure", is_flag=True, envvar="ZMQFLOW_INSECURE",
              help="Without keys, serve a non-loopback address anyway (unauthenticated, unencrypted).")
@click.option("--checkpoint-root", "checkpoint_roots", multiple=True, metavar="DIR",
              help="A directory a ps task may write checkpoints under; repeatable, replaces any default "
                   "(else ZMQFLOW_CHECKPOINT_ROOTS, os.pathsep-separated; '*' means anywhere). Without one, "
                   "saves are refused.")
@click.option("--metrics-port", type=int, metavar="PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics, HOST the task's own (else ZMQFLOW_METRICS_HOST); "
                   "read-only and unauthenticated. Else ZMQFLOW_METRICS_PORT, plus the task's position on its host.")
@click.option("--exit-when-done", is_flag=True, envvar="ZMQFLOW_EXIT_WHEN_DONE",
              help="Exit 0 once every chief and worker task finished training (for ps tasks; else "
                   "ZMQFLOW_EXIT_WHEN_DONE=1).")
@click.option("--idle-trim", type=FiniteFloatRange(min=0), default=IDLE_TRIM, show_default=True, metavar="SECONDS",
              help="After this long with next to no traffic (under 64 KiB), hand the heap's free pages back to "
                   "the OS, once (0: never; the heap then stays as big as the biggest requests made it).")
def serve(cluster: str | None, task: str | None, log_level: str, allow_modules: tuple[str, ...], debug: bool,
          keys: str | None, insecure: bool, checkpoint_roots: tuple[str, ...], metrics_port: int | None,
          exit_when_done: bool, idle_trim: float,
          **limits: object) -> None:
    """Serve one task of a cluster until SIGTERM or SIGINT."""
    try:
        spec, tid = resolve(cluster, task)
        server_limits = limits_from_flags(limits)
    except ConfigError as exc:
        fail("serve", exc, EXIT_USAGE)
    assert tid is not None
    setup_logging(log_level, str(tid))
    keep_big_blocks()
    try:  # before the server, so it is made with metrics on
        endpoint = start_metrics(spec, tid, metrics_port)
    except ZmqflowError as exc:  # a port taken or out of range: the operator's to fix
        fail("serve", exc, EXIT_USAGE)
    if endpoint is not None:
        log.info("metrics at %s", endpoint.url)
    try:
        code = run(_serve(spec, tid, list(allow_modules) or None, server_limits, debug, keys, insecure,
                          list(checkpoint_roots) or None, exit_when_done=exit_when_done, idle_trim=idle_trim or None))
    except ZmqflowError as exc:
        fail("serve", exc, EXIT_FAILURE)
    raise SystemExit(code)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``4GiB``, ``64MiB``, ``1.5GB``, ``1048576``: a number of bytes, at most what libzmq takes.
    Computed exactly (a float would turn a long digit string into inf, then OverflowError)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text) if isinstance(text, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{text!r} is not a size (e.g. 1048576, 64MiB, 4GiB)")
    if len(m.group(1)) > 40:  # far past int64 whatever the unit: not worth the arithmetic
        raise ConfigError(f"{text[:40]!r}... is more than the largest size libzmq takes ({MAX_SIZE} bytes)")
    size = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    if size > MAX_SIZE:
        raise ConfigError(f"{text!r} is {size} bytes, more than the largest size libzmq takes ({MAX_SIZE} bytes)")
    return size


def limits_from_flags(flags: dict[str, object]) -> ServerLimits:
    """ServerLimits from the flags given (the rest at their defaults); a size is a ``parse_size``
    text or bytes already parsed."""
    given: dict[str, object] = {}
    for key, value in flags.items():
        if value is None:
            continue
        if key.endswith("_bytes") and not isinstance(value, int):
            try:
                value = parse_size(value)  # type: ignore[arg-type]
            except ConfigError as exc:
                raise ConfigError(f"--{key.replace('_', '-')}: {exc}") from None
        given[key] = value
    try:
        return dataclasses.replace(ServerLimits(), **given)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


async def _serve(spec: ClusterSpec, tid: TaskId, allow_modules: list[str] | None, limits: ServerLimits,
                 debug: bool, keys: str | None, insecure: bool, checkpoint_roots: list[str] | None = None, *,
                 exit_when_done: bool = False, idle_trim: float | None = None) -> int:
    try:
        server = AsyncServer(spec, tid, allow_modules=allow_modules, limits=limits, debug=debug, keys=keys,
                             insecure=insecure, checkpoint_roots=checkpoint_roots, exit_when_done=exit_when_done,
                             idle_trim=idle_trim)
    except ConfigError as exc:
        fail("serve", exc, EXIT_USAGE)
    try:
        await server.start()
    except AddressInUse as exc:
        fail("serve", exc, EXIT_FAILURE)
    except ConfigError as exc:
        fail("serve", exc, EXIT_USAGE)
    settle_gc()  # what start-up made lives as long as the server: out of the collector's sight
    stop = asyncio.Event()
    server.stop_handler = lambda _reason: stop.set()  # zmqflow stop, or training done: as on SIGTERM
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %s at %s (services: %s; %s) in cluster %s", tid, server.target, ", ".join(server.service_names()),
             f"CurveZMQ keys from {server.keys.directory}" if server.keys else "no keys", spec.to_json())
    await stop.wait()
    log.info("stopping %s%s", tid, f" ({server.stop_reason})" if server.stop_reason else "")
    try:
        await asyncio.wait_for(server.stop(), STOP_TIMEOUT)
    except TimeoutError:
        log.warning("%s did not stop cleanly within %.1fs", tid, STOP_TIMEOUT)
    return EXIT_OK
