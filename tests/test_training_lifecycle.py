"""When the monitored session saves and hooks act on a jumping global step, and how it closes: a
failed loop leaves no checkpoint of a half-applied step, and every cleanup step runs."""

from __future__ import annotations

import builtins
import json
import logging

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client import checkpoint, checkpoint_watch
from zmqflow.errors import InvalidArgument
from zmqflow.testing import make_spec
from zmqflow.training.hooks import EveryNSteps

from .test_training import _Run


class _Jumping(zf.LocalStrategy):
    """An async ps seen from the chief: another worker pushes between two of its own steps, so the
    global step starts at 1 and advances by 2 (never a multiple of 10)."""

    def __init__(self) -> None:
        self.saved_at: list[int] = []

    def create(self, params, optimizer, restore=None):
        super().create(params, optimizer, restore)
        self.step = 1
        return self.step

    def apply(self, grads):
        super().apply(grads)
        self.step += 1
        return self.step

    def save(self, directory, step, keep):
        self.saved_at.append(step)
        return super().save(directory, step, keep)


def test_checkpoints_follow_a_global_step_that_jumps(tmp_path):
    strategy = _Jumping()
    with zf.MonitoredTrainingSession(strategy, checkpoint_dir=str(tmp_path), save_checkpoint_steps=10,
                                     keep_checkpoints=10, hooks=[zf.StopAtStep(61)], progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
        assert strategy.saved_at == [11, 21, 31, 41, 51, 61]  # counted from create's step 1, as TF's saver hook
    assert len(strategy.saved_at) == 6 and checkpoint_watch.final_step(str(tmp_path)) == 61  # not saved twice


@pytest.fixture
def no_tensorboardx(monkeypatch):
    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name.startswith("tensorboardX"):
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)


def test_periodic_hooks_follow_a_global_step_that_jumps(tmp_path, caplog, no_tensorboardx):
    logging_hook, summary = zf.LoggingHook(every_n_steps=10), zf.SummaryHook(every_n_steps=10, output_dir=str(tmp_path))
    run = _Run([logging_hook, summary])
    for hook in run.hooks:
        hook.begin(run)
    with caplog.at_level(logging.INFO, logger="zmqflow.training"):
        for step in range(1, 62, 2):
            for hook in run.hooks:
                hook.after_step(run, step, {"loss": float(step)})
    summary.end(run)
    expected = [1, 11, 21, 31, 41, 51, 61]  # the first step, then each 10 further on (TF's SecondOrStepTimer)
    logged = [r.args[0] for r in caplog.records if r.name == "zmqflow.training"]
    assert logged == expected
    assert "steps/s" not in caplog.records[0].getMessage() and "steps/s" in caplog.records[1].getMessage()
    lines = [json.loads(x) for x in (tmp_path / "summaries-local.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == expected


def test_every_n_steps_starts_over_after_a_rewind():
    timer = EveryNSteps(5)
    assert timer.due(3)  # the first step asked about
    timer.acted(3)
    assert not timer.due(3) and not timer.due(7) and timer.due(8)
    timer.acted(40)
    assert timer.due(20)  # a restore set the step back: count from there
    timer.reset()
    assert timer.due(40)


class _Ends(zf.Hook):
    def __init__(self, error: str | None = None) -> None:
        self.error, self.ended = error, False

    def end(self, mon):
        self.ended = True
        if self.error:
            raise RuntimeError(self.error)


def test_a_failed_loop_saves_nothing_and_ends_no_hook(tmp_path):
    hook = _Ends()
    with pytest.raises(ValueError, match="the loop failed"):
        with zf.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), save_checkpoint_steps=100, hooks=[hook],
                                         progress=False) as mon:
            mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(1.0))
            mon.apply({"w": np.ones(2)})
            raise ValueError("the loop failed")
    # as TF's MonitoredSession: end() and the last save only on a clean exit
    assert checkpoint.latest(str(tmp_path)) is None and checkpoint_watch.final_step(str(tmp_path)) is None
    assert not hook.ended


def test_a_step_with_one_bad_gradient_applies_none():
    with zf.MonitoredTrainingSession(progress=False) as mon:
        mon.create({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}, optimizer=zf.optim.SGD(1.0))
        mon.apply({"a": np.ones(3), "b": np.ones(3)})
        with pytest.raises(InvalidArgument, match="gradient of b"):
            mon.apply({"a": np.ones(3), "b": np.ones(4)})
        got = mon.params()
        np.testing.assert_array_equal(got["a"], [-1, -1, -1])  # not half applied
        np.testing.assert_array_equal(got["b"], [-1, -1, -1])
        assert mon.step == 1


class _ClosingPS(zf.ParameterServerStrategy):
    def __init__(self, error: str | None = None) -> None:
        super().__init__()
        self.error, self.closed = error, False

    def close(self):
        super().close()
        self.closed = True
        if self.error:
            raise OSError(self.error)


