"""A run resumed with a new learning rate trains at it under parameter servers, as it does under
the local strategy (the variables keep the optimizer the checkpoint made them with; each push
carries the rate); any other change of optimizer is refused, naming the variable."""

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
