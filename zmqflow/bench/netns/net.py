"""Building and removing the simulated network with ``ip`` and ``tc``: a check that the machine
allows it, a context manager that always takes down what it built, and a sweep of leftovers.

Deleting a namespace deletes the veth ends and the bridge inside it; a namespace that still holds
processes lives on unnamed until they exit, so teardown ends the run's processes first (those
``ip netns pids`` names: only this benchmark's tasks run there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Self

from ...errors import InvalidArgument, Unavailable
from .plan import FAMILY, Topology

__all__ = ["Network", "check_netns", "cleanup", "list_namespaces", "run_cmd"]

_CMD_TIMEOUT = 30.0


def run_cmd(argv: Sequence[str], timeout: float = _CMD_TIMEOUT) -> str:
    """Run ``argv``; its stdout, or Unavailable naming the command and what it printed."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"`{' '.join(argv)}` could not run: {exc}") from None
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def check_netns(ip: str = "ip", tc: str = "tc", family: str = FAMILY) -> None:
    """Unavailable, saying why, unless this process may build the network: root, ``ip`` and ``tc``
    found, and ``ip netns add`` working (it fails in many containers even as root)."""
    for tool in (ip, tc):
        if shutil.which(tool) is None:
            raise Unavailable(f"network namespaces need iproute2's `{tool}`, which was not found (install iproute2)")
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root (`ip netns add` and `tc` change the kernel's networking); "
                          "run as root, or drop --netns to run on loopback without link limits")
    probe = f"{family}-probe{os.getpid()}"
    try:
        run_cmd([ip, "netns", "add", probe])
    except Unavailable as exc:
        raise Unavailable(f"this machine does not allow network namespaces: {exc}") from None
    run_cmd([ip, "netns", "delete", probe])


def list_namespaces(ip: str = "ip") -> list[str]:
    """Names of the machine's network namespaces (``ip netns list`` lines are ``name (id: N)``)."""
    return [line.split()[0] for line in run_cmd([ip, "netns", "list"]).splitlines() if line.strip()]


def _end_processes(ns: str, ip: str, grace: float = 3.0) -> None:
    """SIGTERM the processes in ``ns``, then SIGKILL what is left after ``grace`` seconds."""

    def pids() -> list[int]:
        try:
            return [int(p) for p in run_cmd([ip, "netns", "pids", ns]).split() if p.isdigit()]
        except Unavailable:
            return []

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        left = pids()
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)


def _delete(namespaces: Sequence[str], ip: str) -> list[str]:
    """Delete ``namespaces`` (task namespaces first, the bridge's last); the ones that remain."""
    for ns in namespaces:
        _end_processes(ns, ip)
    for ns in namespaces:
        with contextlib.suppress(Unavailable):
            run_cmd([ip, "netns", "delete", ns])
    present = set(list_namespaces(ip))
    return [ns for ns in namespaces if ns in present]


def cleanup(family: str = FAMILY, ip: str = "ip") -> list[str]:
    """Remove every namespace named ``<family>-...`` (any run's, a run in progress included) and
    end the processes in them; returns the names removed."""
    if not family or "-" in family:
        raise InvalidArgument(f"cleanup needs a family without '-', got {family!r}")
    ours = sorted(sorted(ns for ns in list_namespaces(ip) if ns.startswith(family + "-")),
                  key=lambda ns: ns.endswith("-br"))  # bridges last
    left = _delete(ours, ip)
    if left:
        raise Unavailable(f"could not remove namespaces {left}")
    return ours


class Network:
    """The topology, built on entry and removed on exit (an exception, Ctrl-C included)."""

    def __init__(self, topo: Topology, ip: str = "ip", tc: str = "tc"):
        self.topo, self.ip, self.tc = topo, ip, tc
        self.rate_bits: float | None = None

    def __enter__(self) -> Self:
        try:
            for argv in self.topo.setup_commands(self.ip):
                run_cmd(argv)
        except BaseException:
            with contextlib.suppress(Unavailable):  # the first error is the one to see
                self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_rate(self, rate_bits: float) -> None:
        """Limit every link to ``rate_bits`` bit/s each way (replacing the previous limit)."""
        for argv in self.topo.rate_commands(rate_bits, self.tc):
            run_cmd(argv)
        self.rate_bits = rate_bits

    def close(self) -> None:
        names = self.topo.namespaces()
        left = _delete(names[1:] + names[:1], self.ip)
        if left:
            raise Unavailable(f"could not remove namespaces {left}; `zmqflow bench cluster --cleanup` retries")