def test_every_cleanup_step_runs_when_a_hook_end_fails():
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    strategy, later = _ClosingPS(), _Ends()
    hooks = [_Ends("first end failed"), _Ends("second end failed"), later]
    with zf.Server(spec, "ps:0", exit_when_done=True) as ps:
        with pytest.raises(RuntimeError, match="first end failed") as info:
            with zf.MonitoredTrainingSession(strategy, spec, "worker:0", hooks=hooks, progress=False) as mon:
                mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
                mon.apply({"w": np.ones(2)})
        assert any("second end failed" in note for note in info.value.__notes__)
        assert later.ended and strategy.closed
        assert mon.server.join(0)  # its own server stopped
        assert ps.join(10)  # the goodbye (finished) reached the ps, which exits when training is done


def test_the_loops_error_stays_the_one_raised_when_cleanup_fails():
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    strategy = _ClosingPS("ring already gone")
    with zf.Server(spec, "ps:0"):
        with pytest.raises(ValueError, match="the loop failed") as info:
            with zf.MonitoredTrainingSession(strategy, cluster=spec, task="worker:0", progress=False) as mon:
                mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
                raise ValueError("the loop failed")
        assert any("ring already gone" in note for note in info.value.__notes__)
        assert strategy.closed and mon.server.join(0)


def test_a_metric_that_is_not_one_number_is_refused_before_the_step(tmp_path):
    """Refused before the update: the step is not applied, nothing is saved, and a retry applies it once."""
    with zf.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), save_checkpoint_steps=1, progress=False) as mon:
        mon.create({"w": np.zeros(2, np.float32)}, optimizer=zf.optim.SGD(1.0))
        for bad in (np.array([0.5, 0.7]), "0.5", None, [0.5]):
            with pytest.raises(InvalidArgument, match="metric 'loss': expected one number"):
                mon.apply({"w": np.ones(2, np.float32)}, metrics={"loss": bad})
        assert mon.step == 0 and checkpoint.latest(str(tmp_path)) is None
        np.testing.assert_array_equal(mon.params()["w"], [0, 0])
        mon.apply({"w": np.ones(2, np.float32)}, metrics={"loss": np.float32(0.5), "acc": np.array([0.25])})
        assert mon.step == 1 and checkpoint.latest(str(tmp_path)).endswith(checkpoint.manifest_name(1))
        np.testing.assert_array_equal(mon.params()["w"], [-1, -1])  # applied once


class _FailsAt(zf.Hook):
    """Raises at one step (a full disk, say); notes the newest checkpoint each step it is called."""

    def __init__(self, step: int) -> None:
        self.step, self.seen = step, []

    def after_step(self, mon, step, metrics):
        self.seen.append((step, checkpoint.latest(mon.checkpoint_dir)))
        if step == self.step:
            raise OSError(28, "No space left on device")


def test_a_hook_that_raises_does_not_cost_the_checkpoint_due_at_its_step(tmp_path):
    hook = _FailsAt(3)
    with pytest.raises(OSError, match="No space left"):
        with zf.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), save_checkpoint_steps=3, hooks=[hook],
                                         progress=False) as mon:
            mon.create({"w": np.zeros(2, np.float32)}, optimizer=zf.optim.SGD(1.0))
            for _ in range(5):
                mon.apply({"w": np.ones(2, np.float32)})
    assert mon.step == 3 and checkpoint.latest(str(tmp_path)).endswith(checkpoint.manifest_name(3))
    # the hooks run on the step as the session left it: the checkpoint of step 3 is there when they do
    assert hook.seen[-1] == (3, checkpoint.latest(str(tmp_path))) and hook.seen[1] == (2, None)


def test_summary_lines_are_strict_json_whatever_the_metrics_are_named(tmp_path, no_tensorboardx):
    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    hooks = [zf.SummaryHook(every_n_steps=1, output_dir=str(tmp_path)), zf.StopAtStep(2)]
    with zf.MonitoredTrainingSession(hooks=hooks, progress=False) as mon:
        mon.create({"w": np.zeros(2, np.float32)}, optimizer=zf.optim.SGD(1.0))
        while not mon.should_stop():
            mon.apply({"w": np.ones(2, np.float32)},
                      metrics={"loss": float("nan"), "step": 0.0, "time": 0.25, "grad_norm": float("-inf")})
    text = (tmp_path / "summaries-local.jsonl").read_text()
    lines = [json.loads(x, parse_constant=strict) for x in text.splitlines()]
    assert [(x["step"], x["metrics"]) for x in lines] == \
        [(s, {"loss": None, "step": 0.0, "time": 0.25, "grad_norm": None}) for s in (1, 2)]
    assert all(isinstance(x["time"], float) and x["time"] > 1e9 for x in lines)  # the record's own time
