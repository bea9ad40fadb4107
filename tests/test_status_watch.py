"""``zmqflow status --watch`` and ``--task``: the progress record, the rates, the status reply that
carries them, and the command as users (and readiness probes) run it, against real processes."""

from __future__ import annotations

import asyncio
import json
import io
import signal
import socket
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zmqflow as zf
from zmqflow.bridge import runtime
from zmqflow.cli.probe_client import PROBE_MAX_BYTES, PROBE_OPTIONS, probe_client
from zmqflow.cli.status import cluster_status, format_status
from zmqflow.cli.status_watch import error_text, json_value, rate_text, watch, watch_cells
from zmqflow.cluster import ClusterSpec, TaskId
from zmqflow.errors import InvalidArgument, Unavailable
from zmqflow.observe import progress
from zmqflow.observe.progress import MAX_ERROR_CHARS, Progress, counts_steps, restarts_from
from zmqflow.observe.rates import Rates, RateTracker, Reading
from zmqflow.ports import free_port
from zmqflow.rpc import CallContext, Service, op
from zmqflow.testing import local_cluster, make_spec, wait_until

from .conftest import ZMQFLOW, arun


@pytest.fixture
def fresh():
    """A fresh process-wide progress record, forgotten again after the test."""
    progress.reset()
    yield progress.record()
    progress.reset()


# the record ---------------------------------------------------------------------------------
def test_record_steps_samples_and_which_step_wins():
    clock = iter(range(100, 200)).__next__
    rec = Progress(restarts=2, clock=clock)
    assert rec.snapshot() == {"restarts": 2}
    rec.tick()
    rec.tick(samples=8)
    assert rec.snapshot() == {"restarts": 2, "step": 2, "samples": 8, "reported_at": 101}
    rec.report(step=40, samples=np.int64(8))  # the loop's own step replaces the counted one...
    rec.tick(samples=8)  # ...and an optimizer's count no longer moves it; samples still add up
    assert rec.snapshot()["step"] == 40 and rec.snapshot()["samples"] == 24
    rec.report(samples=8)
    assert rec.snapshot()["step"] == 40 and rec.snapshot()["samples"] == 32
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(InvalidArgument, match="report_progress"):
            rec.report(step=bad)
    assert rec.snapshot()["step"] == 40  # a refused report changed nothing


def test_errors_are_bounded_one_line_and_noted_once():
    rec = Progress()
    exc = ValueError("x" * 10_000 + "\nsecond line")
    rec.note_error(exc)
    rec.note_error(exc)  # the same exception again (a step, then the session's exit)
    snap = rec.snapshot()
    assert snap["errors"] == 1 and len(snap["error"]) == MAX_ERROR_CHARS and "\n" not in snap["error"]
    assert snap["error"].startswith("ValueError: xxx") and snap["error"].endswith("...")
    rec.note_error("ring generation 2 failed")
    assert rec.snapshot()["error"] == "ring generation 2 failed" and rec.snapshot()["errors"] == 2


def test_restart_count_comes_from_launch_environment():
    assert restarts_from({"ZMQFLOW_RESTART_COUNT": "3"}) == 3
    assert restarts_from({}) == 0 and restarts_from({"ZMQFLOW_RESTART_COUNT": "x"}) == 0


def test_concurrent_ticks_are_all_counted(fresh):
    def loop(_: int) -> None:
        for _ in range(2000):
            progress.tick(samples=1)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = progress.snapshot()
    assert snap["step"] == 8000 and snap["samples"] == 8000


def test_counts_steps_counts_returns_and_notes_escaping_errors(fresh):
    @counts_steps
    def step(fail: bool = False) -> str:
        if fail:
            raise RuntimeError("the step failed")
        return "ok"

    assert step() == "ok" and step() == "ok"
    with pytest.raises(RuntimeError):
        step(fail=True)
    snap = progress.snapshot()
    assert snap["step"] == 2 and snap["error"] == "RuntimeError: the step failed"


# the rates ----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=1, max_size=30), st.integers(0, 10_000), st.integers(0, 1 << 30),
       st.floats(1.0, 60.0))
