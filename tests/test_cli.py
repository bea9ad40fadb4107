"""The command line as users run it: real processes, real signals, real exit codes."""

from __future__ import annotations

import json
import signal
import socket
import sys
import textwrap
import time

import pytest

from zmqflow.loop import run
from zmqflow.rpc import RpcClient
from zmqflow.errors import Unavailable
from zmqflow.testing import async_wait_until, free_port, wait_until

from .conftest import ZMQFLOW, pid_alive


def _cluster_file(tmp_path, jobs):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(jobs))
    return str(path)


def _ping(endpoint: str, timeout: float = 5.0) -> dict:
    async def main():
        client = RpcClient(identity="cli-test")
        try:
            return await client.call(endpoint, "master", "status", timeout=timeout)
        finally:
            client.close()

    return run(main())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_logs_serves_and_stops_on_signal(tmp_path, procs, sig):
    port = free_port()
    cfile = _cluster_file(tmp_path, {"worker": [f"127.0.0.1:{port}"], "ps": [f"127.0.0.1:{free_port()}"]})
    p = procs([*ZMQFLOW, "serve", "--cluster", cfile, "--task", "worker:0"])
    line = p.wait_for_line("serving worker:0", 30)
    assert f"tcp://127.0.0.1:{port}" in line and '"ps": ["127.0.0.1:' in line and "services: master, worker" in line
    status = _ping(f"tcp://127.0.0.1:{port}")
    assert status["task"] == "worker:0" and status["pid"] == p.proc.pid
    p.signal(sig)
    start = time.monotonic()
    assert p.wait(10) == 0
    assert time.monotonic() - start < 2.0


def test_serve_reads_the_task_from_the_environment(tmp_path, procs):
    port = free_port()
    tf_config = json.dumps({"cluster": {"chief": [f"127.0.0.1:{port}"]}, "task": {"type": "chief", "index": 0}, "environment": "cloud"})
    p = procs([*ZMQFLOW, "serve"], env={"TF_CONFIG": tf_config})
    p.wait_for_line("serving chief:0", 30)
    assert _ping(f"tcp://127.0.0.1:{port}")["task"] == "chief:0"
    p.signal(signal.SIGTERM)
    assert p.wait(10) == 0


@pytest.mark.parametrize(
    "args,jobs,needle",
    [
        (["--bogus"], None, "No such option"),
        (["--task", "worker:0"], {"worker": ["127.0.0.1:1", "127.0.0.1:1"]}, "duplicate address 127.0.0.1:1"),
        (["--task", "worker:5"], {"worker": ["127.0.0.1:2"]}, "unknown task worker:5"),
        (["--task", "worker:0"], {"worker": ["127.0.0.1:70000"]}, "port 70000 out of range"),
        (["--task", "worker:0"], {"worker": ["localhost"]}, "job 'worker' index 0"),
        (["--task", "nonsense"], {"worker": ["127.0.0.1:2"]}, "malformed task 'nonsense'"),
    ],
)
def test_serve_usage_and_config_errors_exit_2(tmp_path, procs, args, jobs, needle):
    extra = ["--cluster", _cluster_file(tmp_path, jobs)] if jobs else []
    p = procs([*ZMQFLOW, "serve", *extra, *args])
    assert p.wait(30) == 2
    assert needle in p.output
    if jobs:
        assert len(p.output.strip().splitlines()) == 1


def test_serve_port_in_use_exits_1_naming_the_address(tmp_path, procs):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = procs([*ZMQFLOW, "serve", "--cluster", _cluster_file(tmp_path, {"worker": [f"127.0.0.1:{port}"]}), "--task", "worker:0"])
        assert p.wait(30) == 1
    assert f"127.0.0.1:{port}" in p.output and "in use" in p.output


def test_restarted_serve_on_the_same_address_is_reachable_again(tmp_path, procs):
    port = free_port()
    cfile = _cluster_file(tmp_path, {"worker": [f"127.0.0.1:{port}"]})
    endpoint = f"tcp://127.0.0.1:{port}"

    async def scenario():
        client = RpcClient(identity="restart-test")
        try:
            first = procs([*ZMQFLOW, "serve", "--cluster", cfile, "--task", "worker:0"])
            assert (await client.call(endpoint, "master", "status", timeout=30))["pid"] == first.proc.pid
            first.signal(signal.SIGKILL)
            first.wait(10)
            # a peer known to be gone fails fast, long before the call's own deadline
            start = time.monotonic()
            with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
                await client.call(endpoint, "master", "status", timeout=30)
            assert time.monotonic() - start < 5
            second = procs([*ZMQFLOW, "serve", "--cluster", cfile, "--task", "worker:0"])
            second.wait_for_line("serving worker:0", 30)
            # the same client, the same pooled connection: it reconnects on its own
            await async_wait_until(lambda: client.peer_state(endpoint) == "up", 10, what="reconnected")
            assert (await client.call(endpoint, "master", "status", timeout=30))["pid"] == second.proc.pid
            second.signal(signal.SIGTERM)
            assert second.wait(10) == 0
        finally:
            client.close()

    run(scenario())


