"""The process groups ``zmqflow launch`` starts, and tasks that end with launch.

Each task runs in its own session, so its process group holds whatever it started (a data
loader, a multiprocessing pool, a shell pipeline). When a task's main process exits, what it left
in its group could keep the task's port or files, so launch ends that group before it restarts
or reports the task; and :class:`ProcessGroups` remembers every group that may still hold
processes, so launch's stop ends them all, not only the current runs'.

Tasks live in other sessions, so a launch killed outright (the OOM killer, ``kill -9``) would leave
them running; on Linux each is started with a parent-death signal (:func:`die_with`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection

__all__ = ["ProcessGroups", "die_with", "GROUP_GRACE"]

GROUP_GRACE = 2.0  # after SIGTERM, how long a group's processes may take to exit before SIGKILL
REAP_WAIT = 1.0  # after SIGKILL, how long to wait for them to be gone (their new parent reaps them)
POLL_S = 0.02
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _signal_group(pgid: int, sig: int) -> bool:
    """``sig`` to the group; whether it still has a process (one launch may signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class ProcessGroups:
    """The groups launch started that may still hold processes, each forgotten once seen empty."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()

    def add(self, pgid: int) -> None:
        with self._lock:
            self._live.add(pgid)

    def signal(self, sig: int, skip: Collection[int] = ()) -> None:
        """``sig`` to every group still held but those in ``skip`` (already signalled); the empty ones
        are forgotten (their ids may be reused)."""
        with self._lock:
            self._live = {g for g in self._live if _signal_group(g, 0 if g in skip else sig)}

    def end(self, pgid: int, grace: float = GROUP_GRACE) -> None:
        """SIGTERM to ``pgid``, SIGKILL to what is left after ``grace`` seconds; returns once the group
        is empty (or a short while after the kill). Blocks: call it where waiting is the job."""
        if _signal_group(pgid, signal.SIGTERM) and not self._gone([pgid], time.monotonic() + grace):
            _signal_group(pgid, signal.SIGKILL)
            self._gone([pgid], time.monotonic() + REAP_WAIT)
        with self._lock:
            if not _signal_group(pgid, 0):
                self._live.discard(pgid)

    def kill_left(self, deadline: float) -> None:
        """SIGKILL to what is left in every group still held at ``deadline`` (monotonic), polling
        until then for them to empty by themselves (they were sent SIGTERM)."""
        with self._lock:
            groups = list(self._live)
        if not self._gone(groups, deadline):
            self.signal(signal.SIGKILL)
            with self._lock:
                groups = list(self._live)
            self._gone(groups, time.monotonic() + REAP_WAIT)
        self.signal(0)

    @staticmethod
    def _gone(groups: list[int], deadline: float) -> bool:
        """Whether every one of ``groups`` is empty by ``deadline``, polling until then."""
        while True:
            groups = [g for g in groups if _signal_group(g, 0)]
            if not groups:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, loaded before any fork (the child should do as little as it can)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def die_with(launcher_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child SIGTERM when its parent goes, so a launch killed outright
    leaves no task behind; None where ``prctl`` is missing (not Linux): tasks then outlive it.

    The signal comes when the *thread* that forked the child ends, not the process: start children
    only from a thread that outlives them. If the launcher died before the call took effect, the
    child is already another's and exits at once."""
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != launcher_pid:
            os._exit(128 + signal.SIGTERM)

    return preexec
