"""Entry point of the ``zmqflow`` command."""

from __future__ import annotations

import click

from ..version import __version__
from .bench import bench
from .checkpoint import checkpoint
from .demo import demo
from .deploy import deploy
from .keys import keys
from .launch import launch
from .serve import serve
from .status import status
from .timeline import timeline
from .stop import stop

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="zmqflow")
def main() -> None:
    """zmqflow: a distributed training runtime on ZeroMQ."""


main.add_command(serve)
main.add_command(launch)
main.add_command(status)
main.add_command(bench)
main.add_command(demo)
main.add_command(keys)
main.add_command(checkpoint)
main.add_command(timeline)
main.add_command(deploy)
main.add_command(stop)
