"""Variables shared by name across sessions, servers and processes (issue scenarios 1, 3-6)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.rpc import CallContext
from zmqflow.testing import local_cluster, make_spec

from .conftest import arun


def test_variable_declared_in_one_session_is_seen_in_another():
    spec = make_spec({"worker": 2}, "tcp")
    with zf.Server(spec, "worker:0") as w0, zf.Server(spec, "worker:1") as w1:
        with zf.Session(w0.target) as s0, zf.Session(w1.target) as s1:
            v0 = s0.variable("var", 0.0)
            assert v0.partitions == [{"task": "worker:0", "rows": [0, 1]}]  # no ps job: the first task
            v1 = s1.variable("var", 0.0)  # identical declaration attaches
            v1.assign_add(1.0)
            assert v0.read() == 1.0 and s1.get("var").read() == 1.0
            assert s0.uninitialized(["var", "other"]) == ["other"]
            assert [v["name"] for v in s1.variables()] == ["var"]


def test_get_waits_for_the_creator_and_concurrent_declarations_make_one_variable():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            target = servers["worker:0"].target
            sessions = [zf.AsyncSession(target) for _ in range(8)]
            try:
                waiter = asyncio.ensure_future(sessions[0].get("shared", timeout=10))
                declared = await asyncio.gather(*(
                    s.variable("shared", shape=(16, 4), initializer=zf.init.normal(seed=3)) for s in sessions[1:]
                ))
                values = [await v.read() for v in declared]
                assert all(np.array_equal(values[0], v) for v in values)
                got = await waiter
                np.testing.assert_array_equal(await got.read(), values[0])
                assert len(await sessions[0].variables()) == 1
            finally:
                for s in sessions:
                    await s.close()

    arun(main())


def test_placement_round_robin_greedy_device_and_partitions():
    async def main():
        async with local_cluster({"ps": 3, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                a = await sess.variable("a", shape=(4,))
                b = await sess.variable("b", shape=(4,))
                with zf.device("/job:ps/task:2"):
                    c = await sess.variable("c", shape=(1000, 10))
                p = await sess.variable("p", shape=(10, 3), partitioner=zf.fixed_size_partitioner(3))
                assert [v.partitions[0]["task"] for v in (a, b, c)] == ["ps:0", "ps:1", "ps:2"]
                assert p.partitions == [
                    {"task": "ps:2", "rows": [0, 4]}, {"task": "ps:0", "rows": [4, 7]}, {"task": "ps:1", "rows": [7, 10]}
                ]
                with zf.placement(zf.GreedyLoadBalancing()):
                    g = await sess.variable("g", shape=(10,))
                assert g.partitions[0]["task"] == "ps:0"  # ps:2 holds c's 40 kB; ps:0 and ps:1 tie, lowest first
                mm = await sess.variable("mm", shape=(1000, 64), partitioner=zf.min_max_variable_partitioner(8, min_slice_size=64 << 10))
                assert len(mm.partitions) == 4  # 256 kB in slices of at least 64 kB
                with pytest.raises(errors.InvalidArgument, match="ps:7"):
                    with zf.device("ps:7"):
                        await sess.variable("nowhere", shape=(1,))
                with pytest.raises(errors.VariableConflict, match=r"\[10, 3\].*\[10, 3\].*1 part"):
                    await sess.variable("p", shape=(10, 3))

    arun(main())


def test_concurrent_assign_add_is_exact():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="tcp") as servers:
            sessions = [zf.AsyncSession(servers["worker:0"].target) for _ in range(8)]
            try:
                scalar = await sessions[0].variable("count", 0.0)
                split = await sessions[0].variable("counts", np.zeros(6, np.float32), partitioner=zf.fixed_size_partitioner(2))
                assert {p["task"] for p in split.partitions} == {"ps:0", "ps:1"}

                async def client(sess):
                    mine = await sess.get("count")
                    parts = await sess.get("counts")
                    for _ in range(1000):
                        await asyncio.gather(mine.assign_add(1.0), parts.assign_add(np.ones(6, np.float32)))

                await asyncio.gather(*(client(s) for s in sessions))
                assert await scalar.read() == 8000.0
                np.testing.assert_array_equal(await split.read(), np.full(6, 8000.0, np.float32))
            finally:
                for s in sessions:
                    await s.close()

    arun(main(), timeout=120)


def test_sync_replicas_equal_a_single_process_average_and_a_missing_replica_is_named():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 3))
    batches = {w: [(rng.standard_normal((8, 5)), rng.standard_normal((8, 3))) for _ in range(20)] for w in (0, 1)}
    lr = 0.1

    def grad(w, x, y):  # least squares: d/dw mean((xw - y)^2)
        return 2.0 * x.T @ (x @ w - y) / len(x)

    expected = w0.copy()
    for step in range(20):
        expected -= lr * (grad(expected, *batches[0][step]) + grad(expected, *batches[1][step])) / 2

    async def main():
        async with local_cluster({"ps": 2, "worker": 2}, timeout=10, transport="tcp") as servers:
            spec = servers["ps:0"].spec
            opt = zf.SyncReplicas(zf.optim.SGD(lr), replicas_to_aggregate=2)
            s0 = zf.AsyncSession(cluster=spec, task="worker:0")
            s1 = zf.AsyncSession(cluster=spec, task="worker:1")
            try:
                await s0.variable("w", w0, optimizer=opt, partitioner=zf.fixed_size_partitioner(2))

                async def worker(sess, idx):
                    w = await sess.get("w")
                    for step in range(20):
                        assert sess.step == step
                        current = await w.read()
                        new_step = await w.push(grad(current, *batches[idx][step]))
                        assert new_step == step + 1

                await asyncio.gather(worker(s0, 0), worker(s1, 1))
                np.testing.assert_allclose(await (await s0.get("w")).read(), expected, rtol=0, atol=1e-12)
                assert await s1.global_step() == 20
                # worker:1 is gone: worker:0's next push cannot complete and says who is missing
                async with zf.AsyncSession(cluster=spec, task="worker:0", timeout=1.0) as impatient:
                    with pytest.raises(errors.DeadlineExceeded, match="no push from worker:1") as info:
                        await impatient.push({"w": np.zeros((5, 3))}, step=20)
                assert info.value.details["missing"] == ["worker:1"]
                w = await s1.get("w")
                # a stale gradient (an older step) is dropped, counted, and answered at once
                assert (await s1.push({w: np.ones((5, 3))}, step=3)) == 20
                status = await s0.call("ps", "variables", task="ps:1")
                assert status[0]["sync"]["dropped"] >= 1
            finally:
                await s0.close()
                await s1.close()

    arun(main(), timeout=120)


def test_optimizers_through_sessions_dense_and_sparse():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                init = np.arange(12, dtype=np.float64).reshape(6, 2)
                adam = await sess.variable("adam", init, optimizer=zf.optim.Adam(0.01), partitioner=zf.fixed_size_partitioner(2))
                g = np.full((6, 2), 0.5)
                m = np.zeros_like(init)
                v = np.zeros_like(init)
                ref = init.copy()
                for t in range(1, 11):
                    await adam.push(g)
                    m = 0.9 * m + 0.1 * g
                    v = 0.999 * v + 0.001 * g * g
                    ref -= 0.01 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (np.sqrt(v) + 1e-8)
                np.testing.assert_allclose(await adam.read(), ref, rtol=0, atol=1e-12)
                sgd = await sess.variable("sgd", init, optimizer=zf.optim.SGD(0.5), partitioner=zf.fixed_size_partitioner(3))
                before = await sgd.read()
                await sgd.push((np.array([5, 0, 5]), np.ones((3, 2))))
                after = await sgd.read()
                np.testing.assert_array_equal(after[[1, 2, 3, 4]], before[[1, 2, 3, 4]])
                np.testing.assert_array_equal(after[0], before[0] - 0.5)
                np.testing.assert_array_equal(after[5], before[5] - 1.0)  # duplicates summed

    arun(main())


def test_a_push_is_applied_where_it_is_admitted_and_only_a_sync_wait_is_deferred():
    """An async push is applied in the call that admits it and answered at once (no task: a
    request behind it on the connection sees its effect); a sync push is offered at once and
    answered by a coroutine that waits for its step, while other requests are served."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"].service("ps")
            ctx = CallContext("ps", "push", b"peer", "worker:0", None)
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                w = await sess.variable("w", np.zeros(4))
                s = await sess.variable("s", np.zeros(2), optimizer=zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2))
                answer = ps.push(ctx, dense=[["w", 0, None, None, np.ones(4)]])
                assert answer == {"step": None, "stale": False, "replicas": None}
                np.testing.assert_array_equal(ps.store.get("w", 0).value, np.ones(4))
                waiting = ps.push(ctx, dense=[["s", 0, None, None, np.ones(2)]], step=0)
                assert asyncio.iscoroutine(waiting) and ps.store.get("s", 0).sync.contributors == ["worker:0"]
                pending = asyncio.ensure_future(waiting)
                np.testing.assert_array_equal(await w.read(), np.ones(4))  # served while the step waits
                other = CallContext("ps", "push", b"other", "worker:1", None)
                assert ps.push(other, dense=[["s", 0, None, None, np.ones(2)]], step=0)["replicas"] == ["worker:0", "worker:1"]
                assert (await asyncio.wait_for(pending, 5))["step"] == 1
                np.testing.assert_array_equal(await s.read(), -np.ones(2))

    arun(main())


