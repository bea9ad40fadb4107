"""Slurm: compressed node lists, tasks per node, the cluster they describe, and a real served task."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys

import pytest

import zmqflow as zf
from zmqflow.cluster import ClusterSpec, TaskId, from_slurm, resolve
from zmqflow.errors import ConfigError
from zmqflow.ports import free_port
from zmqflow.slurm import expand_hostlist, expand_tasks_per_node, is_slurm

from .conftest import ZMQFLOW


def slurm_env(nodes: str = "gpu-[01-02],cpu7", per_node: str = "2(x2),1", ntasks: int = 5, rank: int = 0,
              local: int | None = None, **extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": per_node, "SLURM_NTASKS": str(ntasks),
           "SLURM_PROCID": str(rank)}
    if local is not None:
        env["SLURM_LOCALID"] = str(local)
    env.update(extra)
    return env


# node lists ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("gpu-[01-02],cpu7", ["gpu-01", "gpu-02", "cpu7"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("a[01-03]b", ["a01b", "a02b", "a03b"]),
    ("a[1,3-4],b[01-02]c,d", ["a1", "a3", "a4", "b01c", "b02c", "d"]),  # commas inside and between brackets
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),  # zero padding kept across a decade
    ("n[9-10]", ["n9", "n10"]),  # no padding: widths grow
    ("n[1-2]x[1-2]", ["n1x1", "n1x2", "n2x1", "n2x2"]),  # several groups multiply
    ("localhost", ["localhost"]),
    ("node.example.com,n[7]", ["node.example.com", "n7"]),
])
def test_node_lists_expand_in_order(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, needle", [
    ("", "empty node list"),
    ("n[1-3", "unbalanced brackets"),
    ("n]1", "unbalanced brackets"),
    ("n[[1-2]]", "nested brackets"),
    ("n[3-1]", "start > stop"),
    ("n[a-b]", "bad range"),
    ("n[1-]", "bad range"),
    ("n[]", "bad range"),
    ("a,,b", "empty entry"),
    ("n[1-2],n2", "listed twice"),
    ("bad!host", "malformed host name"),
    ("n[0-99999999]", "range too large"),
])
def test_malformed_node_lists_name_the_variable_and_value(text, needle):
    with pytest.raises(ConfigError) as info:
        expand_hostlist(text)
    assert needle in str(info.value)
    assert f"SLURM_JOB_NODELIST={text!r}" in str(info.value)


@pytest.mark.parametrize("text, counts", [
    ("2(x3),1", [2, 2, 2, 1]),
    ("4", [4]),
    ("1,3(x2)", [1, 3, 3]),
])
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x", "2(x0)", "2x3", "-1", "2,,1"])
def test_malformed_tasks_per_node_are_refused(text):
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(text)


# from_slurm ---------------------------------------------------------------------------------
def test_ranks_fill_nodes_in_order_with_ports_by_local_id():
    spec, me = from_slurm(slurm_env(rank=3, local=1), base_port=3000)
    assert spec == ClusterSpec({"worker": ["gpu-01:3000", "gpu-01:3001", "gpu-02:3000", "gpu-02:3001", "cpu7:3000"]})
    assert me == TaskId("worker", 3)


def test_the_first_ps_ranks_are_ps_tasks_and_the_rest_workers():
    expected = ClusterSpec({"ps": ["gpu-01:2222", "gpu-01:2223"],
                            "worker": ["gpu-02:2222", "gpu-02:2223", "cpu7:2222"]})
    mine = []
    for rank, local in enumerate([0, 1, 0, 1, 0]):
        spec, me = from_slurm(slurm_env(rank=rank, local=local), ps=2)
        assert spec == expected  # every rank computes the same cluster
        mine.append(str(me))
    assert mine == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]


def test_zf_cluster_from_slurm_reads_os_environ(monkeypatch):
    for key, value in slurm_env(nodes="n[1-2]", per_node="1(x2)", ntasks=2, rank=1, local=0).items():
        monkeypatch.setenv(key, value)
    spec, me = zf.cluster.from_slurm(ps=1, base_port=4000)
    assert spec.as_dict() == {"ps": ["n1:4000"], "worker": ["n2:4000"]}
    assert me == TaskId("worker", 0)


def test_a_step_layout_wins_over_the_allocation():
    env = slurm_env(nodes="n[1-4]", per_node="1(x4)", ntasks=4, rank=1,
                    SLURM_STEP_NODELIST="n[3-4]", SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_STEP_NUM_TASKS="3")
    spec, me = from_slurm(env)
    assert spec.as_dict() == {"worker": ["n3:2222", "n3:2223", "n4:2222"]}
    assert me == TaskId("worker", 1)


@pytest.mark.parametrize("env, kwargs, needle", [
    (slurm_env(ntasks=6), {}, "SLURM_NTASKS='6' but SLURM_TASKS_PER_NODE='2(x2),1' adds up to 5"),
    (slurm_env(per_node="2(x2)", ntasks=4), {}, "SLURM_TASKS_PER_NODE='2(x2)' gives 2 nodes but "
                                                 "SLURM_JOB_NODELIST='gpu-[01-02],cpu7' lists 3"),
    (slurm_env(rank=5), {}, "SLURM_PROCID='5' out of range"),
    (slurm_env(rank=-1), {}, "SLURM_PROCID='-1'"),
    (slurm_env(ntasks="five"), {}, "SLURM_NTASKS='five'"),  # type: ignore[arg-type]
    (slurm_env(), {"ps": 5}, "ps=5 leaves no worker"),
    (slurm_env(), {"ps": -1}, "ps -1"),
    (slurm_env(rank=2, local=1), {}, "SLURM_LOCALID='1' but rank 2 is local id 0"),  # a cyclic distribution
    (slurm_env(rank=2, SLURMD_NODENAME="gpu-01"), {}, "SLURMD_NODENAME='gpu-01' but rank 2 is on 'gpu-02'"),
    (slurm_env(nodes="gpu-[01-02"), {}, "SLURM_JOB_NODELIST='gpu-[01-02'"),
    (slurm_env(), {"base_port": 65535}, "passes port 65535"),
    (slurm_env(), {"base_port": 0}, "base_port 0"),
    ({"SLURM_PROCID": "0"}, {}, "SLURM_JOB_NODELIST is not set"),
])
def test_bad_slurm_input_names_the_variable_and_value(env, kwargs, needle):
    with pytest.raises(ConfigError) as info:
        from_slurm(env, **kwargs)
    assert needle in str(info.value)


# resolve ------------------------------------------------------------------------------------
def test_resolve_uses_slurm_when_nothing_else_names_a_cluster():
    env = slurm_env(rank=2, local=0, ZMQFLOW_SLURM_PS="1", ZMQFLOW_SLURM_BASE_PORT="5000")
    spec, me = resolve(env=env)
    assert spec.address("ps:0").endpoint == "tcp://gpu-01:5000"
    assert spec.address("worker:1").endpoint == "tcp://gpu-02:5000"
    assert me == TaskId("worker", 1)
    assert is_slurm(env) and not is_slurm({"SLURM_JOB_NODELIST": "n1"})  # a rank is needed too


def test_resolve_order_flags_then_zmqflow_then_tf_config_then_slurm():
    slurm = slurm_env(rank=0, ZMQFLOW_SLURM_PS="1")
    zf_spec = {"worker": ["127.0.0.1:7001"], "ps": ["127.0.0.1:7002"]}
    tf = {"cluster": {"worker": ["127.0.0.1:8001", "127.0.0.1:8002"]}, "task": {"type": "worker", "index": 1}}
    flag = {"chief": ["127.0.0.1:9001"]}
    env = dict(slurm, ZMQFLOW_CLUSTER=json.dumps(zf_spec), ZMQFLOW_TASK="ps:0", TF_CONFIG=json.dumps(tf))
    assert resolve(flag, "chief:0", env=env) == (ClusterSpec(flag), TaskId("chief", 0))
    assert resolve(env=env) == (ClusterSpec(zf_spec), TaskId("ps", 0))
    no_zf = {k: v for k, v in env.items() if not k.startswith("ZMQFLOW_CLUSTER") and k != "ZMQFLOW_TASK"}
    assert resolve(env=no_zf) == (ClusterSpec(tf), TaskId("worker", 1))
    only_slurm = {k: v for k, v in no_zf.items() if k != "TF_CONFIG"}
    spec, me = resolve(env=only_slurm)
    assert me == TaskId("ps", 0) and spec.num_tasks("worker") == 4
    # a named task picks from Slurm's cluster; an empty env (as launch and Server pass) never reads Slurm
    assert resolve(None, "worker:3", env=only_slurm)[1] == TaskId("worker", 3)
    with pytest.raises(ConfigError, match="no cluster given"):
        resolve(env={})


def test_resolve_names_a_bad_slurm_setting():
    with pytest.raises(ConfigError, match="ZMQFLOW_SLURM_PS='two'"):
        resolve(env=slurm_env(ZMQFLOW_SLURM_PS="two"))
    with pytest.raises(ConfigError, match="ZMQFLOW_SLURM_BASE_PORT='-3'"):
        resolve(env=slurm_env(ZMQFLOW_SLURM_BASE_PORT="-3"))
    with pytest.raises(ConfigError, match="SLURM_NTASKS='4'"):
        resolve(env=slurm_env(ntasks=4))


# a real run ---------------------------------------------------------------------------------
def _free_base(count: int) -> int:
    """A port with the ``count - 1`` after it free too, as a node's tasks need."""
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports found")


