"""A task server hands its free heap back to the OS once quiet after traffic, never while busy."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.rpc import Counters
from zmqflow.server.idle_trim import QUIET_BYTES, IdleTrim
from zmqflow.testing import free_port, wait_until

from .conftest import ZMQFLOW, arun

MB = 1 << 20


class _Process:
    """What an IdleTrim sees: counters, a CPU clock the test moves, and the trims it made."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.cpu = 0.0
        self.trims = 0
        self.trimmer = IdleTrim(self.counters, 1.0, trim=self._trim, cpu=lambda: self.cpu)

    def _trim(self) -> bool:
        self.trims += 1
        return True

    def period(self, moved: int = 0, cpu: float = 0.0) -> bool:
        """One period with ``moved`` bytes and ``cpu`` seconds in it, then the timer's look."""
        self.counters.bytes_in += moved
        self.cpu += cpu
        return self.trimmer.check()


def test_trims_once_when_quiet_after_traffic():
    p = _Process()
    assert not p.period(moved=100 * MB)  # busy: its blocks stay for the next request
    assert p.period()  # a whole quiet period: trimmed
    assert not p.period() and not p.period()  # nothing moved since: no second trim
    assert p.trims == 1 and p.counters.heap_trims == 1
    assert not p.period(moved=10 * MB) and p.period()  # traffic again, then quiet: trimmed again
    assert p.trims == 2


def test_never_trims_while_traffic_flows_or_a_thread_works():
    p = _Process()
    for _ in range(5):
        assert not p.period(moved=QUIET_BYTES)  # a steady stream of requests
    assert not p.period(cpu=0.5)  # no message, but the process is busy (a build off the loop)
    assert p.trims == 0
    assert p.period(cpu=0.01)  # quiet on both counts
    assert p.trims == 1


def test_small_messages_neither_hold_off_a_trim_nor_cause_one():
    p = _Process()
    p.period(moved=50 * MB)
    assert p.period(moved=2000)  # status polls and pings are quiet
    for _ in range(5):
        assert not p.period(moved=2000)  # and, after the trim, not worth another
    assert p.trims == 1


def test_idle_trim_needs_a_positive_period():
    with pytest.raises(ValueError, match="idle"):
        IdleTrim(Counters(), 0.0)


def test_an_async_server_with_idle_trim_counts_its_trims():
    async def main() -> None:
        spec = zf.ClusterSpec({"ps": [f"127.0.0.1:{free_port()}"]})
        async with zf.AsyncServer(spec, "ps:0", idle_trim=0.1) as server, zf.AsyncSession(server.target) as sess:
            await sess.call("worker", "echo", {"x": np.ones(MB // 4, np.float32)})  # 1 MB each way
            for _ in range(200):
                if server.counters.heap_trims:
                    break
                await asyncio.sleep(0.05)
            assert server.counters.heap_trims == 1
            assert (await sess.status())["counters"]["heap_trims"] == 1

    arun(main())


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim and /proc are Linux's")
def test_a_served_shard_gives_back_the_heap_of_big_pushes_once_idle(tmp_path, procs):
    """``zmqflow serve`` (trimming after 0.5 s quiet here): sparse pushes of 32 MB leave their
    temporaries (the duplicate-summing sort, the optimizer's) and the received requests free in
    the heap, which keeps big blocks; once nothing comes, nearly all of what the burst added goes
    back. The requests were allocated by ZeroMQ's I/O thread: in an arena of its own (before the
    process kept to one), a quarter of the burst stayed resident at that arena's top."""
    cfile = tmp_path / "cluster.json"
    cfile.write_text(json.dumps({"ps": [f"127.0.0.1:{free_port()}"]}))
    server = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "ps:0", "--idle-trim", "0.5"])
    server.wait_for_line("serving ps:0", 30)
    pid = server.proc.pid
    with zf.Session(cluster=zf.ClusterSpec.from_file(cfile), task="ps:0", timeout=60) as sess:
        v = sess.variable("table", shape=(65536, 256), dtype="float32", optimizer=zf.optim.SGD(0.1))
        ids = np.arange(0, 65536, 2)
        v.read()
        before = _rss(pid)
        for _ in range(3):
            v.push((ids, np.ones((len(ids), 256), np.float32)))
        burst = _rss(pid)
        assert burst - before > 64 * MB, (before, burst)  # the pushes did leave free heap behind
        wait_until(lambda: _rss(pid) < burst - (burst - before) * 7 // 8, 30, interval=0.1,
                   what=f"the pushes' heap given back (resident {before >> 20} MiB before, {burst >> 20} MiB after)")
        assert sess.status("ps:0")["counters"]["heap_trims"] >= 1
