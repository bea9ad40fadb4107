"""``zmqflow demo``: the README's main job, a local cluster training a real model.

``--model digits`` (the default) trains a classifier on scikit-learn's handwritten digits with
the strategy chosen; ``--model dlrm`` trains a DLRM-style click model on a synthetic
Criteo-shaped log with its tables on ps shards and its dense gradients averaged by ring, and
compares its held-out AUC with the same model trained by plain torch in one process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import click

from ..errors import ConfigError
from .common import EXIT_OK, EXIT_USAGE, fail
from .launch import Launcher, generate_cluster

__all__ = ["demo"]

DIGITS_STEPS = 400


@click.command()
@click.option("--model", type=click.Choice(["digits", "dlrm"]), default="digits", show_default=True,
              help="digits: a classifier on handwritten digits; dlrm: a click model, tables on ps shards.")
@click.option("--strategy", type=click.Choice(["ps", "sync-ps", "ring"]), default="sync-ps", show_default=True,
              help="digits: how gradients are combined (async or sync parameter servers, or a peer ring). "
                   "dlrm always runs hybrid: tables on ps shards, dense gradients by ring.")
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--ps", type=click.IntRange(0, 64), default=None,
              help="ps tasks (default: digits 1, or 0 for ring; dlrm 2).")
@click.option("--steps", type=click.IntRange(1, 10**6), default=None,
              help=f"training steps (default: digits {DIGITS_STEPS}, dlrm 400).")
@click.option("--batch", type=click.IntRange(1, 10**6), default=None,
              help="dlrm: global batch over all workers (default 1024).")
@click.option("--samples", type=click.IntRange(1, 10**8), default=None,
              help="dlrm: training examples to generate (default 400000).")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="dlrm: also train the single-process torch reference and print its AUC.")
@click.option("--result", type=click.Path(dir_okay=False), help="Write the chief's results as JSON here.")
def demo(model: str, strategy: str, workers: int, ps: int | None, steps: int | None, batch: int | None,
         samples: int | None, reference: bool, result: str | None) -> None:
    """Train a model over a local cluster and report its held-out quality, samples/s and the time
    per step split into compute and communication."""
    if model == "dlrm":
        raise SystemExit(_dlrm(workers, 2 if ps is None else ps, steps, batch, samples, reference, result))
    ps = (0 if strategy == "ring" else 1) if ps is None else ps
    if strategy != "ring" and ps == 0:
        fail("demo", f"strategy {strategy} needs at least one ps task", EXIT_USAGE)
    command = [sys.executable, "-m", "zmqflow.examples.digits", "--strategy", strategy,
               "--steps", str(steps or DIGITS_STEPS)]
    if result:
        command += ["--result", result]
    raise SystemExit(_run(workers, ps, command))


def _run(workers: int, ps: int, command: list[str]) -> int:
    try:
        spec = generate_cluster(workers, ps, chief=False)
    except ConfigError as exc:
        fail("demo", exc, EXIT_USAGE)
    launcher = Launcher(spec, command, log_level="warning")
    signal.signal(signal.SIGINT, lambda s, f: launcher.interrupt(s))
    signal.signal(signal.SIGTERM, lambda s, f: launcher.interrupt(s))
    launcher.start()
    return launcher.wait()


def _dlrm(workers: int, ps: int, steps: int | None, batch: int | None, samples: int | None, reference: bool,
          result: str | None) -> int:
    """Run the DLRM script on every worker, then print its summary untagged (it starts ``AUC``)."""
    if ps == 0:
        fail("demo", "the dlrm model keeps its tables on ps tasks: give --ps 1 or more", EXIT_USAGE)
    batch = batch if batch is not None else 1024
    if batch % workers:
        fail("demo", f"--batch {batch} does not split evenly over {workers} workers", EXIT_USAGE)
    fd, path = tempfile.mkstemp(prefix="zmqflow-dlrm-", suffix=".json")
    os.close(fd)
    try:
        command = [sys.executable, "-m", "zmqflow.examples.dlrm.train", "--batch", str(batch), "--result", path,
                   "--quiet"]
        if steps is not None:
            command += ["--steps", str(steps)]
        if samples is not None:
            command += ["--samples", str(samples)]
        if not reference:
            command.append("--no-reference")
        code = _run(workers, ps, command)
        if code != EXIT_OK:
            return code
        with open(path) as fh:
            found = json.load(fh)
        if result:
            with open(result, "w") as fh:
                json.dump(found, fh)
        click.echo(found["summary"])
        return EXIT_OK
    finally:
        os.unlink(path)
