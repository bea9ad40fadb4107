"""``zmqflow launch`` and the processes its tasks leave behind: a failed run's helpers are ended
before the task is restarted (one holding the task's port would fail every restart), and no task
outlives a launch killed outright. Real launch processes throughout."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest

from zmqflow.testing import wait_until

from .conftest import ZMQFLOW, pid_alive

# Run 0 serves, forks a helper (a data loader, a pool worker) that inherits the listening socket
# and shrugs off SIGTERM, then crashes; run 1 says whether that helper is still there, then serves.
FORKS_AND_FAILS = textwrap.dedent(
    """
    import os, signal, sys, time
    import zmqflow as zf
    from zmqflow.cluster import resolve

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().split(")")[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    n = int(os.environ["ZMQFLOW_RESTART_COUNT"])
    pidfile = sys.argv[1]
    spec, me = resolve()
    if n == 1:
        print("helper of run 0 alive:", alive(int(open(pidfile).read())), flush=True)
    try:
        server = zf.Server(spec, me)
    except Exception as exc:
        print("run", n, "cannot serve:", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    print("run", n, "serving at", spec.address(me), flush=True)
    if n == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before the fork: the helper has it from its start
        helper = os.fork()
        if helper == 0:
            time.sleep(30)
            os._exit(0)
        with open(pidfile + ".tmp", "w") as fh:
            fh.write(str(helper))
        os.replace(pidfile + ".tmp", pidfile)
        os._exit(1)
    server.stop()
    print("run", n, "done", flush=True)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_failed_runs_helper_is_gone_before_the_restart_serves_on_its_port(tmp_path, procs):
    script, pidfile = tmp_path / "task.py", tmp_path / "helper.pid"
    script.write_text(FORKS_AND_FAILS)
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--restart", "on-failure", "--max-restarts", "1",
               "--", sys.executable, str(script), str(pidfile)])
    try:
        assert p.wait(90) == 0, p.output
        address = p.wait_for_line("[worker:0] run 0 serving at ", 1).rsplit(" ", 1)[1]
        assert "[worker:0] helper of run 0 alive: False" in p.output.splitlines(), p.output
        assert f"[worker:0] run 1 serving at {address}" in p.output.splitlines(), p.output
        assert "[worker:0] run 1 done" in p.output.splitlines(), p.output
    finally:
        if pidfile.exists() and pid_alive(helper := int(pidfile.read_text())):
            os.kill(helper, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z" and int(fields[1]) == pid:
                found.append(int(entry))
    return found


SLEEPS = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_no_task_outlives_a_launch_killed_outright(procs):
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--", sys.executable, "-c", SLEEPS])
    tasks: list[int] = []
    try:
        for i in range(2):
            p.wait_for_line(f"[worker:{i}] pid ", 60)
        p.wait_for_line("serving ps:0", 60)
        tasks = wait_until(lambda: len(kids := _children(p.proc.pid)) == 3 and kids, 10, what="launch's three tasks")
        p.signal(signal.SIGKILL)  # as the OOM killer would: launch gets no say
        p.wait(10)
        wait_until(lambda: not any(pid_alive(t) for t in tasks), 10, what="every task gone")
    finally:
        for t in tasks:
            if pid_alive(t):
                os.kill(t, signal.SIGKILL)
