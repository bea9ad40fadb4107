"""A large pull from few tasks spread over several pull streams (lanes), each with its own threads:
the bytes land where one stream would have put them, a lane a task will not give costs only that
lane, and the number of lanes is the caller's to set."""

from __future__ import annotations

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.bulk_pull import LANE_BYTES, LANES_ENV, Lanes, Piece, lanes
from zmqflow.client.session import AsyncSession
from zmqflow.testing import local_cluster
from zmqflow.wire.requests import ps as rq

from .conftest import arun

ROWS = LANE_BYTES // (64 * 4) * 3  # 3 lanes' worth of float32 rows of 64


async def _streams(sess: AsyncSession, task: str, kind: str = "pull") -> list:
    """The session's open streams of ``kind`` to ``task``, by lane (None where a lane has none)."""
    t = zf.TaskId.parse(task)
    return [await sess.bulk_stream(t, kind, lane) for lane in range(2)]


def test_a_large_pull_from_one_task_spreads_over_two_streams_and_a_push_keeps_to_one():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.random.default_rng(1).standard_normal((ROWS, 64)).astype(np.float32)
                await sess.variable("w", x)
                out = np.zeros_like(x)
                assert (await sess.pull(["w"], out={"w": out}))["w"] is out and np.array_equal(out, x)
                bulk = servers["ps:0"].service("ps").bulk
                assert bulk.opened == 2
                first, second = await _streams(sess, "ps:0")
                assert first is not second and first.received > 0 and second.received > 0
                assert first.received + second.received == x.nbytes
                assert abs(first.received - second.received) <= 64 * 4  # halves, to a row
                await sess.push({"w": np.ones_like(x)})
                assert bulk.opened == 3  # one push stream
                assert np.array_equal((await sess.pull(["w"]))["w"], x + 1)  # no optimizer: the gradient is added
                assert first.received + second.received == 2 * x.nbytes

    arun(main(), 60)


def test_a_pull_from_as_many_tasks_as_lanes_takes_one_stream_each():
    async def main():
        async with local_cluster({"ps": 2}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.arange(2 * ROWS * 64, dtype=np.float32).reshape(2 * ROWS, 64)
                await sess.variable("w", x, partitioner=zf.fixed_size_partitioner(2))
                assert np.array_equal((await sess.pull(["w"]))["w"], x)
                assert [servers[t].service("ps").bulk.opened for t in ("ps:0", "ps:1")] == [1, 1]

    arun(main(), 60)


def test_one_lane_when_the_caller_asks_for_one(monkeypatch):
    monkeypatch.setenv(LANES_ENV, "1")

    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.ones((ROWS, 64), np.float32)
                await sess.variable("w", x)
                assert np.array_equal((await sess.pull(["w"]))["w"], x)
                assert servers["ps:0"].service("ps").bulk.opened == 1
                assert (await sess.bulk_stream(zf.TaskId.parse("ps:0"))).received == x.nbytes

    arun(main(), 60)


@pytest.mark.parametrize("value", ["0", "5", "two", "-1"])
def test_a_bad_number_of_lanes_is_a_config_error_that_names_it_and_moves_nothing(monkeypatch, value):
    monkeypatch.setenv(LANES_ENV, value)
    with pytest.raises(errors.ConfigError, match=LANES_ENV):
        lanes()

    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                await sess.variable("w", np.ones((ROWS, 64), np.float32))
                with pytest.raises(errors.ConfigError, match=LANES_ENV):
                    await sess.pull(["w"])
                assert servers["ps:0"].service("ps").bulk.opened == 0

    arun(main(), 60)


def test_a_lane_the_task_will_not_give_costs_that_lane_only():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            bulk = servers["ps:0"].service("ps").bulk
            bulk.per_owner = 1  # the second lane is refused at the caller's cap
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.full((ROWS, 64), 3.0, np.float32)
                await sess.variable("w", x)
                for _ in range(2):  # the refusal is remembered: the second pull asks no more
                    assert np.array_equal((await sess.pull(["w"]))["w"], x)
                first, second = await _streams(sess, "ps:0")
                assert first is not None and second is None
                assert first.received == 2 * x.nbytes and bulk.opened == 1

    arun(main(), 60)


def test_spread_cuts_even_transfers_and_deals_them_to_the_lanes_in_turn():
    views = [memoryview(bytearray(n)) for n in (6, 6, 6, 6)]
    pieces = [Piece(rq.PullItem("v", i, None, None), v, "float32") for i, v in enumerate(views)]
    got = list(Lanes(["a", "b"], 12).spread(pieces))
    assert [(s, [p.item.part for p in batch]) for s, batch in got] == [("a", [0, 1]), ("b", [2, 3])]
    got = list(Lanes(["a", "b"], 6).spread(pieces))
    assert [s for s, _ in got] == ["a", "b", "a", "b"]