def test_a_push_refused_for_a_missing_step_applies_none_of_its_parts():
    """A push that names an async and a sync variable without a step is refused whole: a retry
    of it must not apply the async part twice."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"].service("ps")
            ctx = CallContext("ps", "push", b"peer", "worker:0", None)
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("w", np.zeros(4))
                sync = zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                await sess.variable("s", np.zeros(2), optimizer=sync)
                for dense in ([["w", 0, None, None, np.ones(4)], ["s", 0, None, None, np.ones(2)]],
                              [["s", 0, None, None, np.ones(2)], ["w", 0, None, None, np.ones(4)]]):
                    with pytest.raises(errors.InvalidArgument, match="variable s is synchronous: pushes must carry"):
                        ps.push(ctx, dense=dense)
                    np.testing.assert_array_equal(ps.store.get("w", 0).value, np.zeros(4))
                    assert ps.store.get("s", 0).sync.contributors == []
                assert ps.pushes_applied["async"] == 0

    arun(main())


def test_a_replica_without_a_gradient_counts_in_its_round_and_a_round_of_none_applies_nothing():
    """As DDP: a replica with no gradient for a variable averages in as zero beside one that has
    one; a round where none has one leaves the value and the momentum slot alone (zeros pushed
    instead would move it by the momentum). Partitioned: each part hears the absence."""
    async def main():
        async with local_cluster({"ps": 2, "worker": 2}, timeout=10, transport="inproc") as servers:
            spec = servers["ps:0"].spec
            opt = zf.SyncReplicas(zf.optim.Momentum(1.0, momentum=0.9), replicas_to_aggregate=2)
            s0 = zf.AsyncSession(cluster=spec, task="worker:0")
            s1 = zf.AsyncSession(cluster=spec, task="worker:1")
            try:
                await s0.variable("v", np.zeros((4, 2)), optimizer=opt, partitioner=zf.fixed_size_partitioner(2))
                await s1.get("v")
                await asyncio.gather(s0.push({"v": np.full((4, 2), 2.0)}), s1.push({"v": None}))
                after = (await s0.pull(["v"]))["v"]
                np.testing.assert_array_equal(after, np.full((4, 2), -1.0))  # the mean of 2 and nothing
                steps = await asyncio.gather(s0.push({"v": None}), s1.push({"v": None}))
                assert steps == [2, 2]  # the round completed
                np.testing.assert_array_equal((await s0.pull(["v"]))["v"], after)  # and moved nothing
                await asyncio.gather(s0.push({"v": np.zeros((4, 2))}), s1.push({"v": None}))
                np.testing.assert_array_equal((await s0.pull(["v"]))["v"], after - 0.9)  # the slot kept its -1
            finally:
                await s0.close()
                await s1.close()

    arun(main(), timeout=60)


def test_a_push_naming_a_part_absent_and_with_a_gradient_or_unknown_applies_nothing():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"].service("ps")
            ctx = CallContext("ps", "push", b"peer", "worker:0", None)
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("w", np.zeros(4))
                sync = zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                await sess.variable("s", np.zeros(2), optimizer=sync)
                with pytest.raises(errors.InvalidArgument, match="names variable s both with a gradient and as absent"):
                    ps.push(ctx, dense=[["w", 0, None, None, np.ones(4)], ["s", 0, None, None, np.ones(2)]],
                            absent=[["s", 0]], step=0)
                with pytest.raises(errors.NotFound, match="no variable 'nope'"):
                    ps.push(ctx, dense=[["w", 0, None, None, np.ones(4)]], absent=[["s", 0], ["nope", 0]], step=0)
                np.testing.assert_array_equal(ps.store.get("w", 0).value, np.zeros(4))
                assert ps.store.get("s", 0).sync.contributors == [] and ps.pushes_applied["async"] == 0
                assert ps.push(ctx, absent=[["w", 0]]) == {"step": None, "stale": False, "replicas": None}
                assert ps.pushes_applied["async"] == 0  # an async part ignores an absence

    arun(main())


def test_bad_input_changes_nothing():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                v = await sess.variable("v", np.arange(8, dtype=np.float32).reshape(4, 2), partitioner=zf.fixed_size_partitioner(2))
                before = await v.read()
                with pytest.raises(errors.NotFound, match="'missing'"):
                    await sess.pull(["v", "missing"])
                with pytest.raises(errors.NotFound, match="'missing'"):
                    await sess.get("missing", timeout=0.1)
                with pytest.raises(errors.InvalidArgument, match=r"expected shape \[4, 2\], got \[4, 3\]"):
                    await v.assign(np.zeros((4, 3), np.float32))
                with pytest.raises(errors.InvalidArgument, match="^value of 'v': expected dtype float32, got float64$"):
                    await v.assign_add(np.zeros((4, 2)))
                with pytest.raises(errors.InvalidArgument, match=r"index 4 out of range \[0, 4\)"):
                    await v.scatter_add([0, 4], np.ones((2, 2), np.float32))
                with pytest.raises(errors.InvalidArgument, match=r"index -1 out of range"):
                    await v.scatter_update([-1], np.ones((1, 2), np.float32))
                with pytest.raises(errors.InvalidArgument, match="expected shape"):
                    await v.push(np.ones((2, 2), np.float32))
                # the shard checks too, whatever a client sends
                with pytest.raises(errors.InvalidArgument, match="expected shape"):
                    await sess.call("ps", "assign", {"items": [["v", 0, 0, 2, np.zeros((3, 2), np.float32)]]}, task="ps:0")
                with pytest.raises(errors.InvalidArgument, match="out of range"):
                    await sess.call("ps", "scatter", {"name": "v", "part": 1, "indices": np.array([7]),
                                                      "rows": np.ones((1, 2), np.float32)}, task="ps:1")
                np.testing.assert_array_equal(await v.read(), before)
                small = await sess.variable("small", 5, dtype="int8")
                for bad in (300, 2**80, "x"):  # a python value the dtype cannot hold: named, nothing sent
                    with pytest.raises(errors.InvalidArgument, match="value of 'small': cannot be held as int8"):
                        await small.assign_add(bad)
                await small.assign_sub(2)  # the scalar fast path
                assert (await small.read()) == 3 and (await small.read()).dtype == np.int8

    arun(main())


def test_big_variables_move_in_slices():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=20, transport="tcp") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                x = np.random.default_rng(1).standard_normal((5000, 1000)).astype(np.float32)  # 20 MB
                v = await sess.variable("big", shape=x.shape)
                ps = servers["ps:0"]
                before = ps.counters.msgs_in
                await v.assign(x)
                assert ps.counters.msgs_in - before >= 5  # 4 MB slices, not one 20 MB frame
                np.testing.assert_array_equal(await v.read(), x)
                await v.push(x)
                np.testing.assert_array_equal(await v.read(), 2 * x)

    arun(main(), timeout=120)


def test_named_lookup_survives_a_worker_restart():
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    with zf.Server(spec, "ps:0"):
        with zf.Server(spec, "worker:0") as w0, zf.Session(w0.target) as sess:
            sess.variable("kept", np.ones(3, np.float32)).assign_add(np.ones(3, np.float32))
        with zf.Server(spec, "worker:0") as w0, zf.Session(w0.target) as sess:
            np.testing.assert_array_equal(sess.get("kept").read(), np.full(3, 2.0, np.float32))


def test_backup_workers_never_block_and_every_gradient_is_accounted_for():
    async def main():
        async with local_cluster({"ps": 1, "worker": 3}, timeout=10, transport="inproc") as servers:
            spec = servers["ps:0"].spec
            sessions = [zf.AsyncSession(cluster=spec, task=f"worker:{i}") for i in range(3)]
            opt = zf.SyncReplicas(zf.optim.SGD(0.1), replicas_to_aggregate=2, total_num_replicas=3)
            try:
                await sessions[0].variable("w", np.zeros(3), optimizer=opt)
                pushes = [0, 0, 0]

                async def worker(i, sess):
                    w = await sess.get("w")
                    while sess.step < 10:
                        await w.read()
                        await w.push(np.full(3, float(i + 1)))
                        pushes[i] += 1

                await asyncio.gather(*(worker(i, s) for i, s in enumerate(sessions)))
                part = servers["ps:0"].service("ps").store.get("w")
                assert part.sync.step == 10
                assert 2 * part.sync.step + part.sync.dropped + len(part.sync.contributors) == sum(pushes)
            finally:
                for s in sessions:
                    await s.close()

    arun(main(), timeout=60)
