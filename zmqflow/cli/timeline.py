"""``zmqflow timeline merge OUT FILE...``: join the per-task timeline files into one trace."""

from __future__ import annotations

import glob
import os

import click

from ..errors import ZmqflowError
from ..observe.trace_files import merge as merge_traces
from ..observe.trace_files import write_trace
from .common import EXIT_FAILURE, EXIT_USAGE, fail

__all__ = ["timeline"]


@click.group("timeline")
def timeline() -> None:
    """Chrome traces of what the tasks did (recorded with ZMQFLOW_TIMELINE=FILE)."""


@timeline.command("merge")
@click.argument("out", type=click.Path(dir_okay=False))
@click.argument("files", nargs=-1, required=True)
def merge(out: str, files: tuple[str, ...]) -> None:
    """Join FILES (paths or quoted globs such as 'timeline.*.json') into OUT, one process track per
    task, for chrome://tracing or https://ui.perfetto.dev. Files of killed processes are read up to
    their last whole event."""
    # Compared by real path: OUT spelled another way (./x, an absolute path, a link) than a glob's
    # match is still OUT, and a file named twice is one file; either, read again, repeats its events.
    paths: list[str] = []
    seen = {os.path.realpath(out)}
    for f in files:
        found = sorted(glob.glob(f)) if glob.has_magic(f) else [f]
        if not found:
            fail("timeline merge", f"no file matches {f!r}", EXIT_USAGE)
        for p in found:
            real = os.path.realpath(p)
            if real not in seen:
                seen.add(real)
                paths.append(p)
    try:
        events = merge_traces(paths)
        write_trace(out, events, paths)
    except (ZmqflowError, OSError) as exc:
        fail("timeline merge", exc, EXIT_FAILURE)
    tasks = sum(1 for e in events if e.get("ph") == "M" and e.get("name") == "process_name")
    click.echo(f"{out}: {len(events)} events of {tasks} task(s) from {len(paths)} file(s)")
