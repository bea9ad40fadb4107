"""Recovery of ps shards: the fence around a restore, orphaned parts, and a killed shard mid-training
whose result must equal an uninterrupted run from the same checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import textwrap

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint, errors
from zmqflow.cli.status import cluster_status, format_status
from zmqflow.rpc import CallContext
from zmqflow.testing import async_wait_until, free_port, local_cluster, make_spec

from .conftest import ZMQFLOW, arun, launch_script


def test_a_fenced_shard_refuses_data_ops_and_fails_waiting_sync_pushes():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            ps = servers["ps:0"].service("ps")
            async with zf.AsyncSession(servers["worker:0"].target, name="worker:0") as sess:
                v = await sess.variable("v", np.zeros(3), optimizer=zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2))
                waiting = asyncio.ensure_future(v.push(np.ones(3), step=0))  # one of two replicas: it waits
                await async_wait_until(lambda: ps.store.get("v", 0).sync.contributors, 5, what="the push to arrive")
                epoch = await sess.call_task(zf.TaskId("ps", 0), "ps", "fence")
                assert epoch == 1
                with pytest.raises(errors.Recovering, match="step 0 of v.*abandoned.*recovery epoch 1"):
                    await waiting
                assert ps.store.get("v", 0).sync.contributors == [] and ps.store.get("v", 0).sync.step == 0
                for call in (v.read(), v.push(np.ones(3), step=0), sess.global_step()):
                    with pytest.raises(errors.Recovering, match=r"ps\.\w+ refused: this shard is being restored"):
                        await call
                status = await sess.call_task(zf.TaskId("ps", 0), "ps", "status")
                assert status["fenced"] and status["epoch"] == 1
                # what `zmqflow status` shows an operator
                rows = await cluster_status(servers["ps:0"].spec, 5)
                assert rows[0]["state"] == {"ps": "recovering (epoch 1)"}
                assert "recovering (epoch 1)" in format_status(rows).splitlines()[1]
                # a stale unfence (an older recovery's) does not lift a newer fence
                assert await sess.call_task(zf.TaskId("ps", 0), "ps", "unfence", {"epoch": 0}) is False
                with pytest.raises(errors.Recovering):
                    await v.read()
                assert await sess.call_task(zf.TaskId("ps", 0), "ps", "unfence", {"epoch": 1}) is True
                np.testing.assert_array_equal(await v.read(), np.zeros(3))  # nothing of the abandoned step applied
                assert (await cluster_status(servers["ps:0"].spec, 5))[0]["state"] == {"ps": "restored (epoch 1)"}

    arun(main())


def test_a_client_that_used_the_shard_before_a_recovery_is_refused_once_after_it():
    """A request sent before the fence may arrive after the unfence; the shard refuses each earlier
    client's first data op after the recovery (requests on a connection arrive in order)."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            target, ps0 = servers["worker:0"].target, zf.TaskId("ps", 0)
            async with zf.AsyncSession(target) as user, zf.AsyncSession(target) as restorer:
                v = await user.variable("v", np.zeros(2))
                await v.read()
                epoch = await restorer.call_task(ps0, "ps", "fence")
                assert await restorer.call_task(ps0, "ps", "unfence", {"epoch": epoch})
                np.testing.assert_array_equal(await (await restorer.get("v")).read(), np.zeros(2))  # the restorer knows
                async with zf.AsyncSession(target) as fresh:
                    np.testing.assert_array_equal(await (await fresh.get("v")).read(), np.zeros(2))  # so does a new client
                with pytest.raises(errors.Recovering, match="first request since this shard was restored"):
                    await v.assign_add(np.ones(2))
                np.testing.assert_array_equal(await v.read(), np.zeros(2))  # the refused write changed nothing
                await v.assign_add(np.ones(2))  # and from the second request on, it is served
                np.testing.assert_array_equal(await v.read(), np.ones(2))

    arun(main())