def test_rates_recover_a_constant_rate(gaps, per_s, bytes_per_s, window):
    tracker = RateTracker(window=window)
    t = 3.0
    rates = tracker.update("w", Reading(t, 7, 0, 0, 0))
    assert rates.samples is None  # one reading: no basis
    for gap in gaps:
        t += gap
        rates = tracker.update("w", Reading(t, 7, int((t - 3.0) * 1000), round(per_s * (t - 3.0)), round(bytes_per_s * (t - 3.0))))
    assert rates.samples is not None and rates.bytes is not None and rates.steps is not None
    span = t - 3.0
    # the counters' rounding moves a rate by under 1/dt, dt >= min(span, window); rel: the float
    # error of ``t - 3.0`` (an ulp of t near 100 s) times a rate near 1e9 B/s
    tol = {"abs": 1.0 / min(span, window) + 1e-6, "rel": 1e-12}
    assert rates.samples == pytest.approx(per_s, **tol)
    assert rates.bytes == pytest.approx(bytes_per_s, **tol)
    assert rates.steps == pytest.approx(1000, **tol)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 100.0), st.integers(1, 3), st.integers(0, 1000), st.integers(0, 1000)),
                min_size=1, max_size=30))
def test_rates_are_never_negative_whatever_the_readings(readings):
    """Restarts (a new pid, a clock or counter that went back) start afresh, never a negative rate."""
    tracker = RateTracker(window=5.0)
    for t, pid, samples, nbytes in readings:
        r = tracker.update("w", Reading(t, pid, samples, samples, nbytes))
        for value in (r.steps, r.samples, r.bytes):
            assert value is None or value >= 0


def test_a_restarted_task_starts_its_rates_afresh():
    tracker = RateTracker()
    tracker.update("w", Reading(1.0, 10, 100, 1000, 0))
    assert tracker.update("w", Reading(2.0, 10, 110, 2000, 0)).samples == 1000
    assert tracker.update("w", Reading(0.5, 11, 0, 0, 0)).samples is None  # a new process
    assert tracker.update("w", Reading(1.5, 11, 5, 500, 0)).samples == 500
    assert tracker.update("w", Reading(1.5, 11, 5, 500, 0)).samples == 500  # the same reply twice
    tracker.forget("w")
    assert tracker.rates("w").samples is None
    with pytest.raises(InvalidArgument):
        RateTracker(window=0)


def test_cells_for_rates_and_errors():
    assert rate_text(None) == "-" and rate_text(12.34) == "12.3" and rate_text(2_500_000, "B") == "2.5MB"
    assert error_text({}) == "-"
    assert error_text({"error": "E: " + "y" * 100, "error_age_s": 10.0}, limit=30) == "10s ago: E: " + "y" * 15 + "..."
    assert error_text({"error": "E", "error_at": 90.0}) == "E"  # a wall time alone: no age (the clocks may differ)


def test_the_errors_age_is_measured_on_the_tasks_own_clock():
    mono = [100.0]
    rec = Progress(clock=lambda: 5000.0, monotonic=lambda: mono[0])
    rec.note_error(RuntimeError("boom"))
    mono[0] = 142.5
    snap = rec.snapshot()
    assert snap["error_at"] == 5000.0 and snap["error_age_s"] == 42.5


# the status reply ---------------------------------------------------------------------------
def test_status_reply_carries_progress_and_a_ps_shows_its_own_step(fresh):
    spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}"]})
    with zf.Server(spec, "ps:0") as ps, zf.Session(ps.target) as sess:
        rows = arun(cluster_status(spec, 5.0))
        assert rows[0]["progress"] == {"restarts": 0}  # nothing trains here, no step held: none shown
        step = sess.variable("global_step", np.zeros((), np.int64))  # asynchronous training's step
        step.assign_add(np.full((), 7, np.int64))
        assert arun(cluster_status(spec, 5.0))[0]["progress"]["step"] == 7
        progress.report_progress(step=3, samples=5)  # a loop in this process: its own step wins
        progress.note_error(RuntimeError("z" * 5000))
        p = arun(cluster_status(spec, 5.0))[0]["progress"]
        assert p["step"] == 3 and p["samples"] == 5 and len(p["error"]) == MAX_ERROR_CHARS


