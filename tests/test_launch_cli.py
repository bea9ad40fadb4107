"""``zmqflow launch`` as users run it: log files, one prefix per line, failure summaries, restart
counts, Ctrl-C, and what a malformed ``--cluster`` says. Real launch processes throughout."""

from __future__ import annotations

import json
import re
import signal
import sys
import textwrap

import pytest

from zmqflow.cli.launch_output import describe_exit, log_path
from zmqflow.testing import wait_until

from .conftest import ZMQFLOW, pid_alive


def test_describe_exit_names_the_signal():
    assert describe_exit(3) == "code 3"
    assert describe_exit(-signal.SIGKILL) == "code 137 (SIGKILL)"
    assert log_path("/x", "worker:0") == "/x/worker-0.log"


RESTARTED = textwrap.dedent(
    """
    import os, sys
    count = os.environ["ZMQFLOW_RESTART_COUNT"]
    print("restart count", count, flush=True)
    if os.environ["ZMQFLOW_TASK"] == "worker:1" and count == "0":
        sys.exit(5)  # fails once; the launcher restarts it
    """
)


def test_log_dir_restart_count_and_one_prefix(tmp_path, procs):
    script, logs = tmp_path / "job.py", tmp_path / "logs"
    script.write_text(RESTARTED)
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--restart", "on-failure", "--log-dir", str(logs),
               "--", sys.executable, str(script)])
    assert p.wait(60) == 0, p.output
    out = p.output.splitlines()
    assert "[worker:0] restart count 0" in out and "[worker:1] restart count 0" in out
    assert "[worker:1] restart count 1" in out and "[worker:0] restart count 1" not in out
    assert "failed" not in p.output  # it recovered: no failure summary
    assert sorted(f.name for f in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    lines = (logs / "worker-1.log").read_text().splitlines()
    # appended across the restart, each run opened by a marker, the task's own lines untagged
    assert [ln for ln in lines if not ln.startswith("===")] == ["restart count 0", "restart count 1"]
    markers = [ln for ln in lines if ln.startswith("===")]
    assert len(markers) == 4 and "restart 0" in markers[0] and "exited with code 5" in markers[1]
    assert "restart 1" in markers[2] and "exited with code 0" in markers[3]
    assert (logs / "worker-0.log").read_text().count("restart count") == 1


def test_a_served_task_log_line_has_one_prefix(tmp_path, procs):
    logs = tmp_path / "logs"
    p = procs([*ZMQFLOW, "launch", "--workers", "0", "--ps", "1", "--log-dir", str(logs)])
    line = p.wait_for_line("serving ps:0", 60)
    assert line.startswith("[ps:0] ") and line.count("[ps:0]") == 1, line
    p.signal(signal.SIGTERM)
    assert p.wait(20) == 0, p.output
    served = [ln for ln in (logs / "ps-0.log").read_text().splitlines() if "serving ps:0" in ln]
    assert len(served) == 1 and "[ps:0]" not in served[0]


FAILING = textwrap.dedent(
    """
    import os, sys
    task = os.environ["ZMQFLOW_TASK"]
    for i in range(15):
        print(task, "line", i)
    sys.stdout.flush()
    if task == "worker:0":
        os.kill(os.getpid(), 9)
    sys.exit(3)
    """
)


def test_failed_tasks_are_summarised_with_code_signal_and_last_lines(tmp_path, procs):
    script = tmp_path / "job.py"
    script.write_text(FAILING)
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--", sys.executable, str(script)])
    assert p.wait(60) in (3, 137), p.output
    out = p.output.splitlines()
    start = out.index("[launch] 2 tasks failed:")
    summary = out[start + 1:]
    heads = [i for i, ln in enumerate(summary) if not ln.startswith("[launch]     | ")]
    assert len(heads) == 2 and len(summary) == 22, p.output
    by_task = {}
    for i in heads:
        m = re.match(r"\[launch\]   (worker:\d) exited with (.*); last 10 lines:$", summary[i])
        assert m, summary[i]
        by_task[m.group(1)] = (m.group(2), [ln.removeprefix("[launch]     | ") for ln in summary[i + 1:i + 11]])
    assert by_task["worker:0"][0] == "code 137 (SIGKILL)"
    assert by_task["worker:1"][0] == "code 3"
    for task, (_, tail) in by_task.items():
        assert tail == [f"{task} line {i}" for i in range(5, 15)]


INTERRUPTED = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen(["sleep", "120"])
    print("pids", os.getpid(), child.pid, flush=True)
    time.sleep(120)
    """
)


def test_ctrl_c_exits_130_and_leaves_nothing_running(tmp_path, procs):
    script, logs = tmp_path / "job.py", tmp_path / "logs"
    script.write_text(INTERRUPTED)
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--log-dir", str(logs),
               "--", sys.executable, str(script)])
    pids = []
    for task in ("worker:0", "worker:1"):
        pids += [int(x) for x in p.wait_for_line(f"[{task}] pids ", 60).split()[2:]]
    p.wait_for_line("[ps:0] ", 60)  # the server is up too
    ps_marker = (logs / "ps-0.log").read_text().splitlines()[0]
    pids.append(int(re.search(r"pid (\d+)", ps_marker).group(1)))
    assert all(pid_alive(pid) for pid in pids)
    p.signal(signal.SIGINT)
    assert p.wait(30) == 130, p.output
    assert "got SIGINT" in p.output and "failed" not in p.output
    for pid in pids:  # the scripts, what they started, and the ps server
        wait_until(lambda: not pid_alive(pid), 10, what=f"pid {pid} gone")


@pytest.mark.parametrize("value, expected", [
    ("[1,2]", "is a JSON array; expected a JSON object mapping job names"),
    ("{}", "names no jobs; expected a JSON object"),
    ('{"worker": [', "is not valid JSON (Expecting value at line 1 column 13); expected a JSON object"),
    ("MISSING", "no such file; expected a cluster file's path or inline JSON"),
    ("BADFILE", "is not valid JSON"),
])
def test_malformed_cluster_is_one_line_naming_it_exit_2(tmp_path, procs, value, expected):
    if value == "MISSING":
        value = str(tmp_path / "absent.json")
    elif value == "BADFILE":
        (tmp_path / "bad.json").write_text('{"worker": ["127.0.0.1:1"],}')
        value = str(tmp_path / "bad.json")
    p = procs([*ZMQFLOW, "launch", "--cluster", value])
    assert p.wait(30) == 2, p.output
    assert p.output.splitlines() == [p.output] and "Traceback" not in p.output
    assert p.output.startswith("zmqflow launch: --cluster ") and repr(value) in p.output
    assert expected in p.output, p.output


def test_a_valid_cluster_file_still_works(tmp_path, procs):
    from zmqflow.testing import free_port

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ps": [f"127.0.0.1:{free_port()}"]}))
    p = procs([*ZMQFLOW, "launch", "--cluster", str(path)])
    p.wait_for_line("serving ps:0", 60)
    p.signal(signal.SIGTERM)
    assert p.wait(20) == 0, p.output


STUBBORN = textwrap.dedent(
    """
    import os, signal, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # deaf to Ctrl-C: launch must end it another way
    print("pid", os.getpid(), flush=True)
    time.sleep(120)
    """
)


def test_ctrl_c_ends_a_task_that_ignores_it(tmp_path, procs):
    script = tmp_path / "job.py"
    script.write_text(STUBBORN)
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--", sys.executable, str(script)])
    pid = int(p.wait_for_line("[worker:0] pid ", 60).split()[2])
    p.signal(signal.SIGINT)
    assert p.wait(30) == 130, p.output
    wait_until(lambda: not pid_alive(pid), 10, what=f"pid {pid} gone")