def test_a_push_admitted_before_a_fence_does_not_land_after_it():
    """A sync push is offered where it is admitted, then waits for its step; a fence handled
    while it waits fails it and drops its gradient."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            ps = servers["ps:0"].service("ps")
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("v", np.zeros(3), optimizer=zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2))
            ctx = CallContext("ps", "push", b"peer", "worker:0", None)
            admitted = ps.push(ctx, dense=[["v", 0, None, None, np.ones(3)]], step=0)
            ps.fence(ctx)
            with pytest.raises(errors.Recovering):
                await admitted
            assert ps.store.get("v", 0).sync.contributors == []

    arun(main())


def test_recover_reads_the_checkpoint_first_drops_rows_added_since_and_lifts_an_orphaned_fence(tmp_path):
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    servers = [zf.Server(spec, t, checkpoint_roots=[str(tmp_path)]) for t in ("ps:0", "ps:1", "worker:0")]
    try:
        with zf.Session(servers[2].target) as sess:
            emb = sess.embedding("dyn", None, 2, initializer=zf.init.normal(seed=3), optimizer=zf.optim.SGD(1.0))
            before = emb.lookup([1, 2, 3])
            w = sess.variable("w", np.arange(4.0), optimizer=zf.optim.SGD(1.0))
            ckpt = checkpoint.save(sess, str(tmp_path), step=7)
            emb.lookup([99, 100])  # rows created after the checkpoint
            emb.push([1], np.ones((1, 2), np.float32))
            w.push(np.ones(4))
            with pytest.raises(errors.NotFound):  # a bad path changes nothing: no shard is fenced or swept
                checkpoint.recover(sess, str(tmp_path / "missing"))
            assert checkpoint.fenced(sess) == []
            # a restorer that died after fencing leaves the shards fenced: saving is refused, recovery lifts it
            for t in ("ps:0", "ps:1"):
                sess.call("ps", "fence", task=t)
            assert checkpoint.fenced(sess) == ["ps:0", "ps:1"]
            with pytest.raises(errors.Recovering):
                checkpoint.save(sess, str(tmp_path), step=8)
            assert checkpoint.recover(sess, ckpt) == 7
            assert checkpoint.fenced(sess) == []
            ids = np.concatenate([page for page, _ in emb.export()])
            assert sorted(ids.tolist()) == [1, 2, 3]  # the rows added since the checkpoint are gone
            np.testing.assert_array_equal(emb.lookup([1, 2, 3], create=False), before)
            np.testing.assert_array_equal(w.read(), np.arange(4.0))
    finally:
        for s in servers:
            s.stop()


def test_sweep_drops_what_the_catalog_does_not_place_and_checks_its_input_first():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("a", np.zeros(2))
                await sess.variable("b", np.zeros(2))
                ps0 = servers["ps:0"].service("ps")
                ps0.store.create("orphan", 0, [2], [0, 2], "float64")  # a part no catalog record names
                t = zf.TaskId("ps", 0)
                with pytest.raises(errors.InvalidArgument, match="runs only on a fenced shard"):
                    await sess.call_task(t, "ps", "sweep", {"keep": []})  # unfenced: it would drop live parts
                assert ("orphan", 0) in ps0.store.parts and ("a", 0) in ps0.store.parts
                epoch = await sess.call_task(t, "ps", "fence")
                for bad in ([["a"]], "a", [[1, 0]], [["a", "0"]]):
                    with pytest.raises(errors.InvalidArgument, match="keep must be a list of"):
                        await sess.call_task(t, "ps", "sweep", {"keep": bad})
                assert ("orphan", 0) in ps0.store.parts  # refused input changed nothing
                records = await sess.call_catalog("records", {"pending": True})
                keep = checkpoint._placed(records, "ps:0")
                assert await sess.call_task(t, "ps", "sweep", {"keep": keep}) == [["orphan", 0]]
                assert ("orphan", 0) not in ps0.store.parts
                assert sorted(k for k, _ in ps0.store.parts) == sorted(k for k, _ in keep)
                with pytest.raises(errors.InvalidArgument, match="epoch must be an integer"):
                    await sess.call_task(t, "ps", "unfence", {"epoch": "1"})
                assert await sess.call_task(t, "ps", "unfence", {"epoch": epoch})

    arun(main())


STEPS, SAVE_EVERY, KILL_AT = 60, 20, 30

TRAIN = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    from zmqflow.testing import wait_until
    ckpt, out, pause = sys.argv[1], sys.argv[2], sys.argv[3]
    W = np.linspace(-1, 1, 18).reshape(6, 3)

    def batch(worker, step):
        rng = np.random.default_rng(1000 * worker + step)
        x = rng.standard_normal((16, 6))
        return x, x @ W + 0.5 + 0.1 * rng.standard_normal((16, 3))

    strategy = zf.ParameterServerStrategy(sync=True)
    with zf.MonitoredTrainingSession(strategy, checkpoint_dir=ckpt, save_checkpoint_steps=%d,
                                     hooks=[zf.StopAtStep(%d)], progress=False) as mon:
        rng = np.random.default_rng(0)
        mon.create({"w": rng.standard_normal((6, 3)), "b": np.zeros(3)}, optimizer=zf.optim.Momentum(0.05, 0.9))
        print("started at step", mon.step, flush=True)
        while not mon.should_stop():
            p = mon.params()
            x, y = batch(mon.worker_index, mon.step)  # the step the params belong to (the restored one after a recovery)
            err = x @ p["w"] + p["b"] - y
            mon.apply({"w": 2 * x.T @ err / len(x), "b": 2 * err.mean(0)})
            if mon.is_chief and mon.step == %d and pause != "-" and not os.path.exists(pause + ".done"):
                open(pause + ".done", "w").close()
                print("paused at step", mon.step, flush=True)
                wait_until(lambda: os.path.exists(pause), 60, what="the test to kill a shard")
        final = mon.params()
        np.savez(os.path.join(out, mon.task_name + ".npz"), **final)
        print("finished at step", mon.step, flush=True)
    """ % (SAVE_EVERY, STEPS, KILL_AT)
)


