"""``runtime.init()`` on a keyed cluster, what a failed init leaves behind, and the variables it refuses."""

from __future__ import annotations

import threading

import pytest

import zmqflow as zf
from zmqflow.bridge import runtime
from zmqflow.errors import ClusterNotReady, ConfigError
from zmqflow.testing import make_spec, wait_until
from zmqflow.transport.curve import generate

_CLUSTER_VARS = ("ZMQFLOW_CLUSTER", "ZMQFLOW_TASK", "ZMQFLOW_TASK_JOB", "TF_CONFIG", "ZMQFLOW_KEYS",
                 "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    runtime.shutdown()


def _session_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "zmqflow-session" and t.is_alive()]


def test_init_with_a_task_argument_joins_a_keyed_cluster_with_the_tasks_key(clean_env, tmp_path):
    spec = make_spec({"worker": 1, "ps": 1}, "tcp")
    generate(tmp_path / "keys", spec)
    clean_env.setenv("ZMQFLOW_KEYS", str(tmp_path / "keys"))
    ps = zf.Server(spec, "ps:0")
    try:
        rt = runtime.init(spec, "worker:0", timeout=10)
        assert rt.session.name == "worker:0" and rt.size == 1
        runtime.shutdown()
    finally:
        ps.stop()


def test_a_private_runtime_starts_with_keys_in_the_environment(clean_env, tmp_path):
    generate(tmp_path / "keys")  # the shared task key, as for `zmqflow status --keys`
    clean_env.setenv("ZMQFLOW_KEYS", str(tmp_path / "keys"))
    rt = runtime.init(timeout=10)
    assert str(rt.task) == "worker:0" and rt.session.name == "worker:0"


def test_a_failed_init_closes_its_session(clean_env):
    spec = make_spec({"worker": 1, "ps": 1}, "tcp")  # the ps never starts
    before = len(_session_threads())
    with pytest.raises(ClusterNotReady):
        runtime.init(spec, "worker:0", timeout=1.0)
    wait_until(lambda: len(_session_threads()) == before, 5, what="the failed init's session thread to end")
    assert not runtime.is_initialized()


@pytest.mark.parametrize("var", ["ZMQFLOW_TASK", "ZMQFLOW_TASK_JOB"])
def test_a_task_without_a_cluster_is_refused_not_run_alone(clean_env, var):
    clean_env.setenv(var, "worker:3" if var == "ZMQFLOW_TASK" else "worker")
    with pytest.raises(ConfigError, match=f"{var} is set .* but no cluster is"):
        runtime.init(timeout=5)
    assert not runtime.is_initialized()


@pytest.mark.parametrize("rank, size, match", [("abc", None, "LOCAL_RANK='abc' is not an integer"),
                                               ("5", "2", "LOCAL_RANK=5 is not below LOCAL_WORLD_SIZE=2"),
                                               ("0", "x", "LOCAL_WORLD_SIZE='x' is not an integer"),
                                               ("-1", None, "LOCAL_RANK=-1 is below 0")])
def test_bad_local_rank_variables_are_refused_by_name(clean_env, rank, size, match):
    clean_env.setenv("LOCAL_RANK", rank)
    if size is not None:
        clean_env.setenv("LOCAL_WORLD_SIZE", size)
    with pytest.raises(ConfigError, match=match):
        runtime.init(timeout=5)
    assert not runtime.is_initialized()
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    rt = runtime.init(timeout=10)
    assert (rt.local_rank, rt.local_size) == (1, 2)