# the command, against real processes ---------------------------------------------------------
TRAIN = textwrap.dedent(
    """
    import os, sys, time, numpy as np, zmqflow as zf
    task, restarts = os.environ["ZMQFLOW_TASK"], os.environ["ZMQFLOW_RESTART_COUNT"]
    if task == "worker:1" and restarts == "0":
        sys.exit(5)  # fails once: launch restarts it with ZMQFLOW_RESTART_COUNT=1
    with zf.MonitoredTrainingSession(progress=False) as mon:
        mon.create({"w": np.zeros(4, np.float32)}, optimizer=zf.optim.SGD(0.1))
        i = 0
        while not os.path.exists(sys.argv[1]):
            mon.params()
            mon.apply({"w": np.ones(4, np.float32)})
            zf.report_progress(samples=32)
            i += 1
            if i == 3 and task == "worker:0":
                try:
                    mon.apply({"w": np.ones(5, np.float32)})  # a step that raises; the loop goes on
                except zf.errors.InvalidArgument:
                    pass
            time.sleep(0.02)
    """
)


def _table_rows(text: str) -> list[dict[str, list[str]]]:
    """Each printed refresh as {task: cells}, read back from rich's plain-text table."""
    refreshes: list[dict[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("zmqflow status:"):
            refreshes.append({})
        elif line.startswith("│") and refreshes:
            cells = [c.strip() for c in line.strip("│").split("│")]
            refreshes[-1][cells[0]] = cells
    return refreshes


def test_watch_shows_steps_rates_restarts_and_the_last_error(tmp_path, procs):
    script, stop, cfile = tmp_path / "train.py", tmp_path / "stop", tmp_path / "cluster.json"
    script.write_text(TRAIN)
    launcher = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--restart", "on-failure",
                      "--cluster-out", str(cfile), "--", sys.executable, str(script), str(stop)])
    wait_until(cfile.exists, 60, interval=0.05, what="the cluster file")
    spec = ClusterSpec(json.loads(cfile.read_text()))

    def ready() -> bool:
        rows = {r["task"]: r.get("progress", {}) for r in arun(cluster_status(spec, 1.0))}
        return rows["worker:0"].get("step", 0) >= 3 and "error" in rows["worker:0"] \
            and rows["worker:1"].get("restarts") == 1 and "samples" in rows["worker:1"]

    wait_until(ready, 90, interval=0.2, what="both workers training, worker:1 restarted")
    watch = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--watch", "--count", "3", "--interval", "0.2"],
                  env={"COLUMNS": "220"})
    assert watch.wait(60) == 0, watch.output
    refreshes = _table_rows(watch.output)
    assert len(refreshes) == 3, watch.output
    head = [c.strip() for c in next(ln for ln in watch.output.splitlines() if "TASK" in ln).strip("┃").split("┃")]
    col = {name: i for i, name in enumerate(head)}
    w0 = [r["worker:0"] for r in refreshes]
    steps = [int(cells[col["STEP"]]) for cells in w0]
    assert steps == sorted(steps) and steps[-1] > steps[0], watch.output
    assert w0[0][col["SAMPLES/S"]] == "-" and float(w0[-1][col["SAMPLES/S"]].rstrip("kM")) > 0, watch.output
    assert "InvalidArgument" in w0[-1][col["LAST ERROR"]] and "ago" in w0[-1][col["LAST ERROR"]]
    assert refreshes[-1]["worker:1"][col["RESTARTS"]] == "1" and w0[-1][col["RESTARTS"]] == "0"
    assert refreshes[-1]["worker:1"][col["LAST ERROR"]] == "-"
    assert refreshes[-1]["ps:0"][col["STEP"]].isdigit()  # the ps shows the global step it holds

    one_shot = procs([*ZMQFLOW, "status", "--cluster", str(cfile)])
    assert one_shot.wait(30) == 0
    header = one_shot.output.splitlines()[0]
    assert "STEP" in header and "RESTARTS" in header
    stop.write_text("")
    assert launcher.wait(60) == 0, launcher.output


