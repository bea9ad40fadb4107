"""Strategies and the monitored training session: every strategy trains the same model."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import zmqflow as zf

from .conftest import ZMQFLOW, launch_script

LR, STEPS, WORKERS = 0.1, 12, 2


def batch(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * worker + step)
    x = rng.standard_normal((8, 5))
    return x, x @ np.arange(15.0).reshape(5, 3) / 10 + 0.1 * rng.standard_normal((8, 3))


def grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return 2.0 * x.T @ (x @ w - y) / len(x)


def w0() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((5, 3))


SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    sys.path.insert(0, sys.argv[3])
    from tests.test_training import LR, STEPS, batch, grad, w0
    strategy = {"sync-ps": zf.ParameterServerStrategy(sync=True), "ps": zf.ParameterServerStrategy(),
                "ring": zf.RingAllReduceStrategy()}[sys.argv[1]]
    with zf.MonitoredTrainingSession(strategy=strategy, hooks=[zf.StopAtStep(STEPS)], progress=False) as mon:
        mon.create({"w": w0()}, optimizer=zf.optim.SGD(LR))
        local = 0
        while not mon.should_stop():
            x, y = batch(mon.worker_index, local)
            mon.apply({"w": grad(mon.params()["w"], x, y)})
            local += 1
        final = mon.params()["w"]
        np.save(f"{sys.argv[2]}/{mon.task_name}.npy", final)
        print("steps", mon.step, "local", local, flush=True)
    """
)


def reference() -> np.ndarray:
    """Single-process SGD on the combined batches of both workers."""
    w = w0()
    for step in range(STEPS):
        w = w - LR * sum(grad(w, *batch(k, step)) for k in range(WORKERS)) / WORKERS
    return w


def _run(tmp_path, procs, strategy: str, ps: int) -> dict[str, np.ndarray]:
    root = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    p = launch_script(procs, tmp_path / "train.py", SCRIPT, strategy, tmp_path, root, workers=WORKERS, ps=ps)
    assert p.wait(120) == 0, p.output
    return {f"worker:{i}": np.load(tmp_path / f"worker:{i}.npy") for i in range(WORKERS)}


@pytest.mark.parametrize("strategy,ps", [("sync-ps", 1), ("ring", 0)])
def test_sync_strategies_equal_single_process_sgd(tmp_path, procs, strategy, ps):
    finals = _run(tmp_path, procs, strategy, ps)
    expected = reference()
    for task, w in finals.items():
        np.testing.assert_allclose(w, expected, rtol=0, atol=1e-10, err_msg=task)


def test_async_ps_converges(tmp_path, procs):
    finals = _run(tmp_path, procs, "ps", 1)
    x, y = batch(9, 9)
    start = float(((x @ w0() - y) ** 2).mean())
    end = float(((x @ finals["worker:0"] - y) ** 2).mean())
    assert end < 0.2 * start, (start, end)


def test_local_strategy_matches_plain_sgd():
    with zf.MonitoredTrainingSession(hooks=[zf.StopAtStep(STEPS)], progress=False) as mon:
        assert mon.is_chief and mon.strategy.name == "local"
        mon.create({"w": w0()}, optimizer=zf.optim.SGD(LR))
        step = 0
        while not mon.should_stop():
            x, y = batch(0, step)
            mon.apply({"w": grad(mon.params()["w"], x, y)}, metrics={"loss": 1.0})
            step += 1
        w = w0()
        for s in range(STEPS):
            w = w - LR * grad(w, *batch(0, s))
        np.testing.assert_allclose(mon.params()["w"], w, rtol=0, atol=1e-12)
        t = mon.timings()
        assert t["steps"] == STEPS and t["seconds"] >= t["communication_s"] >= 0


