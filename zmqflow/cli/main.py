"""Entry point of the ``zmqflow`` command.

Subcommands load when they run (or when help lists them): ``zmqflow serve`` is the process of
every task, and importing ``bench``, ``demo``, ``launch`` and ``deploy`` there would cost each
task server start-up time and resident memory for code it never runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from ..version import __version__

__all__ = ["main", "COMMANDS"]

# name -> module (under zmqflow.cli) defining a click command of that name
COMMANDS = {
    "serve": "serve",
    "launch": "launch",
    "status": "status",
    "bench": "bench",
    "demo": "demo",
    "keys": "keys",
    "checkpoint": "checkpoint",
    "timeline": "timeline",
    "deploy": "deploy",
    "stop": "stop",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use, from the fixed table above only."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> Any:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        return getattr(importlib.import_module(f"{__package__}.{module}"), cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="zmqflow")
def main() -> None:
    """zmqflow: a distributed training runtime on ZeroMQ."""
