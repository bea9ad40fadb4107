"""What a benchmark ran on, and how busy the machine was meanwhile (Linux ``/proc``; ``None`` or 0
where unknown): figures from a shared or busy machine are only comparable within one run."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from .. import loop as zf_loop

__all__ = ["OtherLoad", "cpu_idle_fraction", "cpu_seconds", "machine_info", "proc_field", "rss_bytes"]


def proc_field(path: str, key: str) -> str | None:
    """The value of ``key: value`` in a /proc file such as /proc/cpuinfo."""
    try:
        with open(path) as fh:
            for line in fh:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, 0 where unknown."""
    value = proc_field(f"/proc/{pid}/status", "VmRSS")  # "123456 kB"
    return int(value.split()[0]) * 1024 if value and value.split()[0].isdigit() else 0


def cpu_seconds(pids: Sequence[int]) -> float | None:
    """Seconds on a CPU so far of the processes ``pids``, every thread counted (ended ones too):
    each process's CPU-time clock, as ``clock_getcpuclockid`` names it, read with
    ``clock_gettime``, which brings a running thread's time up to date (``/proc``'s counters lag
    it by up to a scheduler tick, a large part of a 20 ms phase). None where a process cannot be
    read (gone) or off Linux, where the clock's id is not this one."""
    if not sys.platform.startswith("linux"):
        return None
    total = 0.0
    for pid in pids:
        try:  # Linux's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
            total += time.clock_gettime(((~pid) << 3) | 2)
        except OSError:
            return None
    return total


def machine_info() -> dict[str, Any]:
    """CPUs, memory and the versions of everything on the message path."""
    import msgpack

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": proc_field("/proc/cpuinfo", "model name"),
        "mem_total_gib": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "numpy": np.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "uvloop": None,
        "uvloop_used": None,
    }
    mem = proc_field("/proc/meminfo", "MemTotal")
    if mem and mem.split()[0].isdigit():
        info["mem_total_gib"] = round(int(mem.split()[0]) / (1 << 20), 1)
    if zf_loop.uvloop_available():
        import uvloop

        info["uvloop"] = getattr(uvloop, "__version__", "?")
    return info


def cpu_idle_fraction(seconds: float = 0.5) -> float | None:
    """Fraction of all CPUs idle over ``seconds`` (from /proc/stat): how quiet the machine is."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)

    a = sample()
    time.sleep(seconds)
    b = sample()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


class OtherLoad:
    """CPU used by processes outside this one and its children while a measurement runs, in CPUs
    (0.0: the machine was ours; 1.0: another process kept a whole core busy)."""

    _HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self._start = self._sample()
        self._t0 = time.perf_counter()

    @staticmethod
    def _sample() -> dict[int, tuple[int, int]] | None:
        """pid -> (parent pid, user + system ticks) for every process."""
        out: dict[int, tuple[int, int]] = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            return None
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        return out

    def cpus(self) -> float | None:
        """CPUs the other processes kept busy since this object was made."""
        end, elapsed = self._sample(), time.perf_counter() - self._t0
        if self._start is None or end is None or elapsed <= 0:
            return None
        start, me = self._start, os.getpid()

        def ours(pid: int) -> bool:
            for _ in range(32):
                if pid == me:
                    return True
                parent = end.get(pid, start.get(pid, (0, 0)))[0]
                if parent <= 1:
                    return False
                pid = parent
            return False

        ticks = sum(t - start.get(pid, (0, 0))[1] for pid, (_, t) in end.items() if not ours(pid))
        return max(0.0, ticks / self._HZ / elapsed)
