"""What every subcommand shares: logging set-up and the exit codes (0 ok, 1 failure, 2 usage)."""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any, NoReturn

import click

__all__ = ["EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "setup_logging", "fail", "LOG_LEVELS", "TAGGED_ENV",
           "FiniteFloatRange"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
LOG_LEVELS = ("debug", "info", "warning", "error")
# Set by ``zmqflow launch``, which already tags each line with its task: log lines then omit theirs.
TAGGED_ENV = "ZMQFLOW_OUTPUT_TAGGED"


def setup_logging(level: str, task: str = "") -> None:
    prefix = f"[{task}] " if task and os.environ.get(TAGGED_ENV) != "1" else ""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def fail(command: str, message: object, code: int) -> NoReturn:
    """One line on stderr, then exit with ``code``."""
    click.echo(f"zmqflow {command}: {message}", err=True)
    sys.exit(code)


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` without ``nan`` and ``inf``, which it lets through (``nan`` compares
    false with every bound): a usage error naming the option, not a loop that never ends."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