@pytest.mark.parametrize("strategy", ["sync-ps", "ps", "ring"])
def test_demo_reaches_its_accuracy(tmp_path, procs, strategy):
    """300 steps of each worker: the asynchronous global step counts every worker's push, so it
    runs to 600, the examples the other strategies see (at 300, half of them, its accuracy under
    load has spread down to 0.875)."""
    result = tmp_path / "result.json"
    steps = 600 if strategy == "ps" else 300
    p = procs([*ZMQFLOW, "demo", "--strategy", strategy, "--steps", str(steps), "--result", str(result)])
    assert p.wait(180) == 0, p.output
    got = json.loads(result.read_text())
    assert got["test_accuracy"] >= 0.90, got
    assert got["workers"] == 2 and got["samples_per_s"] > 0
    assert "test accuracy" in p.output and "[worker:0]" in p.output


def test_summary_hook_writes_json_lines_without_tensorboardx(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name.startswith("tensorboardX"):
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    hook = zf.SummaryHook(every_n_steps=2, output_dir=str(tmp_path))
    with zf.MonitoredTrainingSession(hooks=[zf.StopAtStep(6), hook], progress=False) as mon:
        mon.create({"w": np.zeros(1)}, optimizer=zf.optim.SGD(0.1))
        while not mon.should_stop():
            mon.apply({"w": np.ones(1)}, metrics={"loss": float(mon.step)})
    lines = [json.loads(x) for x in (tmp_path / "summaries-local.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 3, 5]  # the first step, then every 2 on (TF's SecondOrStepTimer)
    assert [x["metrics"] for x in lines] == [{"loss": 0.0}, {"loss": 2.0}, {"loss": 4.0}]


SYNC_CRASH = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    marker = os.path.join(sys.argv[1], os.environ["ZMQFLOW_TASK"] + ".started")
    first_run = not os.path.exists(marker)
    open(marker, "a").close()
    with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(sync=True), hooks=[zf.StopAtStep(30)],
                                     progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
        print("joined at step", mon.step, "first" if first_run else "again", flush=True)
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
            if first_run and mon.task_name == "worker:1" and mon.step == 5:
                os._exit(1)  # dies holding no token: the others must not hang
        print("finished at step", mon.step, flush=True)
    """
)


@pytest.mark.parametrize("restart", [False, True])
def test_sync_ps_goes_on_without_a_dead_worker_and_takes_it_back(tmp_path, procs, restart):
    p = launch_script(procs, tmp_path / "sync_crash.py", SYNC_CRASH, tmp_path, workers=2, ps=1, restart=restart)
    code = p.wait(120)
    assert "[worker:0] finished at step 30" in p.output, p.output
    if restart:  # the restarted worker rejoins the synchronous steps where they are, and trains on
        assert code == 0, p.output
        assert "restarting worker:1" in p.output and "[worker:1] finished at step 30" in p.output
        assert "[worker:1] joined at step" in p.output and " again" in p.output
    else:  # no one brings it back: the survivor's steps complete without it (and the run reports the failure)
        assert code == 1, p.output
        assert "completes with 1 of 2 replicas; gone: worker:1" in p.output


CHIEF_DIES = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    marker = os.path.join(sys.argv[1], os.environ["ZMQFLOW_TASK"] + ".started")
    first_run = not os.path.exists(marker)
    open(marker, "a").close()
    with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(), checkpoint_dir=os.path.join(sys.argv[1], "ckpt"),
                                     save_checkpoint_steps=10, hooks=[zf.StopAtStep(120)], progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.01))
        print("joined", "first" if first_run else "again", "restored" if mon.restored_from else "live", flush=True)
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
            if first_run and mon.is_chief and mon.step >= 30:
                os._exit(1)  # the chief dies; the workers do not need it to go on
        print("finished at step", mon.step, flush=True)
    """
)


def test_a_chief_that_comes_back_takes_its_role_without_restoring_over_live_state(tmp_path, procs):
    p = launch_script(procs, tmp_path / "chief.py", CHIEF_DIES, tmp_path, workers=2, ps=1, restart=True)
    assert p.wait(120) == 0, p.output
    assert "restarting worker:0" in p.output
    assert "[worker:0] joined again live" in p.output  # the returning chief did not restore a checkpoint
    assert "[worker:1] finished at step" in p.output and "[worker:0] finished at step" in p.output


class _Recording(zf.LocalStrategy):
    """A local strategy that records what it was bound to."""

    def bind(self, ctx):
        self.bound_to = ctx
        super().bind(ctx)


def test_strategies_are_bound_to_a_context_not_to_the_monitored_session(tmp_path):
    from zmqflow.training.context import TrainingContext

    strategy = _Recording()
    with zf.MonitoredTrainingSession(strategy, checkpoint_dir=str(tmp_path), save_checkpoint_steps=2, progress=False) as mon:
        ctx = strategy.bound_to
        assert isinstance(ctx, TrainingContext) and not isinstance(ctx, zf.MonitoredTrainingSession)
        assert (ctx.task, ctx.spec, ctx.session, ctx.is_chief, ctx.task_name) == (None, None, None, True, "local")
        assert ctx.checkpoint_dir == str(tmp_path) and ctx.num_workers == 1 and ctx.worker_index == 0
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.5))
        for _ in range(3):
            mon.apply({"w": np.ones(2)})
        assert ctx.step == mon.step == 3 and ctx.saved_step == 2  # the session's checkpoint bookkeeping lives there
    # a second run restores, and the context says from what
    with zf.MonitoredTrainingSession(_Recording(), checkpoint_dir=str(tmp_path), progress=False) as again:
        again.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.5))
        assert again.step == 3 and again.restored_from is not None and again.restored_from.endswith("checkpoint-0000000003.json")
        np.testing.assert_allclose(again.params()["w"], [-1.5, -1.5])


