"""``zmqflow demo``: the README's main job, a local cluster doing real work end to end."""

from __future__ import annotations

import signal
import sys

import click

from ..errors import ConfigError
from .common import EXIT_USAGE, fail
from .launch import Launcher, generate_cluster

__all__ = ["demo"]


@click.command()
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--ps", type=click.IntRange(0, 64), default=1, show_default=True)
@click.option("--mib", type=click.IntRange(1, 1024), default=16, show_default=True, help="Size of the tensor moved.")
def demo(workers: int, ps: int, mib: int) -> None:
    """Launch a local cluster, show its status, and move a tensor between every pair of tasks."""
    try:
        spec = generate_cluster(workers, ps, chief=False)
    except ConfigError as exc:
        fail("demo", exc, EXIT_USAGE)
    command = [sys.executable, "-m", "zmqflow.examples.roundtrip", "--mib", str(mib)]
    launcher = Launcher(spec, command, log_level="warning")
    signal.signal(signal.SIGINT, lambda s, f: launcher.signal_all(s))
    signal.signal(signal.SIGTERM, lambda s, f: launcher.signal_all(s))
    launcher.start()
    raise SystemExit(launcher.wait())