def test_task_probes_only_that_task(tmp_path, procs):
    up = free_port()
    silent = socket.socket()  # ps:0's address: listens, never answers, and tells us if anyone came
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.setblocking(False)
    cfile = tmp_path / "cluster.json"
    cfile.write_text(json.dumps({"worker": [f"127.0.0.1:{up}"], "ps": [f"127.0.0.1:{silent.getsockname()[1]}"]}))
    server = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "worker:0"])
    server.wait_for_line("serving worker:0", 30)
    try:
        probe = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--task", "worker:0", "--timeout", "1"])
        assert probe.wait(30) == 0, probe.output
        assert "worker:0" in probe.output and "ps:0" not in probe.output
        with pytest.raises(BlockingIOError):
            silent.accept()  # no connection was ever made to the other task
        both = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--task", "worker:0", "--task", "ps:0",
                      "--timeout", "1", "--json"])
        assert both.wait(30) == 1
        assert [(r["task"], r["reachable"]) for r in json.loads(both.output)["tasks"]] == [("worker:0", True), ("ps:0", False)]
        for bad, says in (("worker", "malformed task"), ("ps:3", "unknown task ps:3"), ("chief:0", "unknown task")):
            p = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--task", bad, "--timeout", "1"])
            assert p.wait(30) == 2 and says in p.output and "Traceback" not in p.output, p.output
        wrong = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--count", "2"])
        assert wrong.wait(30) == 2 and "--watch" in wrong.output

        # --watch until Ctrl-C: exit 0, whatever the tasks do
        watch = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--watch", "--interval", "0.2", "--timeout", "0.5"])
        watch.wait_for_line("refresh 2", 30)
        watch.signal(signal.SIGINT)
        assert watch.wait(30) == 0, watch.output
        assert "Traceback" not in watch.output and "1/2 up" in watch.output
    finally:
        silent.close()


def test_torch_optimizer_steps_are_counted_and_a_failed_step_noted(fresh, local):
    torch = pytest.importorskip("torch")
    import zmqflow.torch as zt

    assert zt.report_progress is zf.report_progress
    model = torch.nn.Linear(3, 1)
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    zt.report_progress(samples=2)

    def closure():
        raise RuntimeError("loss is nan")

    with pytest.raises(RuntimeError):
        opt.step(closure)
    snap = progress.snapshot()
    assert snap["step"] == 3 and snap["samples"] == 2 and snap["error"] == "RuntimeError: loss is nan"
    rows = arun(cluster_status(runtime.current().spec, 5.0, tasks=[zf.TaskId("worker", 0)]))
    assert rows[0]["progress"]["step"] == 3  # the worker's server answers with this process's progress


# odd peers ------------------------------------------------------------------------------------
class OddMaster(Service):
    """A ``master`` that answers ping, and answers ``status`` with whatever it was given."""

    name = "master"

    def __init__(self, reply: object) -> None:
        super().__init__()
        self.reply = reply

    @op
    def ping(self, ctx: CallContext) -> dict:
        return {}

    @op
    def status(self, ctx: CallContext) -> object:
        return self.reply


ODD_REPLIES = [
    [1, 2, 3],  # not a map at all
    {"counters": None, "uptime_s": 1.0},
    {"uptime_s": "1.5", "pid": True, "roles": "ps"},
    {"state": {"ps": 5}, "counters": {"bytes_in": "7", "msgs_in": 2}},
    {"reachable": False, "task": "chief:9", "pid": 1},  # a reply may not say it is down, nor who it is
    {"progress": {"step": "x", "error": 5, "error_age_s": float("nan"), "restarts": None}, "pad": b"x"},
]