def test_the_chiefs_duties_move_through_the_context():
    from zmqflow.training.context import TrainingContext

    members = [zf.TaskId("worker", 0), zf.TaskId("worker", 1)]
    ctx = TrainingContext(spec=zf.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}), task=members[1],
                          chief_task=members[0], members=members)
    assert ctx.acting_chief == members[0] and not ctx.is_chief and ctx.worker_index == 1 and ctx.num_workers == 2
    ctx.acting_chief = members[1]  # what a strategy does when the chief is gone
    assert ctx.is_chief
    ctx.acting_chief = None  # no one yet
    assert not ctx.is_chief


class _Run:
    """Just what the TrainingRun protocol names: hooks need nothing more."""

    def __init__(self, hooks):
        self.step, self.is_chief, self.task_name, self.worker_index, self.num_workers = 0, True, "local", 0, 1
        self.checkpoint_dir, self.hooks, self.stopped = None, hooks, False
        self.strategy = type("S", (), {"name": "stub"})()

    def params(self):
        return {}

    def timings(self):
        return {}

    def request_stop(self):
        self.stopped = True


def test_hooks_run_against_the_protocol_alone(capsys):
    stop = zf.StopAtStep(num_steps=3)
    progress = zf.ProgressHook()
    run = _Run([stop, progress])  # satisfies zf.training.hooks.TrainingRun
    run.step = 4
    for hook in run.hooks:
        hook.begin(run)
    assert stop.last_step == 7 and progress.total == 7
    run.step = 7
    progress.after_step(run, 7, {"loss": 0.5})
    assert stop.should_stop(run) and "step 7/7" in capsys.readouterr().out


def test_a_hook_can_request_a_stop():
    class StopOnNaN(zf.Hook):
        def after_step(self, mon, step, metrics):
            if metrics["loss"] != metrics["loss"]:
                mon.request_stop()

    with zf.MonitoredTrainingSession(hooks=[StopOnNaN()], progress=False) as mon:
        mon.create({"w": np.zeros(1)}, optimizer=zf.optim.SGD(0.1))
        while not mon.should_stop():
            mon.apply({"w": np.ones(1)}, metrics={"loss": float("nan") if mon.step == 4 else 1.0})
    assert mon.step == 5
