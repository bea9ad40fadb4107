"""The timeline: per-task Chrome traces written by real processes, and ``zmqflow timeline merge``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from zmqflow.errors import InvalidArgument
from zmqflow.observe import timeline
from zmqflow.observe.trace_files import merge, read_trace

from .conftest import ZMQFLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORK = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    from zmqflow.bridge import runtime
    rt = runtime.init(timeout=30)
    s = rt.session
    s.variable("w", np.zeros((64, 8), np.float32))
    s.variable("g", np.zeros(4), optimizer=zf.optim.SyncReplicas(zf.optim.SGD(0.1), replicas_to_aggregate=2))
    for step in range(3):
        s.pull(["w"])
        s.push({"w": np.ones((64, 8), np.float32)})
        s.push({"g": np.ones(4)}, step=step)  # a sync round on ps:0
    rt.ring.allreduce(np.ones(1000, np.float32))  # small: one exchange
    rt.ring.allreduce(np.ones(600_000, np.float32), op="mean")  # 2.4 MB: the ring, in chunks
    rt.ring.allreduce(np.full(1000, 3, np.int32), op="mean")  # an integer mean divides in a pass of its own
    if rt.rank == 0:
        zf.checkpoint.save(s, sys.argv[1], step=1)
    rt.ring.barrier()
    print("done", flush=True)
    runtime.shutdown()
    """
)


def _launch(procs, tmp_path, script: str, *args: str, workers: int, ps: int):
    path = tmp_path / "work.py"
    path.write_text(script)
    env = {timeline.ENV: str(tmp_path / "tl" / "timeline.json")}
    cmd = [*ZMQFLOW, "launch", "--workers", str(workers), "--ps", str(ps), "--", sys.executable, str(path), *args]
    return procs(cmd, env=env)


def _spans(events, pid=None):
    return [e for e in events if e["ph"] == "X" and (pid is None or e["pid"] == pid)]


def _task_of(events) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}


