"""TensorFlow's semantics where users lean on them: variables on any task, a deadline on every
handle call, and a typed error (not NotFound) when a shard restarted empty."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client.checkpoint import async_recover, async_restore, async_save
from zmqflow.client.session import AsyncSession
from zmqflow.cluster import holder_tasks
from zmqflow.errors import DeadlineExceeded, NotFound, ShardStateLost, Unavailable
from zmqflow.testing import REQUEST, faulty_cluster, local_cluster, make_spec, wait_until
from zmqflow.wire.requests import ps as rq
from zmqflow.wire.requests.cluster import Records

from .conftest import arun


# variables on any task ------------------------------------------------------------------------


def test_any_task_holds_variables_pinned_to_it():
    async def scenario() -> None:
        async with local_cluster({"local": 2}, timeout=20) as servers:
            sess = AsyncSession(servers["local:0"].target)
            try:
                with zf.device("/job:local/task:1"):
                    v = await sess.variable("v", np.arange(6, dtype=np.float32).reshape(3, 2))
                    big = await sess.variable("big", shape=(8,), partitioner=zf.fixed_size_partitioner(2))
                d = await sess.variable("d", 1.0)  # no ps job: default placement is the first task
                assert v.partitions == [{"task": "local:1", "rows": [0, 3]}]
                assert {p["task"] for p in big.partitions} == {"local:1"}
                assert d.partitions[0]["task"] == "local:0"
                await v.assign_add(np.ones((3, 2), np.float32))
                await v.scatter_update([1], np.full((1, 2), 9, np.float32))
                np.testing.assert_array_equal(await v.read(), [[1, 2], [9, 9], [5, 6]])
                # the rows are on local:1's shard, found by name from a session on another task
                other = AsyncSession(servers["local:1"].target)
                try:
                    np.testing.assert_array_equal(await (await other.get("v", timeout=5)).read(), [[1, 2], [9, 9], [5, 6]])
                finally:
                    await other.close()
                held = await sess.call("ps", "variables", task="local:1")
                assert {(h["name"], h["part"]) for h in held} == {("v", 0), ("big", 0), ("big", 1)}
            finally:
                await sess.close()

    arun(scenario())


def test_a_worker_holds_a_pinned_variable_while_default_placement_stays_on_ps():
    async def scenario() -> None:
        async with local_cluster({"ps": 2, "worker": 2}, timeout=20) as servers:
            sess = AsyncSession(servers["worker:1"].target)
            try:
                with zf.device("/job:worker/task:0"):
                    w = await sess.variable("w", np.zeros(4))
                free = [await sess.variable(f"f{i}", 0.0) for i in range(4)]
                assert w.partitions[0]["task"] == "worker:0"
                assert [f.partitions[0]["task"] for f in free] == ["ps:0", "ps:1", "ps:0", "ps:1"]
                await w.push(np.ones(4))  # no optimizer: the gradient is added
                await w.assign_sub(np.full(4, 0.5))
                np.testing.assert_array_equal((await sess.pull(["w"]))["w"], np.full(4, 0.5))
            finally:
                await sess.close()

    arun(scenario())


def test_checkpoint_save_and_restore_cover_a_variable_on_a_worker(tmp_path):
    async def scenario() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=20) as servers:
            sess = AsyncSession(servers["ps:0"].target)
            try:
                with zf.device("/job:worker/task:0"):
                    w = await sess.variable("w", np.arange(5.0), optimizer=zf.optim.Momentum(0.1, 0.9))
                p = await sess.variable("p", np.ones(3))
                await w.push(np.ones(5))  # a momentum slot on the worker's shard too
                saved_w, saved_p = await w.read(), await p.read()
                path = await async_save(sess, str(tmp_path / "ckpt"), step=7)
                with open(path) as fh:
                    assert {s["task"] for s in json.load(fh)["shards"]} == {"ps:0", "worker:0"}
                # the worker's shard restarts empty (same address); the catalog on ps:0 survives
                spec = servers["worker:0"].spec
                await servers["worker:0"].stop()
                servers["worker:0"] = await zf.AsyncServer(spec, "worker:0", checkpoint_roots="*").start()
                await p.assign(np.zeros(3))
                assert await async_restore(sess, path) == 7
                np.testing.assert_array_equal(await w.read(), saved_w)
                np.testing.assert_array_equal(await p.read(), saved_p)
                assert w.partitions[0]["task"] == "worker:0"
                # the optimizer slot came back too: the next step is the same as it would have been
                await w.push(np.ones(5))
                np.testing.assert_allclose(await w.read(), saved_w - 0.1 * (0.9 * 1 + 1))
            finally:
                await sess.close()

    arun(scenario())


def test_recovery_after_the_catalog_is_lost_puts_a_pinned_variable_back_on_its_worker(tmp_path):
    async def scenario() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=20) as servers:
            sess = AsyncSession(servers["worker:0"].target)
            try:
                with zf.device("worker:0"):
                    w = await sess.variable("w", np.arange(3.0))
                await sess.variable("p", np.ones(2))
                path = await async_save(sess, str(tmp_path / "ckpt"), step=2)
                await w.assign(np.zeros(3))  # a change the recovery must undo
                spec = servers["ps:0"].spec  # ps:0 restarts empty: the catalog is gone with it
                await servers["ps:0"].stop()
                servers["ps:0"] = await zf.AsyncServer(spec, "ps:0", checkpoint_roots="*").start()
                assert await async_recover(sess, path) == 2
                again = await sess.get("w", timeout=5)
                assert again.partitions == [{"task": "worker:0", "rows": [0, 3]}]
                np.testing.assert_array_equal(await again.read(), np.arange(3.0))
                np.testing.assert_array_equal((await sess.pull(["p"]))["p"], np.ones(2))
                assert holder_tasks(spec, await sess.call_catalog("records", Records())) == [
                    zf.TaskId("ps", 0), zf.TaskId("worker", 0)]
            finally:
                await sess.close()

    arun(scenario())


def test_holder_tasks_are_the_default_shards_and_every_task_a_part_is_placed_on():
    spec = zf.ClusterSpec({"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001", "127.0.0.1:2002"],
                           "ps": ["127.0.0.1:2003", "127.0.0.1:2004"]})
    records = [{"parts": [{"task": "worker:1", "rows": [0, 1]}, {"task": "ps:1", "rows": [1, 2]}]}]
    assert [str(t) for t in holder_tasks(spec, records)] == ["worker:1", "ps:0", "ps:1"]
    assert [str(t) for t in holder_tasks(spec, [])] == ["ps:0", "ps:1"]
    local = zf.ClusterSpec({"local": ["127.0.0.1:2000", "127.0.0.1:2001"]})
    assert [str(t) for t in holder_tasks(local, [])] == ["local:0"]  # no ps job: the first task


# a deadline on every handle call ------------------------------------------------------------------


TINY = 0.3


def test_every_handle_call_takes_a_timeout_against_a_stalled_shard():
    async def scenario() -> None:
        async with faulty_cluster({"ps": 1, "worker": 1}, timeout=20) as (servers, faults):
            sess = AsyncSession(servers["worker:0"].target, timeout=30)
            try:
                v = await sess.variable("v", np.zeros((4, 2)))
                static = await sess.embedding("static", 10, 2)
                dynamic = await sess.embedding("dynamic", None, 2)
                ids = np.array([1, 2])
                rows = np.ones((2, 2))
                grads = np.ones((2, 2), np.float32)
                calls = {
                    "Variable.read": lambda: v.read(timeout=TINY),
                    "Variable.assign": lambda: v.assign(np.ones((4, 2)), timeout=TINY),
                    "Variable.assign_add": lambda: v.assign_add(np.ones((4, 2)), timeout=TINY),
                    "Variable.assign_sub": lambda: v.assign_sub(np.ones((4, 2)), timeout=TINY),
                    "Variable.scatter_add": lambda: v.scatter_add(ids, rows, timeout=TINY),
                    "Variable.scatter_update": lambda: v.scatter_update(ids, rows, timeout=TINY),
                    "Variable.push": lambda: v.push(np.ones((4, 2)), timeout=TINY),
                    "Session.pull": lambda: sess.pull(["v"], timeout=TINY),
                    "Session.push": lambda: sess.push({"v": np.ones((4, 2))}, timeout=TINY),
                    "Session.global_step": lambda: sess.global_step(timeout=TINY),
                    "Embedding.lookup": lambda: static.lookup(ids, timeout=TINY),
                    "Embedding.lookup_sparse": lambda: static.lookup_sparse(ids, [0, 0], timeout=TINY),
                    "Embedding.push": lambda: static.push(ids, grads, timeout=TINY),
                    "Embedding.stats": lambda: static.stats(timeout=TINY),
                    "Embedding.size": lambda: dynamic.size(timeout=TINY),
                    "Embedding.evict": lambda: dynamic.evict(5, timeout=TINY),
                    "Embedding.export": lambda: anext(static.export(timeout=TINY)),
                }
                # every request to the ps shard is parked: the shard looks alive but never answers
                stall = faults.hold(direction=REQUEST, server="ps:0", when=lambda p: p.service == "ps")
                try:
                    for what, call in calls.items():
                        start = time.monotonic()
                        with pytest.raises(DeadlineExceeded):
                            await call()
                        took = time.monotonic() - start
                        assert TINY * 0.9 <= took < TINY + 3, f"{what} took {took:.2f}s"  # not the session's 30 s
                finally:
                    stall.release()
                # the shard answers again (the parked writes land too, in some order)
                assert (await v.read(timeout=5)).shape == (4, 2)
                assert await static.size(timeout=5) == 10
            finally:
                await sess.close()

    arun(scenario(), timeout=90)


def test_blocking_handles_pass_their_timeout_on():
    spec = make_spec({"ps": 1, "worker": 1})
    ps = zf.Server(spec, "ps:0")
    worker = zf.Server(spec, "worker:0")
    release, stalled_now = threading.Event(), threading.Event()

    async def stall() -> None:
        stalled_now.set()
        release.wait(30)  # blocks the shard's loop: connected, heartbeating (libzmq), never answering

    try:
        with zf.Session(worker.target, timeout=30) as sess:
            v = sess.variable("v", np.zeros(3))
            table = sess.embedding("t", 4, 2)
            stalled = ps.loop_thread.submit(stall())
            assert stalled_now.wait(10)
            try:
                for call in (lambda: v.read(timeout=TINY), lambda: v.assign_add(np.ones(3), timeout=TINY),
                             lambda: table.lookup([1], timeout=TINY), lambda: sess.pull(["v"], timeout=TINY),
                             lambda: sess.push({"v": np.ones(3)}, timeout=TINY)):
                    start = time.monotonic()
                    with pytest.raises(DeadlineExceeded):
                        call()
                    assert time.monotonic() - start < TINY + 3  # not the session's 30 s
            finally:
                release.set()
                stalled.result(10)
    finally:
        worker.stop()
        ps.stop()


# a shard that restarted empty ---------------------------------------------------------------------


def _restart(spec: zf.ClusterSpec, server: zf.Server) -> zf.Server:
    """Stop ``server`` and start its task again on the same address, with nothing in it."""
    server.stop()
    return zf.Server(spec, server.task, checkpoint_roots="*")


def _reachable(sess: zf.Session, task: str) -> bool:
    try:
        sess.status(task)
        return True
    except Unavailable:
        return False


def test_a_restarted_empty_shard_raises_shard_state_lost_not_not_found(tmp_path):
    spec = make_spec({"ps": 1, "worker": 1})
    servers = {str(t): zf.Server(spec, t, checkpoint_roots="*") for t in spec.tasks}
    try:
        with zf.Session(servers["worker:0"].target) as sess, zf.Session(servers["ps:0"].target) as other:
            v = sess.variable("v", np.arange(4.0))
            table = sess.embedding("t", 6, 2, initializer=zf.init.constant(0.5))
            seen = other.get("v", timeout=5)  # another plain session that used the shard before
            assert seen.read().tolist() == [0, 1, 2, 3]
            path = zf.checkpoint.save(sess, str(tmp_path / "ckpt"), step=3)
            servers["ps:0"] = _restart(spec, servers["ps:0"])
            wait_until(lambda: _reachable(sess, "ps:0") and _reachable(other, "ps:0"), 20, what="ps:0 back")

            for call in (v.read, lambda: sess.pull(["v"]), lambda: v.assign_add(np.ones(4)),
                         lambda: sess.push({"v": np.ones(4)}), lambda: table.lookup([1]), seen.read):
                with pytest.raises(ShardStateLost) as info:
                    try:
                        call()
                    except NotFound:  # code that handles unknown names must not swallow this
                        pytest.fail("a lost shard's state surfaced as NotFound")
                err = info.value
                assert not isinstance(err, NotFound) and isinstance(err, Unavailable)
                assert err.task == "ps:0" and "ps:0" in str(err)
                assert "restarted" in str(err) and "restore from a checkpoint" in str(err).lower()

            assert zf.checkpoint.restore(sess, path) == 3
            np.testing.assert_array_equal(v.read(), np.arange(4.0))
            np.testing.assert_array_equal(seen.read(), np.arange(4.0))
            np.testing.assert_array_equal(table.lookup([1]), [[0.5, 0.5]])
            v.assign_add(np.ones(4))
            np.testing.assert_array_equal(other.pull(["v"])["v"], np.arange(4.0) + 1)
    finally:
        for s in servers.values():
            s.stop()


def test_an_unknown_name_on_a_live_shard_is_still_not_found():
    async def scenario() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=20) as servers:
            sess = AsyncSession(servers["worker:0"].target)
            try:
                await sess.variable("v", 0.0)
                with pytest.raises(NotFound) as info:
                    await sess.call_task(zf.TaskId("ps", 0), "ps", "pull", rq.Pull(items=[rq.PullItem("nope", 0, None, None)]))
                assert not isinstance(info.value, ShardStateLost)
            finally:
                await sess.close()

    arun(scenario())


def test_variables_declared_at_once_ask_each_shard_who_it_is_once():
    """A model's variables declared in one gather: each shard is asked its incarnation once, not
    once a variable (each question sums what the shard holds: quadratic in all)."""
    async def scenario() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=20) as servers:
            async with AsyncSession(servers["worker:0"].target) as sess:
                asked: list[str] = []
                call = sess.client.call

                async def counted(endpoint: str, service: str, op: str, *args: Any, **kw: Any) -> Any:
                    if (service, op) == ("ps", "status"):
                        asked.append(kw.get("name", endpoint))
                    return await call(endpoint, service, op, *args, **kw)

                sess.client.call = counted  # type: ignore[method-assign]
                part = zf.fixed_size_partitioner(2)
                made = await asyncio.gather(*(sess.variable(f"v{i}", np.zeros(4), partitioner=part)
                                              for i in range(40)))
                assert sorted(asked) == ["ps:0", "ps:1"] and len(made) == 40

    arun(scenario())
