"""The elastic ring: rendezvous in process, and real processes killed with SIGKILL (and restarted)."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time

import numpy as np
import pytest

from zmqflow import errors
from zmqflow.client.elastic_ring import AsyncElasticRing
from zmqflow.server import AsyncServer
from zmqflow.testing import async_wait_until, make_spec

from .conftest import arun, launch_script

W = [f"worker:{i}" for i in range(3)]


async def _start(spec, task: str) -> AsyncServer:
    return await AsyncServer(spec, task, default_timeout=10).start()


async def _sum_everywhere(rings: list[AsyncElasticRing]) -> list[np.ndarray]:
    return await asyncio.gather(*(r.ring.allreduce(np.full(3, float(i + 1))) for i, r in enumerate(rings)))


def test_rendezvous_leaves_a_stopped_rank_out_and_takes_it_back_fresh():
    async def main():
        spec = make_spec({"worker": 3}, "tcp")
        servers = {t: await _start(spec, t) for t in W}
        try:
            rings = [AsyncElasticRing(servers[t], join_window=5) for t in W]
            first = await asyncio.gather(*(r.form(step, 20) for r, step in zip(rings, [0, -1, -1])))
            assert {(f.generation, tuple(f.members), f.holder) for f in first} == {(1, tuple(W), "worker:0")}
            for out in await _sum_everywhere(rings):
                np.testing.assert_array_equal(out, np.full(3, 6.0))

            await servers["worker:2"].stop()  # its connections drop: the others must not wait for it
            second = await asyncio.gather(rings[0].form(5, 20), rings[1].form(6, 20))
            assert {(f.generation, tuple(f.members), f.holder, f.step) for f in second} == {(2, tuple(W[:2]), "worker:1", 6)}
            assert rings[0].ring.name == rings[1].ring.name == "elastic/g2"  # no chunk of generation 1 fits

            servers["worker:2"] = await _start(spec, "worker:2")  # back on the same address, with no state
            newcomer = AsyncElasticRing(servers["worker:2"], join_window=5)
            joining = asyncio.ensure_future(newcomer.form(-1, 20))
            await async_wait_until(lambda: rings[0].joiners() == 1, 10, what="the leader counting the newcomer")
            assert rings[1].joiners() == 0 and not joining.done()
            rings[2] = newcomer
            third = await asyncio.gather(rings[0].form(6, 20), rings[1].form(6, 20), joining)
            assert {(f.generation, tuple(f.members), f.holder) for f in third} == {(3, tuple(W), "worker:0")}
            for out in await _sum_everywhere(rings):
                np.testing.assert_array_equal(out, np.full(3, 6.0))

            for r in rings[:2]:  # training is over there: a later newcomer is told so, at once
                r.close()
            await servers["worker:2"].stop()
            servers["worker:2"] = await _start(spec, "worker:2")
            late = AsyncElasticRing(servers["worker:2"], join_window=5)
            with pytest.raises(errors.Unavailable, match="the ring has finished"):
                await late.form(-1, 20)
        finally:
            for s in servers.values():
                await s.stop()

    arun(main(), timeout=60)



def test_a_member_that_does_not_join_in_time_is_left_out_and_a_fresh_rank_never_coordinates():
    async def main():
        spec = make_spec({"worker": 3}, "tcp")
        servers = {t: await _start(spec, t) for t in W}
        try:
            rings = [AsyncElasticRing(servers[t], join_window=0.3) for t in W]
            started = asyncio.get_running_loop().time()
            first = await asyncio.gather(rings[0].form(0, 20), rings[1].form(-1, 20))  # worker:2 is alive but silent
            assert {(f.generation, tuple(f.members)) for f in first} == {(1, tuple(W[:2]))}
            assert asyncio.get_running_loop().time() - started < 5
            # worker:2 holds no generation: it may not coordinate generation 1's successor
            with pytest.raises(errors.Unavailable, match="worker:2 is at ring generation 0, behind 1"):
                await servers["worker:0"].call("worker:2", "ring", "join",
                                               {"task": "worker:0", "generation": 1, "step": 0, "target": 1})
            status = await servers["worker:2"].call("worker:0", "ring", "status")
            assert status == {"generation": 1, "members": W[:2], "closed": False}
            late = asyncio.ensure_future(rings[2].form(-1, 20))  # it joins through the leader, at a step boundary
            await async_wait_until(lambda: rings[0].joiners() == 1, 10, what="the leader counting worker:2")
            again = await asyncio.gather(rings[0].form(3, 20), rings[1].form(3, 20), late)
            assert {(f.generation, tuple(f.members), f.holder) for f in again} == {(2, tuple(W), "worker:0")}
        finally:
            for s in servers.values():
                await s.stop()

    arun(main(), timeout=60)



def test_the_lone_survivor_of_two_goes_on_once_the_other_is_confirmed_gone():
    async def main():
        spec = make_spec({"worker": 2}, "tcp")
        servers = {t: await _start(spec, t) for t in W[:2]}
        try:
            rings = [AsyncElasticRing(servers[t], join_window=5) for t in W[:2]]
            await asyncio.gather(rings[0].form(0, 20), rings[1].form(-1, 20))
            await servers["worker:0"].stop()  # the leader goes; one of two is no majority, so it asks first
            alone = await rings[1].form(4, 20)
            assert (alone.generation, alone.members, alone.holder) == (2, ["worker:1"], "worker:1")
            np.testing.assert_array_equal(await rings[1].ring.allreduce(np.ones(2)), np.ones(2))
        finally:
            for s in servers.values():
                await s.stop()

    arun(main(), timeout=60)


# A training script for real processes. It stops by an event every rank sees at the same step
# (a generation of `size` members, at least `generation`, has trained 20 steps), not by time.
ELASTIC = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    out, size, generation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    marker = os.path.join(out, os.environ["ZMQFLOW_TASK"] + ".started")
    first_run = not os.path.exists(marker)
    open(marker, "a").close()
    print("pid", os.getpid(), flush=True)

    class UntilFormed(zf.Hook):
        def should_stop(self, mon):
            s = mon.strategy
            return len(s.members) == size and s.generation >= generation and mon.step >= s.formed_at_step + 20

    strategy = zf.RingAllReduceStrategy()
    with zf.MonitoredTrainingSession(strategy=strategy, checkpoint_dir=os.path.join(out, "ckpt"), save_checkpoint_steps=10,
                                     hooks=[UntilFormed()], progress=False) as mon:
        mon.create({"w": np.zeros(1 << 18, np.float32), "b": np.zeros((4, 3))}, optimizer=zf.optim.Adam(1e-3))
        print("joined", "first" if first_run else "again", "restored" if mon.restored_from else "live",
              "generation", strategy.generation, "step", mon.step, flush=True)
        chief = None
        while not mon.should_stop():
            if mon.is_chief != chief:
                chief = mon.is_chief
                print("acting chief", chief, "at step", mon.step, "generation", strategy.generation, flush=True)
            k = mon.worker_index + 1
            mon.apply({"w": np.full(1 << 18, 1e-3 * k, np.float32), "b": np.full((4, 3), float(k + mon.step % 7))})
            if mon.step % 10 == 0:
                print("step", mon.step, "generation", strategy.generation, flush=True)
        params = mon.params()
        np.savez(os.path.join(out, mon.task_name + ".npz"), **params)
        print("finished at step", mon.step, "generation", strategy.generation, "members", len(strategy.members), flush=True)
    """
)