def _train(tmp_path, procs, name: str, ckpt: str, pause: str = "-", restart: bool = False):
    out = tmp_path / name
    out.mkdir()
    cfile = tmp_path / f"{name}.json"
    p = launch_script(procs, tmp_path / "train.py", TRAIN, ckpt, out, pause, workers=2, ps=2, restart=restart,
                      cluster_out=cfile)
    return p, out, cfile


@pytest.mark.parametrize("victim", ["ps:1", "ps:0"])
def test_a_killed_shard_recovers_to_what_an_uninterrupted_run_from_the_checkpoint_computes(tmp_path, procs, victim):
    """kill -9 a shard mid-training (ps:0 also holds the catalog); the run finishes at the right step
    and its parameters equal, bit for bit, a run that restarts from the restored checkpoint."""
    pause = str(tmp_path / "killed")
    ckpt = str(tmp_path / "ckpt")
    p, out, cfile = _train(tmp_path, procs, "interrupted", ckpt, pause, restart=True)
    p.wait_for_line(f"[worker:0] paused at step {KILL_AT}", 60)
    status = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--json"])
    assert status.wait(30) == 0, status.output
    pid = next(r["pid"] for r in json.loads(status.output)["tasks"] if r["task"] == victim)
    os.kill(pid, signal.SIGKILL)
    open(pause, "w").close()
    assert p.wait(120) == 0, p.output
    assert f"restarting {victim}" in p.output
    restored = p.wait_for_line("restored every shard from", 1)
    path = re.search(r"from (\S+) at step (\d+); (\d+) step\(s\) lost", restored)
    assert path and int(path.group(2)) == KILL_AT - KILL_AT % SAVE_EVERY and int(path.group(3)) == KILL_AT % SAVE_EVERY, restored
    for w in ("worker:0", "worker:1"):
        assert f"[{w}] finished at step {STEPS}" in p.output, p.output
    # the reference: a fresh cluster that starts from the checkpoint the recovery restored
    ref_ckpt = tmp_path / "ref_ckpt"
    ref_ckpt.mkdir()
    with open(path.group(1)) as fh:
        for shard in json.load(fh)["shards"]:
            shutil.copy(os.path.join(ckpt, shard["file"]), ref_ckpt)
    shutil.copy(path.group(1), ref_ckpt)
    ref, ref_out, _ = _train(tmp_path, procs, "reference", str(ref_ckpt))
    assert ref.wait(120) == 0, ref.output
    assert f"[worker:0] started at step {path.group(2)}" in ref.output
    for w in ("worker:0", "worker:1"):
        got, want = np.load(out / f"{w}.npz"), np.load(ref_out / f"{w}.npz")
        for name in ("w", "b"):
            assert got[name].dtype == np.float64
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{w} {name}")


