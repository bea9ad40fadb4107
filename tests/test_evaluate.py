"""The evaluator: checkpoints as they land, the end of training, train_and_evaluate, launch --evaluator."""

from __future__ import annotations

import json
import os
import queue
import tempfile
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from zmqflow.observe import metrics

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.cluster import ClusterSpec, TaskId, shard_tasks, training_tasks
from zmqflow.errors import InvalidArgument
from zmqflow.training.evaluate import task_role
from zmqflow.testing import make_spec
from zmqflow.transport.curve import generate

from .conftest import ZMQFLOW

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def trainer(tmp_path):
    """A real ps shard and a session on it, holding ``w``: ``save(step, value)`` checkpoints it."""
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    ps = zf.Server(spec, "ps:0", checkpoint_roots=[str(tmp_path)])
    worker = zf.Server(spec, "worker:0")
    sess = zf.Session(worker.target, name="trainer")
    w = sess.variable("w", np.zeros(3))

    def save(step: int, value: float) -> str:
        w.assign(np.full(3, value))
        return checkpoint.save(sess, str(tmp_path / "ckpt"), step=step, keep=100)

    save.session = sess  # type: ignore[attr-defined]
    yield save
    sess.close()
    worker.stop()
    ps.stop()


def _steps(paths: list[str]) -> list[int]:
    return [checkpoint.checkpoint_step(p) for p in paths]


def test_iterator_yields_each_complete_checkpoint_once_in_order_and_stops_at_the_final_one(tmp_path, trainer):
    ckpt = str(tmp_path / "ckpt")
    trainer(1, 1.0)
    trainer(2, 2.0)
    # a save that never committed: shard file there, manifest naming a file that is not (its writer died)
    latest = json.loads(Path(checkpoint.latest(ckpt)).read_text())
    latest["step"], latest["shards"][0]["file"] = 9, "step0000000009-gone-ps0.npz"
    Path(ckpt, checkpoint.manifest_name(9) + ".tmp-x").write_text("{")  # and a half-written manifest
    broken = Path(ckpt, checkpoint.manifest_name(99))
    broken.write_text(json.dumps(latest))
    seen: queue.Queue[str] = queue.Queue()
    done = threading.Event()

    def consume() -> None:
        for path in checkpoint.checkpoints_iterator(ckpt, poll_secs=0.02):
            seen.put(path)
        done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    got = [seen.get(timeout=20), seen.get(timeout=20)]
    assert _steps(got) == [1, 2]  # what was there, oldest first
    trainer(3, 3.0)  # lands while the watcher waits
    got.append(seen.get(timeout=20))
    broken.unlink()  # (it would never complete)
    trainer(5, 5.0)
    got.append(seen.get(timeout=20))
    trainer(4, 4.0)  # older than the last one yielded: never yielded
    checkpoint.mark_final(ckpt)
    assert done.wait(20), "the iterator did not stop at the final marker"
    while not seen.empty():
        got.append(seen.get())
    assert _steps(got) == [1, 2, 3, 5, 4]  # in the order they were saved
    assert all(p in checkpoint.checkpoints(ckpt) for p in got)  # every one complete
    thread.join(5)


def test_iterator_timeout_asks_timeout_fn_and_waits_again_when_it_says_no(tmp_path):
    calls: list[float] = []

    def timeout_fn() -> bool:
        calls.append(time.monotonic())
        return len(calls) == 2

    start = time.monotonic()
    assert list(checkpoint.checkpoints_iterator(str(tmp_path), timeout=0.2, timeout_fn=timeout_fn, poll_secs=0.05)) == []
    assert len(calls) == 2 and calls[0] - start >= 0.2 and calls[1] - calls[0] >= 0.2
    assert list(checkpoint.checkpoints_iterator(str(tmp_path), timeout=0.05, poll_secs=0.01)) == []  # no fn: stop
    with pytest.raises(InvalidArgument, match="poll_secs"):
        next(checkpoint.checkpoints_iterator(str(tmp_path), poll_secs=0))


