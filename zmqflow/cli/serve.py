"""``zmqflow serve``: one task's server, until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

import click

from ..cluster import ClusterSpec, TaskId, resolve
from ..errors import AddressInUse, ConfigError, ZmqflowError
from ..loop import run
from ..server.task import AsyncServer
from ..transport.memory import keep_big_blocks
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, LOG_LEVELS, fail, setup_logging

log = logging.getLogger("zmqflow.serve")

STOP_TIMEOUT = 1.5  # the process must be gone within 2 s of the signal


@click.command()
@click.option("--cluster", "cluster", metavar="PATH|JSON", help="Cluster spec file or inline JSON (else ZMQFLOW_CLUSTER, TF_CONFIG).")
@click.option("--task", "task", metavar="JOB:INDEX", help="This process's task (else ZMQFLOW_TASK, TF_CONFIG).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--allow-module", "allow_modules", multiple=True, metavar="MODULE",
              help="Modules (and their submodules) whose functions sessions may run here; repeatable "
                   "(else ZMQFLOW_ALLOW_MODULES, comma-separated).")
@click.option("--checkpoint-root", "checkpoint_roots", multiple=True, metavar="DIR",
              help="A directory a ps task may write checkpoints under; repeatable, replaces any default "
                   "(else ZMQFLOW_CHECKPOINT_ROOTS, os.pathsep-separated; '*' means anywhere). Without one, "
                   "saves are refused.")
def serve(cluster: str | None, task: str | None, log_level: str, allow_modules: tuple[str, ...],
          checkpoint_roots: tuple[str, ...]) -> None:
    """Serve one task of a cluster until SIGTERM or SIGINT."""
    try:
        spec, tid = resolve(cluster, task)
    except ConfigError as exc:
        fail("serve", exc, EXIT_USAGE)
    assert tid is not None
    setup_logging(log_level, str(tid))
    keep_big_blocks()
    try:
        code = run(_serve(spec, tid, list(allow_modules) or None, list(checkpoint_roots) or None))
    except ZmqflowError as exc:
        fail("serve", exc, EXIT_FAILURE)
    raise SystemExit(code)


async def _serve(spec: ClusterSpec, tid: TaskId, allow_modules: list[str] | None,
                 checkpoint_roots: list[str] | None = None) -> int:
    server = AsyncServer(spec, tid, allow_modules=allow_modules, checkpoint_roots=checkpoint_roots)
    try:
        await server.start()
    except AddressInUse as exc:
        fail("serve", exc, EXIT_FAILURE)
    except ConfigError as exc:
        fail("serve", exc, EXIT_USAGE)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %s at %s (services: %s) in cluster %s", tid, server.target, ", ".join(server.service_names()), spec.to_json())
    await stop.wait()
    log.info("stopping %s", tid)
    try:
        await asyncio.wait_for(server.stop(), STOP_TIMEOUT)
    except TimeoutError:
        log.warning("%s did not stop cleanly within %.1fs", tid, STOP_TIMEOUT)
    return EXIT_OK
