"""``zmqflow demo``: the README's main job, a local cluster training a real classifier."""

from __future__ import annotations

import signal
import sys

import click

from ..errors import ConfigError
from .common import EXIT_USAGE, fail
from .launch import Launcher, generate_cluster

__all__ = ["demo"]


@click.command()
@click.option("--strategy", type=click.Choice(["ps", "sync-ps", "ring"]), default="sync-ps", show_default=True,
              help="How gradients are combined: async or sync parameter servers, or a peer ring.")
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--ps", type=click.IntRange(0, 64), default=None, help="ps tasks (default: 1, or 0 for ring).")
@click.option("--steps", type=click.IntRange(1, 10**6), default=400, show_default=True)
@click.option("--result", type=click.Path(dir_okay=False), help="Write the chief's results as JSON here.")
def demo(strategy: str, workers: int, ps: int | None, steps: int, result: str | None) -> None:
    """Train a two-layer network on scikit-learn's handwritten digits over a local cluster and
    report the held-out accuracy, samples/s and the time per step (compute vs communication)."""
    ps = (0 if strategy == "ring" else 1) if ps is None else ps
    if strategy != "ring" and ps == 0:
        fail("demo", f"strategy {strategy} needs at least one ps task", EXIT_USAGE)
    try:
        spec = generate_cluster(workers, ps, chief=False)
    except ConfigError as exc:
        fail("demo", exc, EXIT_USAGE)
    command = [sys.executable, "-m", "zmqflow.examples.digits", "--strategy", strategy, "--steps", str(steps)]
    if result:
        command += ["--result", result]
    launcher = Launcher(spec, command, log_level="warning")
    signal.signal(signal.SIGINT, lambda s, f: launcher.signal_all(s))
    signal.signal(signal.SIGTERM, lambda s, f: launcher.signal_all(s))
    launcher.start()
    raise SystemExit(launcher.wait())