def test_odd_status_replies_show_as_odd_rows_and_every_other_task_still_shows():
    spec = make_spec({"worker": 1 + len(ODD_REPLIES)}, "tcp")

    def services(task: TaskId) -> dict:
        return {"master": OddMaster(ODD_REPLIES[task.index - 1])} if task.index else {}

    async def main() -> tuple[list[dict], str, str]:
        async with local_cluster(spec, timeout=30, services=services):
            rows = await cluster_status(spec, 5.0)
            table, lines = io.StringIO(), io.StringIO()
            await watch(spec, spec.tasks, 5.0, 0.05, 1, out=table)
            await watch(spec, spec.tasks, 5.0, 0.05, 2, as_json=True, out=lines)
            return rows, table.getvalue(), lines.getvalue()

    rows, table, lines = arun(main(), 60)
    by_task = {r["task"]: r for r in rows}
    assert list(by_task) == [str(t) for t in spec.tasks]  # the reply's own "task" does not rename a row
    assert by_task["worker:0"]["reachable"] and by_task["worker:0"]["roles"]
    assert by_task["worker:1"] == {"task": "worker:1", "address": str(spec.address(spec.tasks[1])),
                                   "reachable": False, "error": "malformed status reply"}
    assert all(by_task[f"worker:{i}"]["reachable"] for i in range(2, len(ODD_REPLIES) + 1))
    text = format_status(rows).splitlines()
    assert len(text) == 1 + len(rows) and text[2].endswith("malformed status reply")
    assert " 0.0s " in text[4] and text[5].endswith(" 5") and " 2/0 " in text[5]  # what has the type it needs
    for row in rows:
        cells = watch_cells(row, Rates())
        assert cells[0] == row["task"] and len(cells) == 9
    assert watch_cells(by_task["worker:1"], Rates())[-1] == "malformed status reply"
    assert watch_cells(by_task["worker:6"], Rates())[3] == "-"  # a step that is not an integer: none
    readings = [Reading.from_status(by_task[f"worker:{i}"]) for i in (3, 4)]
    assert (readings[0].t, readings[0].pid, readings[1].bytes) == (0.0, None, 0)
    assert json.loads(json.dumps(rows, default=json_value))[6]["pad"] == "<bytes>"
    assert sum(line.startswith("│ worker:") for line in table.splitlines()) == len(rows), table
    refreshes = [json.loads(line) for line in lines.splitlines()]
    assert [len(r["tasks"]) for r in refreshes] == [len(rows)] * 2


def test_a_status_reply_too_large_is_cut_off_by_the_socket_before_it_is_held():
    big = np.zeros(PROBE_MAX_BYTES // 4 * 2, np.float32)  # twice the limit, as one frame

    spec = make_spec({"worker": 2}, "tcp")

    async def main() -> list[dict]:
        services = {TaskId("worker", 1): {"master": OddMaster({"pad": big})}}
        async with local_cluster(spec, timeout=30, services=lambda t: services.get(t, {})):
            rows = await cluster_status(spec, 5.0)
            client = probe_client("status", 5.0)
            try:
                assert client.options.max_msg_bytes == PROBE_OPTIONS.max_msg_bytes == PROBE_MAX_BYTES
                with pytest.raises(Unavailable, match="dropped"):  # libzmq cut the connection: never decoded
                    await client.call(spec.address(spec.tasks[1]).endpoint, "master", "status", timeout=5.0)
            finally:
                client.close()
            return rows

    assert [r["reachable"] for r in arun(main(), 60)] == [True, False]


def test_watch_ages_the_last_error_by_the_tasks_clock_not_the_watchers(monkeypatch):
    mono = [100.0]
    # the task's host: its wall clock an hour ahead of the watcher's, its own monotonic clock
    progress.reset(Progress(clock=lambda: time.time() + 3600, monotonic=lambda: mono[0]))
    monkeypatch.delenv("COLUMNS", raising=False)
    try:
        progress.note_error(RuntimeError("CUDA out of memory"))
        mono[0] = 142.0  # 42 s on, as the task counts them

        async def main() -> str:
            async with local_cluster({"worker": 1}, timeout=30, transport="tcp") as servers:
                spec = next(iter(servers.values())).spec
                out = io.StringIO()
                await watch(spec, spec.tasks, 5.0, 0.05, 1, out=out)
                return out.getvalue()

        cells = _table_rows(arun(main(), 60))[0]["worker:0"]
        assert cells[-1].startswith("42s ago: RuntimeError: CUDA out of memory"), cells
    finally:
        progress.reset()


def test_launch_takes_an_odd_answer_for_a_ps_that_is_not_stopping():
    """launch's exit probe asks each ps whether it is stopping: an answer that is no map (whatever
    serves at that address) is not one, so it is stopped as before, and launch does not crash."""
    from zmqflow.cli.launch_exit import stopping

    spec = make_spec({"worker": 2}, "tcp")

    def services(task: TaskId) -> dict:
        return {"master": OddMaster([1, 2, 3] if task.index else {"stopping": True})}

    async def main() -> set:
        async with local_cluster(spec, timeout=30, services=services):
            return await asyncio.to_thread(stopping, spec, list(spec.tasks), None)

    assert arun(main(), timeout=60) == {TaskId("worker", 0)}