def _threads(events) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def test_every_task_writes_its_own_trace_and_merge_joins_them(tmp_path, procs):
    p = _launch(procs, tmp_path, WORK, str(tmp_path / "ckpt"), workers=2, ps=1)
    assert p.wait(90) == 0, p.output
    files = sorted(os.listdir(tmp_path / "tl"))
    assert files == ["timeline.ps-0.json", "timeline.worker-0.json", "timeline.worker-1.json"], files
    for name in ("worker-0", "worker-1"):
        with open(tmp_path / "tl" / f"timeline.{name}.json") as fh:
            events = json.load(fh)  # a clean exit: one valid JSON array
        assert set(_task_of(events).values()) == {name.replace("-", ":")}
        spans = _spans(events)
        assert all(e["dur"] > 0 and e["ts"] > 1e15 for e in spans)  # wall-clock microseconds
        kinds = {(e["cat"], e["name"]) for e in spans}
        for want in [("pull", "pull"), ("push", "push"), ("ring", "negotiate"), ("ring", "allreduce"),
                     ("ring", "barrier"), ("ring wait", "wait"), ("ring send", "send"), ("ring reduce", "reduce"),
                     ("ring reduce", "mean")]:
            assert want in kinds, (name, want, sorted(kinds))
        assert (("checkpoint", "save") in kinds) == (name == "worker-0")
        # every thread is named after its kind, and spans on one thread never overlap partially
        threads = _threads(events)
        by_tid: dict[tuple[int, int], list] = {}
        for e in spans:
            assert threads[(e["pid"], e["tid"])].split(" ")[0] == e["cat"].split(" ")[0]
            by_tid.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        for tid, intervals in by_tid.items():
            intervals.sort()
            for (a0, a1), (b0, b1) in zip(intervals, intervals[1:]):
                assert b0 >= a1 - 1e-3 or b1 <= a1 + 1e-3, (threads[tid], (a0, a1), (b0, b1))
    with open(tmp_path / "tl" / "timeline.ps-0.json") as fh:
        rounds = [e for e in _spans(json.load(fh)) if e["cat"] == "sync round"]
    assert len(rounds) == 3 and all(e["args"]["members"] == ["worker:0", "worker:1"] for e in rounds), rounds
    # the merge: one process per task, from the files as they are
    out = tmp_path / "merged.json"
    r = subprocess.run([*ZMQFLOW, "timeline", "merge", str(out), str(tmp_path / "tl" / "timeline.*.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "3 task(s) from 3 file(s)" in r.stdout
    with open(out) as fh:
        merged = json.load(fh)["traceEvents"]
    tasks = _task_of(merged)
    assert sorted(tasks.values()) == ["ps:0", "worker:0", "worker:1"]
    assert {e["pid"] for e in merged} == set(tasks)
    saves = [e for e in _spans(merged) if e["name"] == "save"]
    assert len(saves) == 1 and tasks[saves[0]["pid"]] == "worker:0"
    # the two workers' allreduce spans overlap in time: the clocks line up
    calls = {tasks[e["pid"]]: e for e in _spans(merged) if e["name"] == "barrier"}
    w0, w1 = calls["worker:0"], calls["worker:1"]
    assert w0["ts"] < w1["ts"] + w1["dur"] and w1["ts"] < w0["ts"] + w0["dur"], (w0, w1)


KILLED = textwrap.dedent(
    """
    import os, signal, numpy as np
    from zmqflow.bridge import runtime
    from zmqflow.testing import wait_until
    from zmqflow.observe import timeline
    rt = runtime.init(timeout=30)
    s = rt.session
    s.variable("w", np.zeros(16, np.float32))
    for _ in range(5):
        s.push({"w": np.ones(16, np.float32)})
        s.pull(["w"])
    # then quiet: the recorder's own thread puts what is pending on disk within its flush interval
    path = timeline.recorder().base.replace(".json", ".worker-0.json")
    wait_until(lambda: os.path.exists(path) and open(path).read().count('"cat":"push"') == 5, 30, what="the flush")
    print("killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_process_leaves_a_trace_merge_still_reads(tmp_path, procs):
    path = tmp_path / "killed.py"
    path.write_text(KILLED)
    p = procs([sys.executable, str(path)], env={timeline.ENV: str(tmp_path / "t.json")})
    assert p.wait(60) == -signal.SIGKILL, p.output
    file = tmp_path / "t.worker-0.json"  # the bridge runtime named its task
    text = file.read_text()
    assert not text.rstrip().endswith("]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events = read_trace(str(file))
    assert len([e for e in _spans(events) if e["name"] == "push"]) == 5
    # a last event cut short (a kill mid-write elsewhere) is dropped, the rest kept
    cut = tmp_path / "cut.json"
    cut.write_text(text + ',\n{"ph":"X","name":"pu')
    assert read_trace(str(cut)) == events
    out = tmp_path / "m.json"
    r = subprocess.run([*ZMQFLOW, "timeline", "merge", str(out), str(cut)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    merged = json.loads(out.read_text())["traceEvents"]
    assert list(_task_of(merged).values()) == ["worker:0"]
    assert len(_spans(merged)) == len(_spans(events))


def test_merge_names_a_file_that_is_not_a_trace(tmp_path):
    good = tmp_path / "good.json"
    good.write_text("[]")
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    out = tmp_path / "out.json"
    r = subprocess.run([*ZMQFLOW, "timeline", "merge", str(out), str(good), str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "notes.txt: not a Chrome trace" in r.stderr, r.stderr
    assert not out.exists()
    for text in ('[{"ph":"X"}, 3]', '{"events": []}', '[{"ph":"X"}, {"ph": ]'):
        bad.write_text(text)
        with pytest.raises(InvalidArgument, match="notes.txt: not a Chrome trace"):
            read_trace(str(bad))
    r = subprocess.run([*ZMQFLOW, "timeline", "merge", str(out), str(tmp_path / "none-*.json")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no file matches" in r.stderr


@pytest.mark.parametrize("text, needle", [
    ('[{"ph":"X","name":"a","pid":[1],"tid":1,"ts":0,"dur":1}]', "event 1, ph 'X': 'pid' is an array"),
    ('{"traceEvents":[{"ph":"X","pid":1,"tid":1},{"ph":"X","pid":1,"tid":{"a":1}}]}',
     "event 2, ph 'X': 'tid' is an object"),
    ('[{"ph":"M","name":"process_name","pid":1,"args":["x"]}]', "'args' is an array, expected an object"),
    ('[{"ph":"X","pid":true}]', "'pid' is a boolean"),
])
def test_merge_names_an_event_whose_fields_it_cannot_use(tmp_path, text, needle):
    """Valid JSON with odd field types: one line naming the file and the event, no traceback."""
    bad = tmp_path / "odd.json"
    bad.write_text(text)
    with pytest.raises(InvalidArgument, match=f"odd.json: not a Chrome trace \\(.*{re.escape(needle)}"):
        read_trace(str(bad))
    out = tmp_path / "out.json"
    r = subprocess.run([*ZMQFLOW, "timeline", "merge", str(out), str(bad)], capture_output=True, text=True, timeout=60)
    (line,) = r.stderr.splitlines()
    assert r.returncode == 1 and line.startswith(f"zmqflow timeline merge: {bad}: not a Chrome trace (event ")
    assert needle in line and not out.exists()
    r = subprocess.run([*ZMQFLOW, "timeline", "merge", str(out), str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr == f"zmqflow timeline merge: {tmp_path}: a directory, not a timeline file\n"


def test_the_recorder_in_process(tmp_path):
    """Lanes for overlapping spans, instants, the closing bracket, and off means off."""
    assert timeline.task_path("a/t.json", "worker:3") == "a/t.worker-3.json"
    assert timeline.task_path("t.json", "ps:0", restart=2) == "t.ps-0.restart2.json"
    assert timeline.task_path("trace", None) == "trace"
    assert timeline.recorder() is None  # the suite runs without ZMQFLOW_TIMELINE
    assert timeline.span("push") is timeline.span("pull")  # off: one shared do-nothing object

    @timeline.traced("checkpoint", "save")
    def save(x: int) -> int:
        return x + 1

    rec = timeline.start(str(tmp_path / "t.json"))
    try:
        timeline.set_task("chief:0")
        with timeline.span("ring", "allreduce", task="worker:1") as args:
            args["bytes"] = 8
            with timeline.span("ring", "allreduce", task="worker:1"):  # overlaps: the next lane
                pass
        timeline.instant("recovery", "shard failed", args={"error": "gone"})
        assert save(1) == 2
        start = timeline.now_us()
        timeline.complete("ring send", "send", start)
        with pytest.raises(ValueError):
            with timeline.span("push"):
                raise ValueError("inside")
    finally:
        timeline.stop()
    assert rec.path == str(tmp_path / "t.chief-0.json")
    events = json.loads((tmp_path / "t.chief-0.json").read_text())
    tasks = _task_of(events)
    assert sorted(tasks.values()) == ["chief:0", "worker:1"]
    threads = _threads(events)
    ring = [e for e in _spans(events) if e["name"] == "allreduce"]
    assert sorted(threads[(e["pid"], e["tid"])] for e in ring) == ["ring", "ring 2"]
    assert {tasks[e["pid"]] for e in ring} == {"worker:1"}
    assert [e for e in ring if e.get("args")][0]["args"] == {"bytes": 8}
    (inst,) = [e for e in events if e["ph"] == "i"]
    assert inst["name"] == "shard failed" and tasks[inst["pid"]] == "chief:0"
    failed = [e for e in _spans(events) if e["name"] == "push"]
    assert failed[0]["args"] == {"error": "ValueError"}
    assert save(2) == 3 and timeline.recorder() is None


def test_merge_keeps_a_restarted_tasks_runs_on_one_process(tmp_path):
    """A task restarted under launch writes a second file (``.restart1``); both land on its one
    process, each run's threads on tracks of their own, tasks ordered chief, ps, workers."""
    paths = []
    for task, restart in (("worker:0", 0), ("worker:0", 1), ("ps:0", 0)):
        rec = timeline.start(str(tmp_path / "t.json"), task, restart)
        with timeline.span("push"):
            pass
        timeline.stop()
        paths.append(rec.path)
    assert [os.path.basename(p) for p in paths] == ["t.worker-0.json", "t.worker-0.restart1.json", "t.ps-0.json"]
    merged = merge(paths)
    tasks = _task_of(merged)
    assert tasks == {1: "ps:0", 2: "worker:0"}
    pushes = [e for e in _spans(merged) if e["name"] == "push"]
    assert sorted(e["pid"] for e in pushes) == [1, 2, 2]
    assert len({e["tid"] for e in pushes if e["pid"] == 2}) == 2
    assert all((e["pid"], e["tid"]) in _threads(merged) for e in pushes)


def test_a_task_named_only_by_tf_config_names_its_file_and_series(tmp_path):
    """A script in a pod or under a TF operator has no ZMQFLOW_TASK: TF_CONFIG names its task."""
    script = ("from zmqflow.observe import timeline, metrics\n"
              "with timeline.span('step', 'one'):\n    pass\n"
              "print(metrics.HUB.process.task)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ZMQFLOW_TASK", "ZMQFLOW_CLUSTER")}
    env.update({timeline.ENV: str(tmp_path / "t.json"), "PYTHONPATH": ROOT,
                "TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                         "task": {"type": "worker", "index": 1}})})
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["worker:1"]
    assert [e["name"] for e in _spans(read_trace(str(tmp_path / "t.worker-1.json")))] == ["one"]


def test_merge_never_reads_its_own_output_or_one_file_twice(tmp_path):
    """OUT spelled otherwise than the glob's match (./x, an absolute path, a link) is still OUT, and
    a file named twice is read once: a rerun writes the same trace, not every event once more."""
    for task in ("worker:0", "ps:0"):
        timeline.start(str(tmp_path / "timeline.json"), task)
        with timeline.span("push"):
            pass
        timeline.stop()
    os.symlink(tmp_path / "timeline.all.json", tmp_path / "latest.json")
    counts = []
    for out in ("./timeline.all.json", str(tmp_path / "timeline.all.json"), "latest.json", "./timeline.all.json"):
        r = subprocess.run([*ZMQFLOW, "timeline", "merge", out, "timeline.*.json", "./timeline.ps-0.json"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().endswith("of 2 task(s) from 2 file(s)"), r.stdout
        counts.append(len(json.loads((tmp_path / "timeline.all.json").read_text())["traceEvents"]))
    assert len(set(counts)) == 1, counts
    assert len(_spans(json.loads((tmp_path / "timeline.all.json").read_text())["traceEvents"])) == 2
