"""Parameter servers and workers as real processes: ``zmqflow serve`` tasks and client scripts."""

from __future__ import annotations

import json
import signal
import sys
import textwrap

import numpy as np

import zmqflow as zf
from zmqflow.testing import free_port

from .conftest import ZMQFLOW

INCREMENT = textwrap.dedent(
    """
    import sys, zmqflow as zf
    spec, task = sys.argv[1], sys.argv[2]
    with zf.Session(cluster=zf.ClusterSpec.from_file(spec), task=task) as sess:
        sess.wait_for_cluster(30)
        var = sess.variable("var", 0.0)
        for _ in range(5):
            var.assign_add(1.0)
    print("done", task)
    """
)

SYNC_TRAIN = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    spec, task = sys.argv[1], sys.argv[2]
    with zf.Session(cluster=zf.ClusterSpec.from_file(spec), task=task, timeout=3.0) as sess:
        sess.wait_for_cluster(30)
        w = sess.variable("w", np.zeros(4), optimizer=zf.SyncReplicas(zf.optim.SGD(0.1), replicas_to_aggregate=2))
        try:
            for step in range(100000):
                w.read()
                w.push(np.ones(4))
                print("step", sess.step, flush=True)
        except zf.errors.DeadlineExceeded as exc:
            print("deadline:", exc, flush=True)
            sys.exit(3)
    """
)


def _cluster(tmp_path) -> tuple[str, zf.ClusterSpec]:
    jobs = {"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(jobs))
    return str(path), zf.ClusterSpec(jobs)


def _serve_all(procs, cfile: str, spec: zf.ClusterSpec) -> None:
    servers = [procs([*ZMQFLOW, "serve", "--cluster", cfile, "--task", str(t)]) for t in spec.tasks]
    for t, p in zip(spec.tasks, servers):
        p.wait_for_line(f"serving {t}", 30)


def test_two_worker_scripts_increment_a_shared_variable_to_exactly_ten(tmp_path, procs):
    cfile, spec = _cluster(tmp_path)
    _serve_all(procs, cfile, spec)
    script = tmp_path / "inc.py"
    script.write_text(INCREMENT)
    workers = [procs([sys.executable, str(script), cfile, f"worker:{i}"]) for i in range(2)]
    for w in workers:
        assert w.wait(60) == 0, w.output
    with zf.Session(cluster=spec, task="ps:0") as sess:
        assert sess.get("var").read() == 10.0


def test_a_killed_sync_worker_is_named_by_the_survivor(tmp_path, procs):
    cfile, spec = _cluster(tmp_path)
    _serve_all(procs, cfile, spec)
    script = tmp_path / "train.py"
    script.write_text(SYNC_TRAIN)
    w0 = procs([sys.executable, str(script), cfile, "worker:0"])
    w1 = procs([sys.executable, str(script), cfile, "worker:1"])
    w1.wait_for_line("step 5", 60)
    w1.signal(signal.SIGKILL)
    assert w0.wait(30) == 3, w0.output
    line = w0.wait_for_line("deadline:", 1)
    assert "no push from worker:1" in line
    with zf.Session(cluster=spec, task="ps:0") as sess:
        final = sess.get("w").read()
        assert final[0] < 0 and np.all(final == final[0])  # every applied step moved all rows together
