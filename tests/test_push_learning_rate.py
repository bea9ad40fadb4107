"""A push carries its own learning rate: each part's optimizer applies it in place of its own, on
every path (dense and sparse over ZeroMQ, the bulk stream, a synchronous step), so a worker's
schedule reaches the shards; a rate out of range is refused before anything changes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.errors import InvalidArgument
from zmqflow.state.optim import Momentum
from zmqflow.testing import local_cluster
from zmqflow.wire.requests import ps as rq

from .conftest import arun

G = np.arange(1, 5, dtype=np.float32)


def test_a_push_applies_its_own_rate_and_the_next_one_the_optimizers():
    async def main() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                w = await sess.variable("w", np.zeros(4, np.float32), optimizer=zf.optim.SGD(0.1))
                await w.push(G, learning_rate=1.0)
                np.testing.assert_allclose(await w.read(), -G)
                await w.push(G)  # the optimizer's own 0.1 again
                np.testing.assert_allclose(await w.read(), -1.1 * G, rtol=1e-6)
                await w.push((np.array([1]), np.ones(1, np.float32)), learning_rate=10.0)  # sparse: row 1 only
                np.testing.assert_allclose(await w.read(), -1.1 * G - np.array([0, 10, 0, 0]), rtol=1e-6)
                # momentum's slot goes on from step to step whatever each step's rate
                m = await sess.variable("m", np.zeros(4, np.float32), optimizer=Momentum(0.1, momentum=0.9))
                value, acc = np.zeros(4, np.float32), np.zeros(4, np.float32)
                for rate in (0.5, 0.25, None):
                    await m.push(G, learning_rate=rate)
                    acc = 0.9 * acc + G
                    value -= (0.1 if rate is None else rate) * acc
                np.testing.assert_allclose(await m.read(), value, rtol=1e-6)

    arun(main())


def test_the_bulk_stream_and_a_sync_step_apply_the_rate():
    big = np.ones((1 << 19, 2), np.float32)  # 4 MiB: past BULK_FROM, so it goes on the push stream
    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 2}, timeout=20, transport="tcp") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as a, \
                    zf.AsyncSession(servers["worker:1"].target) as b:
                v = await a.variable("big", np.zeros_like(big), optimizer=zf.optim.SGD(0.01))
                await v.push(big, learning_rate=2.0)
                assert servers["ps:0"].service("ps").bulk.opened == 1  # its push stream: it went on the stream
                np.testing.assert_array_equal(await v.read(), -2 * big)
                opt = zf.optim.SyncReplicas(zf.optim.SGD(0.1), replicas_to_aggregate=2)
                s = await a.variable("s", np.zeros(4, np.float32), optimizer=opt)
                t = await b.get("s")
                await asyncio.gather(s.push(G, step=0, learning_rate=0.5), t.push(3 * G, step=0, learning_rate=0.5))
                np.testing.assert_allclose(await s.read(), -0.5 * 2 * G)  # the mean, at the pushes' rate

    arun(main())


def test_a_rate_out_of_range_is_refused_and_changes_nothing():
    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                w = await sess.variable("w", np.zeros(4, np.float32), optimizer=zf.optim.SGD(0.1))
                for bad in (float("nan"), -1.0, float("inf"), "0.1", True):
                    with pytest.raises(InvalidArgument, match="learning_rate must be a finite number >= 0"):
                        await w.push(G, learning_rate=bad)
                with pytest.raises(InvalidArgument, match="learning_rate"):  # past the client: the shard's check
                    await sess.call("ps", "push", rq.Push(dense=[rq.RowsItem("w", 0, None, None, G)],
                                                          learning_rate=-1.0), task="ps:0")
                np.testing.assert_array_equal(await w.read(), np.zeros(4, np.float32))

    arun(main())
