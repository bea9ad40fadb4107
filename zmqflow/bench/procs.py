"""Benchmark helpers: task servers in spawned processes, stopped together."""

from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

from .. import loop as zf_loop
from ..cluster import ClusterSpec
from ..server.task import AsyncServer
from ..transport.memory import keep_big_blocks

__all__ = ["Procs", "zf_task_process", "rss_bytes", "align", "script_main"]


def zf_task_process(spec_json: str, task: str, ready: Any, stop: Any) -> None:
    keep_big_blocks()  # as `zmqflow serve` does

    async def main() -> None:
        async with AsyncServer(ClusterSpec.from_json(spec_json), task):
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    zf_loop.run(main())


class Procs:
    def __init__(self) -> None:
        self.mp = multiprocessing.get_context("spawn")
        self.stop = self.mp.Event()
        self.procs: list[Any] = []

    def start(self, target: Any, *args: Any) -> None:
        ready = self.mp.Event()
        p = self.mp.Process(target=target, args=(*args, ready, self.stop), daemon=True)
        p.start()
        self.procs.append(p)
        if not ready.wait(60):
            raise RuntimeError("a benchmark server did not start within 60 s")

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def align(lines: list[list[str]]) -> list[str]:
    """Rows of cells, right-aligned in columns."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines]


def script_main(doc: str | None, run: Any, format_table: Any) -> None:
    """``python -m zmqflow.bench.<name> [--quick] [--json FILE]``."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(format_table(run(quick=args.quick, json_out=args.json)))
