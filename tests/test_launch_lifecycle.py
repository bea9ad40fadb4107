"""``zmqflow launch`` when its tasks or its own output misbehave: a task whose process exits while
something it started holds its output open, output nobody reads, signals other than Ctrl-C, and
commands or flags with nowhere to go. Real launch processes, or a real Launcher, throughout."""

from __future__ import annotations

import signal
import sys
import threading
import time

from zmqflow.cli.launch import Launcher
from zmqflow.cluster import ClusterSpec
from zmqflow.testing import free_port

from .conftest import ZMQFLOW, pid_alive

LINGERER = "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print('child', p.pid, flush=True); sys.exit(3)"


def test_a_task_that_exits_is_seen_at_once_though_what_it_started_holds_its_output(procs):
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--", sys.executable, "-c", LINGERER])
    sleeper = int(p.wait_for_line("[worker:0] child ", 60).split()[2])
    started = time.monotonic()
    assert p.wait(30) == 3, p.output
    assert time.monotonic() - started < 20 and "worker:0 exited with code 3" in p.output
    assert not pid_alive(sleeper)  # stopped with the rest of its task's group


class _Gone:
    """A terminal that went away: every write fails, as with ``zmqflow launch ... | head -1``."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_output_nobody_reads_neither_stops_the_watch_nor_blocks_a_chatty_task():
    chatty = "import sys\nfor i in range(200000): print('line', i)\nsys.exit(4)"
    spec = ClusterSpec({"worker": [f"127.0.0.1:{free_port()}"]})
    launcher = Launcher(spec, [sys.executable, "-c", chatty], out=_Gone())
    box: list[int] = []
    waiter = threading.Thread(target=lambda: (launcher.start(), box.append(launcher.wait())), daemon=True)
    waiter.start()
    waiter.join(60)
    assert box == [4]
    assert all(c.proc is not None and c.proc.poll() is not None for c in launcher.children)


def test_sigterm_to_a_run_with_a_command_is_not_a_success(procs):
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--", sys.executable, "-c",
               "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
               "print('up', flush=True); time.sleep(60)"])
    p.wait_for_line("[worker:0] up", 60)
    p.signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM, p.output  # the task exited 0 on TERM; the run was still stopped


def test_sighup_is_passed_on_and_nothing_is_left_running(procs):
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--", sys.executable, "-c",
               "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"])
    pid = int(p.wait_for_line("[worker:0] pid ", 60).split()[2])
    p.signal(signal.SIGHUP)
    assert p.wait(30) == 128 + signal.SIGHUP, p.output
    assert not pid_alive(pid)


def test_a_command_with_no_task_to_run_it_and_bad_flags_are_one_line_exit_2(procs, tmp_path):
    cases = [(["--workers", "0", "--ps", "1", "--", "true"], "COMMAND runs on chief, master and worker tasks"),
             (["--workers", "1", "--host", "::1", "--", "true"], "--host '::1': "),
             (["--workers", "1", "--cluster-out", str(tmp_path / "no" / "c.json"), "--", "true"], "--cluster-out ")]
    for args, needle in cases:
        p = procs([*ZMQFLOW, "launch", *args])
        assert p.wait(60) == 2, p.output
        assert needle in p.output and "Traceback" not in p.output and "serving" not in p.output, p.output
