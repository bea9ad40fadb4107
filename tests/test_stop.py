"""``zmqflow stop`` and ps tasks that exit once training is over (TF's never do: tensorflow#4713).

Real ``zmqflow serve`` processes on loopback, real training processes (the bridge runtime and
``MonitoredTrainingSession``), real ``zmqflow launch``; the op's edge and the embedded server
in-process."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import textwrap
import uuid

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.bridge import runtime
from zmqflow.cli.probe_client import PROBE_MAX_BYTES
from zmqflow.cli.stop import UNREACHABLE, stop_tasks
from zmqflow.rpc import CallContext, RpcClient, Service, op
from zmqflow.server.services.sessions import SessionLedger
from zmqflow.testing import free_port, local_cluster, make_spec, wait_until
from zmqflow.transport.curve import Keys, generate

from .conftest import ZMQFLOW, arun


def _serve(procs, cfile, task, *extra, env=None):
    p = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", task, *extra], env=env)
    return p


def _cluster(tmp_path, **jobs):
    spec = make_spec(jobs, "tcp")
    cfile = tmp_path / "c.json"
    cfile.write_text(spec.to_json())
    return spec, cfile


def _port_free(spec, task) -> bool:
    addr = spec.address(zf.TaskId.parse(task))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a restarted task binds: TIME_WAIT is no holder
        try:
            s.bind((addr.host, addr.port))
        except OSError:
            return False
    return True


def _lines(out: str) -> dict[str, str]:
    """``task  outcome`` lines of zmqflow stop, by task."""
    rows = [line.split(None, 1) for line in out.splitlines() if line and ":" in line.split(None, 1)[0]]
    return {task: outcome.strip() for task, outcome in rows}


def _status(spec, task, keys=None):
    async def ask():
        if keys is not None:
            keys.learn(spec)
        client = RpcClient(identity=f"test-status-{uuid.uuid4().hex}", keys=keys)  # a fresh one: no replayed reply
        try:
            return await client.call(spec.address(zf.TaskId.parse(task)).endpoint, "master", "status", timeout=5)
        finally:
            client.close()
    return arun(ask())


# zmqflow stop --------------------------------------------------------------------------------
def test_stop_stops_named_tasks_then_all_in_order_and_frees_their_ports(tmp_path, procs):
    spec, cfile = _cluster(tmp_path, worker=2, ps=1)
    served = {t: _serve(procs, cfile, t) for t in ("worker:0", "worker:1", "ps:0")}
    for p in served.values():
        p.wait_for_line("serving", 60)

    one = procs([*ZMQFLOW, "stop", "--cluster", str(cfile), "--task", "worker:1"])
    assert one.wait(60) == 0, one.output
    assert _lines(one.output) == {"worker:1": "stopped"}, one.output
    assert served["worker:1"].wait(10) == 0, served["worker:1"].output
    assert _status(spec, "ps:0")["task"] == "ps:0"  # the others still serve
    assert served["worker:0"].proc.poll() is None

    every = procs([*ZMQFLOW, "stop", "--cluster", spec.to_json(), "--timeout", "20"])
    assert every.wait(60) == 0, every.output
    assert _lines(every.output) == {"worker:0": "stopped", "worker:1": "already down", "ps:0": "stopped"}, every.output
    for task, p in served.items():
        assert p.wait(10) == 0, p.output
        assert _port_free(spec, task), task
    # workers first, then ps: the ps heard its request after worker:0 had stopped (log times, one clock)
    asked = served["ps:0"].wait_for_line("stop requested by 'zmqflow-stop' (no keys): zmqflow stop", 5)
    stopped = served["worker:0"].wait_for_line("stopping worker:0", 5)
    assert stopped[:23] < asked[:23], (stopped, asked)
    again = procs([*ZMQFLOW, "stop", "--cluster", str(cfile)])
    assert again.wait(60) == 0, again.output
    assert set(_lines(again.output).values()) == {"already down"}, again.output


def test_stop_usage_errors_exit_2(tmp_path, procs):
    _, cfile = _cluster(tmp_path, worker=1)
    bad = procs([*ZMQFLOW, "stop", "--cluster", str(cfile), "--task", "ps:3"])
    assert bad.wait(30) == 2 and "no such task" in bad.output, bad.output
    missing = procs([*ZMQFLOW, "stop", "--cluster", str(tmp_path / "nope.json")])
    assert missing.wait(30) == 2 and "no such file" in missing.output, missing.output


def test_tasks_stop_never_reached_are_unreachable_not_down(tmp_path, procs):
    """Down is what a host says by refusing the connection; a host that does not resolve, or that
    takes the connection with no task behind it, says nothing of the task: exit 1."""
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts (its backlog), never speaks ZMTP
        mute_port = mute.getsockname()[1]
        spec = {"worker": [f"127.0.0.1:{free_port()}", "no-such-host.invalid:2222",
                           f"127.0.0.1:{mute_port}"]}
        p = procs([*ZMQFLOW, "stop", "--cluster", json.dumps(spec), "--timeout", "3"])
        assert p.wait(60) == 1, p.output
    outcome = _lines(p.output)
    assert outcome["worker:0"] == "already down", p.output
    assert outcome["worker:1"].startswith("unreachable: host no-such-host.invalid does not resolve"), p.output
    assert outcome["worker:2"] == (f"unreachable: 127.0.0.1:{mute_port} accepts connections but no zmqflow "
                                   "task answered there"), p.output


class HugePing(Service):
    """A ``master`` whose ping answers with twice what a probe's client takes."""

    name = "master"

    @op
    def ping(self, ctx: CallContext) -> dict:
        return {"pad": np.zeros(PROBE_MAX_BYTES // 2, np.float32)}


def test_stop_takes_no_reply_larger_than_it_needs():
    """The reply is cut off by the socket (the peer then counts as no task), not taken in whole:
    stop asks tasks with a client of small replies, as status does."""
    spec = make_spec({"worker": 1}, "tcp")

    async def main() -> list:
        async with local_cluster(spec, timeout=30, services=lambda t: {"master": HugePing()}):
            return await stop_tasks(spec, list(spec.tasks), 3.0)

    [(_, outcome)] = arun(main(), 60)
    address = spec.address(spec.tasks[0])
    assert outcome == f"{UNREACHABLE}: {address} accepts connections but no zmqflow task answered there"


def test_stop_and_status_refuse_a_timeout_that_is_not_finite(tmp_path, procs):
    _, cfile = _cluster(tmp_path, worker=1)
    for command in ("stop", "status"):
        for value in ("nan", "inf"):
            p = procs([*ZMQFLOW, command, "--cluster", str(cfile), "--timeout", value])
            assert p.wait(30) == 2, p.output
            assert f"Invalid value for '--timeout': '{value}' is not a finite number" in p.output, p.output
            assert "Traceback" not in p.output


def test_with_keys_a_key_off_the_allow_list_stops_nothing_and_the_client_key_stops_all(tmp_path, procs):
    spec, cfile = _cluster(tmp_path, worker=1, ps=1)
    good = tmp_path / "keys"
    generate(good, spec)
    other = tmp_path / "other"
    generate(other, spec)
    intruder = tmp_path / "intruder"  # knows every server's key, but its own client key is not allowed
    shutil.copytree(good, intruder)
    for name in ("client.key", "client.key_secret"):
        shutil.copy(other / "clients" / name, intruder / "clients" / name)
    allow = json.loads((intruder / "allow.json").read_text())
    allow["clients"] = json.loads((other / "allow.json").read_text())["clients"]
    (intruder / "allow.json").write_text(json.dumps(allow))
    served = {t: _serve(procs, cfile, t, "--keys", str(good)) for t in ("worker:0", "ps:0")}
    for p in served.values():
        p.wait_for_line("serving", 60)

    refused = procs([*ZMQFLOW, "stop", "--cluster", str(cfile), "--keys", str(intruder), "--timeout", "5"])
    assert refused.wait(60) == 1, refused.output
    outcomes = _lines(refused.output)
    assert set(outcomes) == {"worker:0", "ps:0"} and all(o.startswith("refused") for o in outcomes.values()), \
        refused.output
    no_keys = procs([*ZMQFLOW, "stop", "--cluster", str(cfile), "--timeout", "5"], env={"ZMQFLOW_KEYS": ""})
    assert no_keys.wait(60) == 1, no_keys.output
    status = _status(spec, "ps:0", Keys.load(str(good)))
    assert status["stopping"] is None and all(p.proc.poll() is None for p in served.values())

    ok = procs([*ZMQFLOW, "stop", "--cluster", str(cfile), "--keys", str(good)])
    assert ok.wait(60) == 0, ok.output
    assert _lines(ok.output) == {"worker:0": "stopped", "ps:0": "stopped"}, ok.output
    for p in served.values():
        assert p.wait(10) == 0, p.output
    assert "stop requested by client key 'client'" in served["ps:0"].output


# the op's edge, and a server embedded in a process --------------------------------------------
@pytest.fixture
def private():
    runtime.shutdown()
    rt = runtime.init(timeout=20)
    yield rt
    runtime.shutdown()


def _call(target, op, body):
    async def go():
        client = RpcClient(identity=f"test-caller-{uuid.uuid4().hex}", source="worker:0")
        try:
            return await client.call(target, "master", op, body, timeout=10)
        finally:
            client.close()
    return arun(go())


@pytest.mark.parametrize("op,body,field", [
    ("shutdown", {"reason": 5}, "reason"),
    ("shutdown", {"reason": "x" * 300}, "reason"),
    ("shutdown", {"why": "bored"}, "why"),
    ("shutdown", [1, 2], ""),
    ("hello", {}, "session"),
    ("hello", {"session": ""}, "session"),
    ("goodbye", {"session": "s", "finished": "yes"}, "finished"),
    ("goodbye", {"session": "s" * 65}, "session"),
])
def test_malformed_lifecycle_requests_get_typed_errors_and_change_nothing(private, op, body, field):
    with pytest.raises(errors.InvalidArgument, match=f"master.{op}.*{field}"):
        _call(private.server.target, op, body)
    status = _call(private.server.target, "status", None)
    assert status["stopping"] is None and status["sessions"] == {}
    assert private.server.stop_reason is None and runtime.current() is private


def test_a_stop_request_shuts_the_embedding_runtime_down_with_a_typed_error(private):
    heard = []
    private.server.on_stop_request(heard.append)
    assert _call(private.server.target, "shutdown", {"reason": "maintenance"}) == {"task": "worker:0",
                                                                                    "stopping": True}
    assert private.server.join(10), "the embedded server did not stop"
    wait_until(lambda: heard, 10, what="the stop listener")
    assert "maintenance" in heard[0]
    with pytest.raises(errors.Unavailable, match="stopped .*maintenance"):
        runtime.current()
    with pytest.raises(errors.Unavailable, match="maintenance"):
        runtime.init()
    runtime.shutdown()  # an explicit shutdown clears it: the process may join again
    assert runtime.init(timeout=20).server.stop_reason is None


def test_the_ledger_counts_training_tasks_by_task_and_the_last_goodbye_wins():
    ledger = SessionLedger(make_spec({"chief": 1, "worker": 2, "ps": 1, "evaluator": 1}))
    assert ledger.waiting() == ["chief:0", "worker:0", "worker:1"]
    assert not ledger.hello("evaluator:0", "e") and not ledger.goodbye("evaluator:0", "e", True)
    assert not ledger.hello("session-1234", "x")  # no task: never counts
    for task in ("chief:0", "worker:0"):
        ledger.hello(task, "a")
        ledger.goodbye(task, "a", True)
    ledger.hello("worker:1", "a")
    ledger.hello("worker:1", "b")  # a second session of the task (a thread)
    ledger.goodbye("worker:1", "a", True)
    assert not ledger.done  # b is still open
    ledger.goodbye("worker:1", "b", False)
    assert not ledger.done  # the last goodbye was no clean end (a crash, a stop)
    ledger.hello("worker:1", "c")  # restarted
    ledger.goodbye("worker:1", "c", True)
    assert ledger.done and ledger.waiting() == []
    ledger.hello("worker:0", "d")  # a task that comes back is training again
    assert ledger.waiting() == ["worker:0"]


# ps tasks that exit by themselves -------------------------------------------------------------
TRAIN = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from zmqflow.bridge import runtime
    mode, gate = sys.argv[1], sys.argv[2]
    if mode == "monitored":
        from zmqflow.training.monitored import MonitoredTrainingSession
        with MonitoredTrainingSession() as mon:
            mon.session.variable("m", np.zeros(2, np.float32)).assign(np.ones(2, np.float32))
        print("monitored done", flush=True)
        sys.exit(0)
    rt = runtime.init(timeout=30, wait=False)
    v = rt.session.variable("w" + os.environ["ZMQFLOW_TASK"][-1], np.zeros(4, np.float32))
    v.assign(np.ones(4, np.float32))
    print("trained", flush=True)
    if mode == "wait-then-crash":
        while not os.path.exists(gate):
            time.sleep(0.02)
        raise RuntimeError("worker crashed")
""")


def _trainer(procs, script, spec, task, mode, gate, keys=None):
    env = {"ZMQFLOW_CLUSTER": spec.to_json(), "ZMQFLOW_TASK": task}
    if keys is not None:
        env["ZMQFLOW_KEYS"] = keys
    return procs([sys.executable, str(script), mode, str(gate)], env=env)


def test_ps_exits_only_once_every_worker_finished_and_not_on_a_crash(tmp_path, procs):
    spec, cfile = _cluster(tmp_path, worker=2, ps=1)
    script, gate = tmp_path / "train.py", tmp_path / "gate"
    script.write_text(TRAIN)
    ps = _serve(procs, cfile, "ps:0", "--exit-when-done")  # (launch's test covers ZMQFLOW_EXIT_WHEN_DONE)
    ps.wait_for_line("serving", 60)

    w0 = _trainer(procs, script, spec, "worker:0", "clean", gate)
    w1 = _trainer(procs, script, spec, "worker:1", "wait-then-crash", gate)
    assert w0.wait(60) == 0, w0.output
    w1.wait_for_line("trained", 60)
    status = wait_until(lambda: (s := _status(spec, "ps:0"))["sessions"].get("worker:0", {}).get("finished") and s, 30,
                        what="worker:0's goodbye")
    assert status["sessions"]["worker:1"] == {"open": 1, "finished": False}, status
    assert status["state"]["master"] == "exits when done; waiting for worker:1"
    assert ps.proc.poll() is None  # one worker still training: the ps serves on

    gate.write_text("crash")
    assert w1.wait(60) == 1 and "worker crashed" in w1.output, w1.output
    status = wait_until(lambda: (s := _status(spec, "ps:0"))["sessions"]["worker:1"]["open"] == 0 and s, 30,
                        what="worker:1's goodbye")
    assert status["sessions"]["worker:1"]["finished"] is False and status["stopping"] is None
    assert ps.proc.poll() is None  # a crash is no end of training: it may be restarted

    again = _trainer(procs, script, spec, "worker:1", "monitored", gate)  # the restart, ending cleanly
    assert again.wait(60) == 0, again.output
    assert ps.wait(30) == 0, ps.output
    assert "every chief and worker task finished training" in ps.output
    assert _port_free(spec, "ps:0")


def test_under_launch_a_job_with_a_ps_ends_by_itself(tmp_path, procs):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cmd = [*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--", sys.executable, str(script), "clean",
           str(tmp_path / "gate")]
    p = procs(cmd)
    assert p.wait(90) == 0, p.output
    assert "stopping ps:0 (every chief and worker task finished training (--exit-when-done))" in p.output, p.output
    assert "did not stop" not in p.output and "killing" not in p.output


def test_monitored_session_goodbye_ends_an_embedded_ps_and_a_stop_request_ends_its_loop():
    import numpy as np

    from zmqflow.training.monitored import MonitoredTrainingSession

    spec = make_spec({"worker": 1, "ps": 1})
    ps = zf.Server(spec, "ps:0", exit_when_done=True)
    try:
        with MonitoredTrainingSession(cluster=spec, task="worker:0", progress=False) as mon:
            mon.create({"w": np.zeros(2, np.float32)})
            assert not ps.join(0)
        assert ps.join(20), "the ps did not exit after the only worker's finished goodbye"
        assert "finished training" in (ps.stop_reason or "")
    finally:
        ps.stop()

    spec = make_spec({"worker": 1, "ps": 1})
    ps = zf.Server(spec, "ps:0", exit_when_done=True)
    try:
        mon = MonitoredTrainingSession(cluster=spec, task="worker:0", progress=False)
        mon.create({"w": np.zeros(2, np.float32)})
        assert not mon.should_stop()
        _call(mon.server.target, "shutdown", {})
        wait_until(mon.should_stop, 20, what="the loop's stop")
        mon.close()
        assert not ps.join(0.2)  # stopped by request: no finished goodbye, the ps serves on
        assert _call(ps.target, "status", None)["sessions"]["worker:0"] == {"open": 0, "finished": False}
    finally:
        ps.stop()