def test_final_marker_without_checkpoints_stops_at_once_and_a_chief_starting_clears_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    checkpoint.mark_final(ckpt)
    assert checkpoint.final_step(ckpt) == -1
    assert list(checkpoint.checkpoints_iterator(ckpt, poll_secs=0.01)) == []
    with zf.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=2, hooks=[zf.StopAtStep(4)],
                                     progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
        assert checkpoint.final_step(ckpt) is None  # training again: not finished
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
    assert checkpoint.final_step(ckpt) == 4
    with pytest.raises(RuntimeError):  # a run that fails does not say it finished
        with zf.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=2, progress=False) as mon:
            mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
            raise RuntimeError("boom")
    assert checkpoint.final_step(ckpt) is None


def test_evaluator_restores_privately_and_writes_metrics(tmp_path, trainer, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    trainer(10, 1.0)
    trainer(20, 2.0)
    trainer.session.get("w").assign(np.full(3, 100.0))  # training goes on past the checkpoints
    checkpoint.mark_final(ckpt, 20)
    seen: list[tuple[int, np.ndarray]] = []

    def eval_fn(ck: zf.EvalCheckpoint) -> dict[str, float]:
        w = ck.params()["w"]
        seen.append((ck.step, w))
        return {"mean": float(w.mean()), "n": len(w)}

    ev = zf.Evaluator(eval_fn, ckpt, poll_secs=0.02)
    assert ev.run() == {"mean": 2.0, "n": 3.0}
    assert [(s, float(w[0])) for s, w in seen] == [(10, 1.0), (20, 2.0)]
    np.testing.assert_array_equal(trainer.session.get("w").read(), np.full(3, 100.0))  # training's shard untouched
    lines = [json.loads(x) for x in Path(ckpt, "eval", "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["metrics"]["mean"]) for x in lines] == [(10, 1.0), (20, 2.0)]
    # and Prometheus: the process's registry holds the last evaluation
    assert metrics.HUB.registry.get_sample_value("zmqflow_eval", {"metric": "mean"}) == 2.0
    assert metrics.HUB.registry.get_sample_value("zmqflow_eval_step") == 20
    # under launch --keys the training cluster's keys are in the environment: the private cluster makes its own
    keys = tmp_path / "keys"
    generate(keys, make_spec({"worker": 1, "evaluator": 1}, "tcp"))
    monkeypatch.setenv("ZMQFLOW_KEYS", str(keys))
    monkeypatch.setenv("ZMQFLOW_TASK", "evaluator:0")
    ev = zf.Evaluator(eval_fn, ckpt, output_dir=str(tmp_path / "keyed"), poll_secs=0.02)
    private_keys = lambda: {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("zmqflow-eval-keys-")}  # noqa: E731
    before = private_keys()
    assert ev.run() == {"mean": 2.0, "n": 3.0}
    assert private_keys() == before  # its own keys, removed when it ends
    monkeypatch.delenv("ZMQFLOW_KEYS")
    with pytest.raises(InvalidArgument, match="mapping"):
        zf.Evaluator(lambda ck: 1.0, ckpt, output_dir=str(tmp_path / "e2")).run()


def test_the_evaluator_is_no_part_of_training():
    spec = ClusterSpec({"evaluator": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    assert training_tasks(spec) == [TaskId("worker", 0), TaskId("worker", 1)]
    assert shard_tasks(spec) == [TaskId("worker", 0)]  # state never lands on the evaluator
    # TF's TF_CONFIG for the evaluator often leaves it out of the cluster: it is still the evaluator
    tf = {"cluster": {"worker": ["127.0.0.1:2"]}, "task": {"type": "evaluator", "index": 0}}
    assert task_role(tf) == "evaluator"
    assert task_role(spec, "worker:1") == "worker"
    # a training task waits for every training task, not for the evaluator (it serves nothing)
    spec = make_spec({"worker": 1, "ps": 1, "evaluator": 1}, "tcp")
    with zf.Server(spec, "ps:0"), zf.Server(spec, "worker:0") as worker:
        worker.wait_for_cluster(10)


SCRIPT = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    from zmqflow.testing import wait_until
    sys.path.insert(0, sys.argv[2])
    from tests.test_training import batch, grad, w0
    ckpt = os.path.join(sys.argv[1], "ckpt")
    started = os.path.join(sys.argv[1], "evaluator.started")
    if os.environ["ZMQFLOW_TASK"].startswith("evaluator"):
        open(started, "w").close()

    def train():
        with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(sync=True), checkpoint_dir=ckpt,
                                         save_checkpoint_steps=5, keep_checkpoints=10,
                                         hooks=[zf.StopAtStep(30)], progress=False) as mon:
            mon.create({"w": w0()}, optimizer=zf.optim.SGD(0.03))  # slow enough that each checkpoint is better
            wait_until(lambda: os.path.exists(started), 60, what="the evaluator")
            ring = zf.Ring(mon.server, timeout=30)  # the ranks alone, while the evaluator runs
            total = ring.allreduce([np.array([mon.worker_index + 1.0])])[0]
            print("ring", ring.size, "sum", float(total[0]), flush=True)
            local = 0
            while not mon.should_stop():
                x, y = batch(mon.worker_index, local)
                mon.apply({"w": grad(mon.params()["w"], x, y)})
                local += 1
            ring.leave()

    x_eval, y_eval = batch(77, 0)

    def evaluate(ck):
        w = ck.params()["w"]
        return {"loss": float(((x_eval @ w - y_eval) ** 2).mean())}

    last = zf.train_and_evaluate(train, evaluate, checkpoint_dir=ckpt, poll_secs=0.1)
    print("last metrics", last, flush=True)
    """
)


def test_launch_evaluator_evaluates_every_checkpoint_and_ends_after_the_final_one(tmp_path, procs):
    (tmp_path / "train.py").write_text(SCRIPT)
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", "--evaluator", "--",
               sys.executable, str(tmp_path / "train.py"), str(tmp_path), ROOT])
    assert p.wait(110) == 0, p.output
    out = p.output
    assert "[worker:0] ring 2 sum 3.0" in out and "[worker:1] ring 2 sum 3.0" in out, out
    assert '"evaluator": ["127.0.0.1:' in out and "stopping it" not in out, out
    lines = [json.loads(x) for x in (tmp_path / "ckpt" / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [5, 10, 15, 20, 25, 30], out
    losses = [x["metrics"]["loss"] for x in lines]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.5 * losses[0], losses
    assert "[evaluator:0] last metrics {'loss': " in out and "[worker:0] last metrics None" in out, out


EXITS = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["ZMQFLOW_TASK"].startswith("evaluator"):
        if sys.argv[1] == "fail":
            sys.exit(3)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("how", ["fail", "linger"])
def test_launch_exit_code_is_the_training_tasks_and_a_lingering_evaluator_is_stopped(tmp_path, procs, how):
    (tmp_path / "s.py").write_text(EXITS)
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--evaluator", "--evaluator-grace", "0.5", "--",
               sys.executable, str(tmp_path / "s.py"), how])
    assert p.wait(60) == 0, p.output
    if how == "fail":
        assert "evaluator:0 exited with" in p.output, p.output
    else:
        assert "evaluator:0 still running 0.5s after training ended; stopping it" in p.output, p.output


def test_train_and_evaluate_without_a_cluster_trains_then_evaluates(tmp_path, monkeypatch):
    for var in ("ZMQFLOW_CLUSTER", "ZMQFLOW_TASK", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    ckpt = str(tmp_path / "ckpt")

    def train() -> None:
        with zf.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=3, hooks=[zf.StopAtStep(9)],
                                         progress=False) as mon:
            mon.create({"w": np.full(2, 8.0)}, optimizer=zf.optim.SGD(0.25))
            while not mon.should_stop():
                mon.apply({"w": mon.params()["w"]})  # the gradient of |w|^2 / 2

    last = zf.train_and_evaluate(train, lambda ck: {"norm": float(np.abs(ck.params()["w"]).sum())},
                                 checkpoint_dir=ckpt, poll_secs=0.02)
    assert last == {"norm": pytest.approx(16 * 0.75 ** 9)}
    lines = [json.loads(x) for x in Path(ckpt, "eval", "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3, 6, 9]
    with pytest.raises(InvalidArgument, match="checkpoint_dir"):
        zf.train_and_evaluate(train, lambda ck: {}, checkpoint_dir="")


def test_with_evaluator_adds_one_task_to_a_cluster_that_trains():
    from zmqflow.cli.launch_roles import with_evaluator
    from zmqflow.errors import ConfigError

    spec = with_evaluator(ClusterSpec({"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}))
    assert spec.task_indices("evaluator") == [0] and spec.num_tasks("worker") == 1
    with pytest.raises(ConfigError, match="already has an evaluator"):
        with_evaluator(spec)
    with pytest.raises(ConfigError, match="no chief or worker"):
        with_evaluator(ClusterSpec({"ps": ["127.0.0.1:3"]}))