def test_status_reports_every_task_and_exits_1_when_one_is_down(tmp_path, procs):
    up, down = free_port(), free_port()
    cfile = _cluster_file(tmp_path, {"worker": [f"127.0.0.1:{up}"], "ps": [f"127.0.0.1:{down}"]})
    server = procs([*ZMQFLOW, "serve", "--cluster", cfile, "--task", "worker:0"])
    server.wait_for_line("serving worker:0", 30)
    p = procs([*ZMQFLOW, "status", "--cluster", cfile, "--json", "--timeout", "0.5"])
    assert p.wait(30) == 1
    report = json.loads(p.output)
    assert report["all_reachable"] is False
    rows = {r["task"]: r for r in report["tasks"]}
    assert rows["worker:0"]["reachable"] and rows["worker:0"]["pid"] == server.proc.pid
    assert rows["worker:0"]["roles"] == ["master", "worker", "ring", "ps"]  # every task can hold variables
    assert not rows["ps:0"]["reachable"]
    table = procs([*ZMQFLOW, "status", "--cluster", cfile, "--timeout", "0.5"])
    assert table.wait(30) == 1
    assert "TASK" in table.output and "1 of 2 tasks unreachable: ps:0" in table.output


def test_launch_serves_a_cluster_that_status_sees_and_stops_on_sigterm(tmp_path, procs):
    cfile = tmp_path / "launched.json"
    launcher = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--cluster-out", str(cfile)])
    for task in ("worker:0", "worker:1", "ps:0"):
        launcher.wait_for_line(f"[{task}]", 60)
    status = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--json"])
    assert status.wait(30) == 0
    report = json.loads(status.output)
    assert report["all_reachable"] and [r["task"] for r in report["tasks"]] == ["worker:0", "worker:1", "ps:0"]
    pids = [r["pid"] for r in report["tasks"]]
    launcher.signal(signal.SIGTERM)
    assert launcher.wait(20) == 0
    for pid in pids:  # every task process is gone
        wait_until(lambda: not pid_alive(pid), 10, what=f"pid {pid} gone")


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import zmqflow as zf
    with zf.Server.from_env() as server:
        # tasks start in any order: the call waits for ps:0 to come up, within its deadline
        reply = server.call("ps:0", "worker", "echo", {"task": str(server.task)}, timeout=30)
        print("echoed", reply["task"], "cluster", os.environ["ZMQFLOW_TASK"])
    sys.exit(int(os.environ.get("EXIT_" + server.task.job.upper() + str(server.task.index), "0")))
    """
)


def test_launch_runs_the_command_on_workers_and_prefixes_output(tmp_path, procs):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--", sys.executable, str(script)])
    assert p.wait(90) == 0, p.output
    assert "[worker:0] echoed worker:0 cluster worker:0" in p.output
    assert "[worker:1] echoed worker:1 cluster worker:1" in p.output


def test_launch_exit_code_is_the_first_failure(tmp_path, procs):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    p = procs(
        [*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--", sys.executable, str(script)],
        env={"EXIT_WORKER1": "3"},
    )
    assert p.wait(90) == 3, p.output
    assert "worker:1 exited with code 3" in p.output


def test_launch_rejects_a_cluster_and_generation_flags_together(tmp_path, procs):
    p = procs([*ZMQFLOW, "launch", "--cluster", _cluster_file(tmp_path, {"worker": ["127.0.0.1:5"]}), "--workers", "2"])
    assert p.wait(30) == 2 and "not both" in p.output


def test_bench_commands_are_listed(procs):
    p = procs([*ZMQFLOW, "bench", "--help"])
    assert p.wait(30) == 0
    for name in ("transport", "ps", "embedding", "allreduce", "recovery"):
        assert name in p.output


REJOIN = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    marker = os.path.join(sys.argv[1], os.environ["ZMQFLOW_TASK"] + ".started")
    first_run = not os.path.exists(marker)
    open(marker, "a").close()
    with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(), progress=False) as mon:
        mon.create({"count": np.zeros(1)})
        print("joined", "first" if first_run else "again", flush=True)
        for i in range(5):
            mon.apply({"count": np.ones(1)})
            if first_run and mon.task_name == "worker:1" and i == 1:
                os._exit(1)  # dies mid-training; the launcher brings it back
    """
)


def test_launch_restarts_a_failed_worker_that_rejoins(tmp_path, procs):
    script = tmp_path / "rejoin.py"
    script.write_text(REJOIN)
    cfile = tmp_path / "cluster.json"
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--restart", "on-failure", "--cluster-out", str(cfile),
               "--", sys.executable, str(script), str(tmp_path)])
    assert p.wait(120) == 0, p.output
    assert "restarting worker:1" in p.output and "[worker:1] joined again" in p.output
    assert "[worker:0] joined first" in p.output
