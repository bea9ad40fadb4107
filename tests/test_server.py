"""The blocking facades: Server on a background thread, Session, several servers per process."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow import Session
from zmqflow.testing import make_spec

from .conftest import arun


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_servers_in_one_process_with_sessions(transport):
    spec = make_spec({"worker": 2, "ps": 1}, transport)
    with zf.Server(spec, "worker:0") as w0, zf.Server(spec, "worker:1"), zf.Server(spec, "ps:0") as ps:
        assert w0.target == spec.address("worker:0").endpoint
        w0.wait_for_cluster(10)
        with Session(ps.target) as sess:
            sess.wait_for_cluster(timeout=10)
            assert sess.status()["task"] == "ps:0"
            assert sess.cluster() == spec
        with Session(cluster=spec, task="worker:1") as sess:
            x = np.linspace(0, 1, 1000)
            np.testing.assert_array_equal(sess.call("worker", "echo", {"x": x})["x"], x)
            assert sess.status("ps:0")["roles"] == ["master", "worker", "ring", "ps", "catalog"]


def test_join_returns_when_stopped_from_another_thread():
    spec = make_spec({"worker": 1}, "tcp")
    server = zf.Server(spec, "worker:0")
    assert not server.join(timeout=0.05)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    assert server.join(timeout=10)
    stopper.join(10)
    server.stop()  # stopping twice is harmless


def test_from_env_and_errors(monkeypatch):
    spec = make_spec({"worker": 1}, "tcp")
    monkeypatch.setenv("ZMQFLOW_CLUSTER", spec.to_json())
    monkeypatch.setenv("ZMQFLOW_TASK", "worker:0")
    with zf.Server.from_env() as server:
        assert str(server.task) == "worker:0"
        with pytest.raises(errors.AddressInUse):
            zf.Server(spec, "worker:0")
    with pytest.raises(errors.ConfigError, match="unknown task worker:3"):
        zf.Server(spec, "worker:3")
    with pytest.raises(errors.ConfigError, match="a session needs a target"):
        Session()


def test_session_wait_for_cluster_names_the_missing_tasks():
    spec = make_spec({"worker": 1, "ps": 2}, "tcp")
    with zf.Server(spec, "worker:0") as w0, Session(w0.target) as sess:
        with pytest.raises(errors.ClusterNotReady, match="ps:0, ps:1") as info:
            sess.wait_for_cluster(timeout=0.5)
        assert info.value.missing == ["ps:0", "ps:1"]


def test_a_closed_session_refuses_every_use():
    spec = make_spec({"ps": 1}, "tcp")
    with zf.Server(spec, "ps:0") as ps:
        sess = Session(ps.target)
        v = sess.variable("v", np.zeros(2))
        sess.close()
        for use in (sess.status, v.read, lambda: sess.get("v"), lambda: sess.push({"v": np.ones(2)})):
            with pytest.raises(errors.SessionClosed, match=f"session '{sess.name}' is closed"):
                use()
        sess.close()  # closing twice is harmless

        async def main():
            s = zf.AsyncSession(ps.target)
            held = await s.get("v")
            await s.close()
            assert s.closed
            for use in (held.read, s.status, lambda: s.variable("w", np.zeros(1))):
                with pytest.raises(errors.SessionClosed):
                    await use()

        arun(main())
