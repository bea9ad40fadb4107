"""``zmqflow launch`` gives its commands what torch.distributed's env:// reads."""

from __future__ import annotations

import sys
import textwrap

import pytest

from zmqflow.cli.launch import RANK_VARS, Launcher, rank_env
from zmqflow.cluster import ClusterSpec, TaskId

from .conftest import ZMQFLOW


def _spec() -> ClusterSpec:
    return ClusterSpec({
        "worker": ["127.0.0.1:2001", "10.0.0.2:2002", "127.0.0.1:2003"],
        "ps": ["127.0.0.1:2004"],
        "chief": ["127.0.0.1:2000"],
        "evaluator": ["127.0.0.1:2005"],
    })


def test_ranks_are_the_chief_then_workers_by_index_and_local_ranks_count_per_host():
    spec = _spec()
    master = ("127.0.0.1", 29400)
    got = {str(t): rank_env(spec, t, master) for t in spec.tasks}
    assert [(got[t]["RANK"], got[t]["LOCAL_RANK"], got[t]["LOCAL_WORLD_SIZE"])
            for t in ("chief:0", "worker:0", "worker:1", "worker:2")] == [
        ("0", "0", "3"), ("1", "1", "3"), ("2", "0", "1"), ("3", "2", "3")]
    for t in ("chief:0", "worker:0", "worker:1", "worker:2"):
        assert got[t]["WORLD_SIZE"] == "4" and got[t]["MASTER_ADDR"] == "127.0.0.1" and got[t]["MASTER_PORT"] == "29400"
    for t in ("ps:0", "evaluator:0"):  # not ranks: MASTER_* only, and the rank variables removed
        assert got[t]["MASTER_ADDR"] == "127.0.0.1" and got[t]["MASTER_PORT"] == "29400"
        assert all(got[t][k] is None for k in RANK_VARS)


def test_a_launcher_picks_one_master_port_and_strips_inherited_ranks_from_non_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "7")  # as if launch itself ran under torchrun
    monkeypatch.setenv("WORLD_SIZE", "9")
    spec = ClusterSpec({"worker": ["127.0.0.1:2001", "127.0.0.1:2002"], "ps": ["127.0.0.1:2003"]})
    launcher = Launcher(spec, ["true"])
    w1, again, ps = (launcher.env_for(TaskId.parse(t)) for t in ("worker:1", "worker:1", "ps:0"))
    assert w1 == again  # a restarted task gets the same rank and master
    assert (w1["RANK"], w1["WORLD_SIZE"], w1["LOCAL_RANK"], w1["LOCAL_WORLD_SIZE"]) == ("1", "2", "1", "2")
    assert w1["MASTER_ADDR"] == "127.0.0.1" and int(w1["MASTER_PORT"]) == launcher.master[1] > 0
    assert ps["MASTER_PORT"] == w1["MASTER_PORT"] and "RANK" not in ps and "WORLD_SIZE" not in ps


TORCH_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} "
          f"task {os.environ['ZMQFLOW_TASK']} sum {t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("chief", [False, True], ids=["workers", "chief"])
def test_torch_distributed_env_init_works_under_launch(tmp_path, procs, chief):
    pytest.importorskip("torch")
    script = tmp_path / "dist.py"
    script.write_text(TORCH_SCRIPT)
    flags = ["--chief"] if chief else []
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--ps", "1", *flags, "--", sys.executable, str(script)])
    assert p.wait(110) == 0, p.output
    tasks = (["chief:0"] if chief else []) + ["worker:0", "worker:1"]
    n = len(tasks)
    total = n * (n + 1) // 2
    for rank, task in enumerate(tasks):
        assert f"[{task}] rank {rank} of {n} local {rank} task {task} sum {total}" in p.output, p.output


RESTART_SCRIPT = textwrap.dedent(
    """
    import os, sys
    marker = os.path.join(sys.argv[1], os.environ["ZMQFLOW_TASK"] + ".ran")
    again = os.path.exists(marker)
    open(marker, "a").close()
    print("run", "again" if again else "first", "rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"],
          "master", os.environ["MASTER_PORT"], flush=True)
    if os.environ["ZMQFLOW_TASK"] == "worker:1" and not again:
        sys.exit(1)
    """
)


def test_a_restarted_rank_keeps_its_rank_and_master(tmp_path, procs):
    script = tmp_path / "ranks.py"
    script.write_text(RESTART_SCRIPT)
    p = procs([*ZMQFLOW, "launch", "--workers", "2", "--restart", "on-failure", "--", sys.executable, str(script),
               str(tmp_path)])
    assert p.wait(90) == 0, p.output
    lines = [line for line in p.output.splitlines() if line.startswith("[worker:1] run")]
    assert len(lines) == 2, p.output
    first, again = (line.split() for line in lines)
    assert first[2] == "first" and again[2] == "again"
    assert first[3:] == again[3:] and first[4] == "1" and first[6] == "2"
