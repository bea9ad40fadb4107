"""Parameter servers across checkpoints: a run resumed with a new learning rate trains at it, as
under the local strategy (the variables keep the optimizer the checkpoint made them with; each push
carries the rate), any other change of optimizer is refused, naming the variable; a save that
waits out another writer's lock on the directory skips its checkpoint without a recovery."""

from __future__ import annotations

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.errors import ConfigError
from zmqflow.testing import make_spec


def _train(ckpt: str, optimizer: object, steps: int, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """(the value resumed at, the value after the run) of one variable pushed ones each step."""
    hooks = [zf.StopAtStep(steps)]
    if strategy == "local":
        mon = zf.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=1, hooks=hooks, progress=False)
        server = None
    else:
        spec = make_spec({"ps": 1, "worker": 1}, "tcp")
        server = zf.Server(spec, "ps:0", checkpoint_roots=[ckpt])
        mon = zf.MonitoredTrainingSession(zf.ParameterServerStrategy(sync=strategy == "sync-ps"), cluster=spec,
                                          task="worker:0", checkpoint_dir=ckpt, save_checkpoint_steps=1, hooks=hooks,
                                          progress=False)
    try:
        with mon:
            mon.create({"w": np.zeros(1)}, optimizer=optimizer)
            before = mon.params()["w"].copy()
            while not mon.should_stop():
                mon.apply({"w": np.ones(1)})
            return before, mon.params()["w"]
    finally:
        if server is not None:
            server.stop()


@pytest.mark.parametrize("strategy", ["local", "ps", "sync-ps"])
def test_a_resumed_run_trains_at_its_new_learning_rate(tmp_path, strategy):
    ckpt = str(tmp_path / strategy)
    _train(ckpt, zf.optim.SGD(0.1), 1, strategy)
    before, after = _train(ckpt, zf.optim.SGD(1.0), 2, strategy)
    np.testing.assert_allclose(before, [-0.1])
    np.testing.assert_allclose(after, [-1.1])  # one step at 1.0, not 0.1


def test_a_resumed_run_with_another_optimizer_is_refused_under_ps(tmp_path):
    ckpt = str(tmp_path / "ps")
    _train(ckpt, zf.optim.SGD(0.1), 1, "ps")
    with pytest.raises(ConfigError, match=r"variable 'w' holds optimizer .*'sgd'.* only its learning rate may differ"):
        _train(ckpt, zf.optim.Momentum(0.1, momentum=0.9), 2, "ps")


def test_a_save_that_waits_out_another_writers_lock_skips_its_checkpoint_not_the_shards(tmp_path, monkeypatch):
    """The directory's lock held by another writer past the save's deadline is DeadlineExceeded
    naming the directory: the step goes on without that checkpoint, and no recovery (which would
    restore every shard from the last one) starts."""
    import fcntl
    import functools
    import os

    from zmqflow.client import checkpoint as ckpt
    from zmqflow.training import parameter_server

    monkeypatch.setattr(ckpt, "save", functools.partial(ckpt.save, timeout=0.3))
    recovered: list[Exception] = []
    monkeypatch.setattr(parameter_server.ParameterServerStrategy, "_recover",
                        lambda self, exc, restore=None: recovered.append(exc))
    directory = str(tmp_path / "ckpt")
    _train(directory, zf.optim.SGD(0.1), 1, "ps")  # a first checkpoint, and the directory
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another writer's
        before, after = _train(directory, zf.optim.SGD(0.1), 2, "ps")
    finally:
        os.close(fd)
    np.testing.assert_allclose(after, before - 0.1)  # the step trained
    assert recovered == []