def _pid(p, task: str) -> int:
    return int(p.wait_for_line(f"[{task}] pid ", 60).split()[-1])


def _assert_raised_within_5s(p, survivors: list[str], killed: str, killed_at: float) -> None:
    for task in survivors:
        line = p.wait_for_line(f"[{task}] {task}: ring generation 1 failed", max(0.01, killed_at + 5 - time.monotonic()))
        assert killed in line, line


def _finals(tmp_path, tasks: list[str]) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(tmp_path / f"{t}.npz")) for t in tasks]


def test_a_rank_killed_mid_allreduce_makes_the_others_raise_within_5s_and_reform(tmp_path, procs):
    p = launch_script(procs, tmp_path / "elastic.py", ELASTIC, tmp_path, 2, 2, workers=3)
    pid = _pid(p, "worker:2")
    p.wait_for_line("[worker:2] step 30 ", 90)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _assert_raised_within_5s(p, ["worker:0", "worker:1"], "worker:2", killed_at)
    for task in ("worker:0", "worker:1"):
        line = p.wait_for_line(f"[{task}] {task}: ring re-formed as generation 2 with worker:0, worker:1", 30)
        assert "(recovered)" in line, line
    assert p.wait(120) == 137, p.output  # the launcher reports the killed task's SIGKILL
    for task in ("worker:0", "worker:1"):
        assert "generation 2 members 2" in p.wait_for_line(f"[{task}] finished at step", 1)
    a, b = _finals(tmp_path, ["worker:0", "worker:1"])
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_killed_chief_hands_the_ring_over_and_rejoins_after_its_restart(tmp_path, procs):
    p = launch_script(procs, tmp_path / "elastic.py", ELASTIC, tmp_path, 3, 3, workers=3, restart=True)
    pid = _pid(p, "worker:0")
    p.wait_for_line("[worker:0] step 30 ", 90)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _assert_raised_within_5s(p, ["worker:1", "worker:2"], "worker:0", killed_at)
    assert p.wait(100) == 0, p.output
    out = p.output
    assert "restarting worker:0" in out
    # the chief's duties (checkpoints) moved to the new leader, and back to the chief when it rejoined
    assert "[worker:1] acting chief True at step" in out and "[worker:1] acting chief False at step" in out
    assert out.count("[worker:0] acting chief True") == 2 and "[worker:2] acting chief True" not in out
    assert "[worker:0] joined again live generation 3" in out  # it took the live replica, not its checkpoint
    finals = [p.wait_for_line(f"[{t}] finished at step", 1) for t in W]
    assert len({line.split("] ", 1)[1] for line in finals}) == 1, finals  # same step, generation 3, 3 members
    assert "members 3" in finals[0]
    results = _finals(tmp_path, W)
    for task, got in zip(W[1:], results[1:]):
        for name in got:
            np.testing.assert_array_equal(got[name], results[0][name], err_msg=f"{task} {name}")


def test_a_frozen_rank_is_left_out_and_rejoins_when_it_resumes_without_a_ring_of_its_own(tmp_path, procs):
    """SIGSTOP: its peers drop it at their heartbeat timeout; on SIGCONT it sees every peer as down
    for a moment, yet must not form a ring alone (it holds no majority, and its peers answer)."""
    p = launch_script(procs, tmp_path / "elastic.py", ELASTIC, tmp_path, 3, 3, workers=3)
    pid = _pid(p, "worker:2")
    p.wait_for_line("[worker:2] step 30 ", 90)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        _assert_raised_within_5s(p, ["worker:0", "worker:1"], "worker:2", stopped_at)
        p.wait_for_line("[worker:0] worker:0: ring re-formed as generation 2 with worker:0, worker:1 ", 30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert p.wait(120) == 0, p.output
    assert "[worker:2] worker:2: ring re-formed as generation 3 with worker:0, worker:1, worker:2" in p.output
    assert "generation 2 with worker:2 " not in p.output
    results = _finals(tmp_path, W)
    for task, got in zip(W[1:], results[1:]):
        for name in got:
            np.testing.assert_array_equal(got[name], results[0][name], err_msg=f"{task} {name}")
