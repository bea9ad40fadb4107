"""A checkpoint written for another model is refused before anything is restored: a parameter it
lacks, or holds in another shape or dtype, is a ConfigError naming it (numpy broadcast or cast it
in silence, and the step jumped to the checkpoint's). Names it holds beyond the model's are left."""

from __future__ import annotations

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.errors import ConfigError
from zmqflow.testing import make_spec


def _train_once(directory: str, params: dict, **kwargs) -> None:
    with zf.MonitoredTrainingSession(checkpoint_dir=directory, save_checkpoint_steps=1, progress=False,
                                     **kwargs) as mon:
        mon.create(params, optimizer=zf.optim.Adam(0.1))
        mon.apply({k: np.ones_like(v) for k, v in params.items()})


SAVED = {"b": np.array([1.0, 2.0, 3.0]), "w": np.ones((2, 3), np.float32)}
OTHER_MODELS = [
    ({"b": np.zeros((4, 3)), "w": np.ones((2, 3), np.float32)}, r"'b' is float64 \[4, 3\] in the model but float64 \[3\]"),
    ({"b": np.zeros(3), "w": np.ones((2, 3), np.float64)}, r"'w' is float64 \[2, 3\] in the model but float32 \[2, 3\]"),
    ({**SAVED, "new": np.zeros(5)}, r"holds no parameter 'new' \(it holds 'b', "),
]


@pytest.mark.parametrize("params, refusal", OTHER_MODELS, ids=["shape", "dtype", "missing"])
def test_the_local_strategy_refuses_a_checkpoint_of_another_model(tmp_path, params, refusal):
    _train_once(str(tmp_path), SAVED)
    with pytest.raises(ConfigError, match=refusal):
        with zf.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), progress=False) as mon:
            mon.create(params, optimizer=zf.optim.Adam(0.1))


def test_names_the_model_dropped_are_left_in_the_checkpoint(tmp_path):
    _train_once(str(tmp_path), SAVED)
    with zf.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), progress=False) as mon:
        mon.create({"w": np.zeros((2, 3), np.float32)}, optimizer=zf.optim.Adam(0.1))
        assert mon.step == 1 and mon.restored_from is not None
        np.testing.assert_allclose(mon.params()["w"], np.full((2, 3), 0.9), rtol=1e-6)  # one Adam step of 0.1


@pytest.mark.parametrize("params, refusal", OTHER_MODELS, ids=["shape", "dtype", "missing"])
def test_the_ps_strategy_refuses_before_the_shards_restore_anything(tmp_path, monkeypatch, params, refusal):
    monkeypatch.setenv("ZMQFLOW_CHECKPOINT_ROOTS", str(tmp_path))
    spec = make_spec({"worker": 1, "ps": 1}, "tcp")
    ps = zf.Server(spec, "ps:0")
    try:
        _train_once(str(tmp_path), SAVED, cluster=spec, task="worker:0", wait_timeout=20)
    finally:
        ps.stop()
    ps = zf.Server(spec, "ps:0")  # a fresh shard: the chief would restore the checkpoint onto it
    try:
        with pytest.raises(ConfigError, match=refusal):
            with zf.MonitoredTrainingSession(cluster=spec, task="worker:0", checkpoint_dir=str(tmp_path),
                                             progress=False, wait_timeout=20) as mon:
                mon.create(params, optimizer=zf.optim.Adam(0.1))
        with zf.Session(ps.target, timeout=10) as sess:
            assert sess.variables() == []  # nothing was restored onto the shard
    finally:
        ps.stop()
