"""The asynchronous ps step: a push counts its step in the ``global_step`` variable and its answer
carries the new value (no read of its own); the ps strategy pulls at each step's start, so what
other workers pushed since its last step is in the parameters it computes on."""

from __future__ import annotations


import numpy as np
import pytest

import zmqflow as zf
from zmqflow.errors import ConfigError
from zmqflow.testing import local_cluster

from .conftest import arun, local_ps_strategy


def test_a_push_that_counts_the_global_step_returns_its_new_value():
    async def main() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("w", np.zeros(3, np.float32), optimizer=zf.optim.SGD(1.0))
                await sess.variable("global_step", np.zeros((), np.int64))
                one = np.ones((), np.int64)
                assert await sess.push({"w": np.ones(3, np.float32), "global_step": one}) == 1
                assert await sess.push({"global_step": one}, learning_rate=0.5) == 2  # a plain add: no rate
                assert await sess.push({"w": np.ones(3, np.float32)}) is None  # nothing counted: no step
                assert await sess.push({"global_step": np.full((), 5, np.int64)}) == 7
                got = await sess.pull(["w", "global_step"])
                assert got["global_step"] == 7 and got["w"].tolist() == [-2, -2, -2]
                sync = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                await sess.variable("s", np.zeros(2, np.float32), optimizer=sync)
                assert await sess.push({"s": np.ones(2, np.float32)}, step=0) == 1  # a synchronous step, as before
                assert sess.step == 1

    arun(main())


def test_a_counter_beside_a_gradient_on_the_bulk_stream_still_answers_its_count():
    """A task's share from 1 MiB goes on its push stream, whose answer carries no count: a
    one-element variable goes over ZeroMQ whatever its shape."""
    async def main() -> None:
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with zf.AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                big = np.ones(1 << 19, np.float32)  # 2 MiB: the bulk stream's
                await sess.variable("w", np.zeros_like(big))
                await sess.variable("global_step", np.zeros((1,), np.int64))
                assert await sess.push({"w": big, "global_step": np.ones((1,), np.int64)}) == 1
                got = await sess.pull(["w", "global_step"])
                assert got["global_step"].tolist() == [1] and float(got["w"][-1]) == 1.0

    arun(main())

def test_the_async_ps_strategy_reads_at_each_step_and_its_step_counts_every_push(local):
    """``params`` pulls at each step's start, so it holds another worker's push made after this
    worker's ``apply`` (a read-back with the push would miss it: a staler gradient); ``apply``
    returns the global step after its own push, other workers' pushes since its read included."""
    sess, strategy = local_ps_strategy(sync=False)
    strategy.create({"w": np.zeros(2, np.float32)}, zf.optim.SGD(1.0))
    strategy.params()
    assert strategy.apply({"w": np.ones(2, np.float32)}) == 1
    one = np.ones((), np.int64)
    sess.push({"w": np.full(2, 2, np.float32), "global_step": one}, learning_rate=1.0)  # another worker's step
    assert strategy.params()["w"].tolist() == [-3, -3]
    sess.push({"w": np.ones(2, np.float32), "global_step": one}, learning_rate=1.0)  # one more, after that read
    assert strategy.apply({"w": np.ones(2, np.float32)}) == 4 and strategy.step_var.read() == 4
    assert strategy.apply({}) == 5  # a step without gradients still counts
    assert strategy.params()["w"].tolist() == [-5, -5] and strategy.step_var.read() == 5


@pytest.mark.parametrize("sync", [False, True])
def test_a_parameter_named_as_the_global_step_is_refused(local, sync: bool):
    _, strategy = local_ps_strategy(sync)
    with pytest.raises(ConfigError, match="'global_step'"):
        strategy.create({"w": np.zeros(2, np.float32), "global_step": np.zeros((), np.int64)}, zf.optim.SGD(1.0))
