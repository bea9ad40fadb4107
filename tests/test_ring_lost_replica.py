"""A ring where no live member holds a replica any more goes on from the newest checkpoint.

worker:1 crashes and comes back as a fresh process (it holds nothing: it claims step -1). The
last holder, worker:0, dies while handing its replica over to it. worker:1 then forms a ring
alone: it must restore the checkpoint the chief saved, not take its own initial values for the
model at step 0.
"""

from __future__ import annotations

import os
import threading

import numpy as np

import zmqflow as zf
from zmqflow.client import checkpoint
from zmqflow.testing import make_spec, wait_until


class _Died(Exception):
    """worker:0's thread ends here, its server stopped without a goodbye."""


class DiesHandingOver(zf.RingAllReduceStrategy):
    """worker:0's strategy: once ``armed``, its server stops when it starts sharing its replica
    with worker:1, once worker:1 has the formation. Stopped any sooner, the server could take the
    answer to worker:1's join down with it: worker:1 would never learn that a ring formed, and a
    rank that never saw one waits for every member before forming the first."""

    def __init__(self, server: zf.Server, armed: threading.Event, spec: zf.ClusterSpec, **kwargs):
        super().__init__(**kwargs)
        self.server, self.armed, self.spec = server, armed, spec

    def _adopt_state(self, root: int) -> None:
        assert self.elastic is not None
        if self.armed.is_set() and "worker:1" in map(str, self.elastic.members):
            generation = self.elastic.generation
            with zf.Session(cluster=self.spec, task="worker:1", timeout=5) as sess:
                wait_until(lambda: sess.call("ring", "status")["generation"] >= generation, 20,
                           what="worker:1 holding the formation")
            self.server.stop()
            raise _Died
        super()._adopt_state(root)


def test_a_fresh_rank_left_alone_restores_the_newest_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("ZMQFLOW_CHECKPOINT_ROOTS", str(tmp_path))
    spec = make_spec({"worker": 2}, "tcp")
    params, grads = {"w": np.zeros(4)}, {"w": np.ones(4)}
    crashed, armed, errors, result = threading.Event(), threading.Event(), [], {}
    servers: list[zf.Server] = []

    def session(task: str, strategy: zf.RingAllReduceStrategy, server: zf.Server) -> zf.MonitoredTrainingSession:
        return zf.MonitoredTrainingSession(strategy=strategy, server=server, checkpoint_dir=str(tmp_path),
                                           save_checkpoint_steps=5, progress=False, wait_timeout=20)

    def first() -> None:
        server = zf.Server(spec, "worker:0", default_timeout=5)
        servers.append(server)
        mon = session("worker:0", DiesHandingOver(server, armed, spec, join_window=1, recovery_timeout=30), server)
        mon.create(params, optimizer=zf.optim.SGD(1.0))
        while mon.step < 10:
            mon.apply(grads)
        assert crashed.wait(30)
        mon.apply(grads)  # worker:1 is gone: the ring re-forms with worker:0 alone
        armed.set()
        try:
            while mon.step < 100_000:
                mon.apply(grads)  # until the leader counts the newcomer and the ring re-forms with it
        except _Died:
            return

    def second() -> None:
        server = zf.Server(spec, "worker:1", default_timeout=5)
        servers.append(server)
        mon = session("worker:1", zf.RingAllReduceStrategy(join_window=1, recovery_timeout=30), server)
        mon.create(params, optimizer=zf.optim.SGD(1.0))
        while mon.step < 10:
            mon.apply(grads)
        server.stop()  # a crash: no goodbye
        crashed.set()
        assert armed.wait(30)
        server = zf.Server(spec, "worker:1", default_timeout=5)  # restarted: a fresh replica
        servers.append(server)
        mon = session("worker:1", zf.RingAllReduceStrategy(join_window=1, recovery_timeout=30), server)
        mon.create(params, optimizer=zf.optim.SGD(1.0))
        result.update(step=mon.step, w=mon.params()["w"].copy(), restored=mon.restored_from,
                      newest=checkpoint.latest(str(tmp_path)), members=[str(m) for m in mon.strategy.members])
        mon.apply(grads)
        result["after"] = (mon.step, mon.params()["w"].copy())

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported below: a thread's failure must fail the test
                errors.append(f"{fn.__name__}: {exc!r}")
        return run

    threads = [threading.Thread(target=guarded(fn), name=fn.__name__) for fn in (first, second)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a worker did not finish within 90s"
    finally:
        for s in servers:
            s.stop()
    assert not errors, errors
    step = result["step"]
    assert result["members"] == ["worker:1"] and result["newest"] == result["restored"], result
    saved = int(os.path.basename(result["newest"]).split("-")[1].split(".")[0])
    assert step == saved >= 10, result  # the newest checkpoint's step, not 0
    np.testing.assert_array_equal(result["w"], np.full(4, -float(step)))  # SGD(1.0) on ones: -step
    assert result["after"][0] == step + 1
    np.testing.assert_array_equal(result["after"][1], np.full(4, -float(step + 1)))