SESSION = """
import numpy as np
import zmqflow as zf
spec, me = zf.cluster.resolve()
assert str(me) == "worker:0", me
with zf.Session(cluster=spec, timeout=20) as sess:
    v = sess.variable("slurm_v", np.arange(6, dtype=np.float32))
    print("read", v.read().tolist(), "from", spec.address("ps:0"), flush=True)
"""


def test_serve_and_a_session_find_each_other_from_slurm_variables_alone(tmp_path, procs):
    base = _free_base(3)
    env = {"SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "3",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "ZMQFLOW_SLURM_PS": "1", "ZMQFLOW_SLURM_BASE_PORT": str(base)}
    server = procs([*ZMQFLOW, "serve"], env=env)
    server.wait_for_line("serving ps:0", 60)
    script = tmp_path / "session.py"
    script.write_text(SESSION)
    client = procs([sys.executable, str(script)], env=dict(env, SLURM_PROCID="1", SLURM_LOCALID="1"))
    assert client.wait(60) == 0, client.output
    assert f"read [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] from localhost:{base}" in client.output
    server.signal(2)
    assert server.wait(30) == 0, server.output


FAKE_SRUN = """#!/bin/bash
# srun on one node: every rank of SLURM_NTASKS runs the command here, block-placed.
while [ "${1#--}" != "$1" ]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NUM_TASKS=$SLURM_NTASKS "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

WORKER = """
import sys
import numpy as np
import zmqflow as zf
spec, me = zf.cluster.resolve()
with zf.Session(cluster=spec, task="ps:0", timeout=30) as sess:
    v = sess.variable(f"w{me.index}", np.full(3, me.index + 1.0))
    print(me, "read", v.read().tolist(), flush=True)
"""


def test_the_sbatch_script_serves_ps_and_runs_workers_until_they_finish(tmp_path, procs):
    script = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "train.sbatch"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "zmqflow").write_text(f"#!/bin/bash\nexec {sys.executable} -m zmqflow \"$@\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "worker.py").write_text(WORKER)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "3",
           "ZMQFLOW_SLURM_BASE_PORT": str(_free_base(3)),
           "PYTHONPATH": os.pathsep.join(p for p in (str(script.parents[2]), os.environ.get("PYTHONPATH")) if p)}
    job = procs(["bash", str(script), sys.executable, str(tmp_path / "worker.py")], env=env, cwd=tmp_path)
    assert job.wait(90) == 0, job.output
    assert "worker:0 read [1.0, 1.0, 1.0]" in job.output and "worker:1 read [2.0, 2.0, 2.0]" in job.output
    assert "serving ps:0" in job.output and "stopping ps:0" in job.output
    assert sorted(p.name for p in (tmp_path / ".zmqflow-done-42").iterdir()) == ["1", "2"]
    assert (tmp_path / "zmqflow-keys" / "allow.json").exists()