CHIEF_DIES_SYNC = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    marker = os.path.join(sys.argv[1], os.environ["ZMQFLOW_TASK"] + ".started")
    first_run = not os.path.exists(marker)
    open(marker, "a").close()
    with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(sync=True), checkpoint_dir=os.path.join(sys.argv[1], "ckpt"),
                                     save_checkpoint_steps=5, hooks=[zf.StopAtStep(40)], progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.SGD(0.1))
        print("joined", "first" if first_run else "again", "chief" if mon.is_chief else "worker", flush=True)
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
            if first_run and mon.task_name == "worker:0" and mon.step == 10:
                os._exit(1)  # the chief dies: its checkpoint duty must not die with it
        print("finished at step", mon.step, "chief" if mon.is_chief else "worker", flush=True)
    """
)


@pytest.mark.parametrize("restart", [False, True])
def test_in_sync_training_the_next_worker_takes_over_the_chiefs_duties(tmp_path, procs, restart):
    p = launch_script(procs, tmp_path / "chief_sync.py", CHIEF_DIES_SYNC, tmp_path, workers=2, ps=1, restart=restart)
    code = p.wait(120)
    steps = [int(re.search(r"checkpoint-(\d+)", c).group(1)) for c in checkpoint.checkpoints(str(tmp_path / "ckpt"))]
    assert steps[-1] == 40, steps
    if restart:  # the chief comes back, finds live state and restores nothing; the duties follow the steps
        assert code == 0, p.output
        assert "[worker:0] joined again" in p.output and "not restoring" in p.output
        assert "[worker:0] finished at step 40" in p.output and "[worker:1] finished at step 40" in p.output
    else:  # the survivor finishes alone and checkpoints every 5 steps after the chief is gone
        assert code == 1, p.output
        assert "worker:1: worker:1 holds the chief's duties (the last step averaged worker:1)" in p.output
        assert "[worker:1] finished at step 40 chief" in p.output
        assert steps == [20, 25, 30, 35, 40], steps  # written by worker:1 (the last five kept)


def test_sync_pushes_name_the_replicas_each_step_averaged():
    """What moves the chief's duties: every pusher of a step hears the same list of replicas."""
    async def main():
        spec = zf.ClusterSpec({"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]})
        async with local_cluster(spec, timeout=10) as servers:
            target = servers["ps:0"].target
            a, b = zf.AsyncSession(target, name="worker:0"), zf.AsyncSession(target, name="worker:1")
            opt = zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2, drop_dead_replicas=True)
            await a.variable("v", np.zeros(2), optimizer=opt)
            v = await b.get("v")  # read through b: a is closed below
            await asyncio.gather(a.push({"v": np.ones(2)}), b.push({"v": np.ones(2)}))
            assert a.replicas == b.replicas == ["worker:0", "worker:1"]
            await a.close()  # worker:0 is gone: its connection drops
            for _ in range(3):
                assert await b.push({"v": np.ones(2)}) is not None
            assert b.replicas == ["worker:1"]
            again = zf.AsyncSession(target, name="worker:0")  # it comes back, and contributes again
            again.step = b.step
            # its first push may find the step already completed without it (stale); from the next, it counts
            await asyncio.gather(again.push({"v": np.ones(2)}), b.push({"v": np.ones(2)}))
            await asyncio.gather(again.push({"v": np.ones(2)}), b.push({"v": np.ones(2)}))
            assert again.replicas == b.replicas == ["worker:0", "worker:1"]
            np.testing.assert_array_equal(await v.read(), np.full(2, -6.0))  # six steps, each the mean of ones
            await again.close()
            await b.close()

    arun(main())
