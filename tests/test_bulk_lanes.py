"""A large pull from few tasks spread over several pull streams (lanes), each with its own threads:
the bytes land where one stream would have put them, a lane a task will not give costs only that
lane, and the number of lanes is the caller's to set."""

from __future__ import annotations

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.bulk_lanes import LANE_BYTES, LANES_ENV, Lanes, lanes
from zmqflow.client.bulk_pull import Piece
from zmqflow.client.session import AsyncSession
from zmqflow.transport.bulk import BULK_ENV
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
                assert abs(first.received - second.received) <= 2 * 64 * 4  # halves, to a row or two
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


@pytest.mark.parametrize("value", ["0", "5", "two", "-1", "\u00b2", "1.5"])
def test_a_bad_number_of_lanes_stops_the_session_at_its_start_naming_it(monkeypatch, value):
    monkeypatch.setenv(LANES_ENV, value)
    with pytest.raises(errors.ConfigError, match=LANES_ENV):
        lanes()
    with pytest.raises(errors.ConfigError, match=LANES_ENV):
        AsyncSession("tcp://127.0.0.1:1", timeout=1)
    monkeypatch.setenv(BULK_ENV, "0")  # no streams at all: the setting has no effect, and is not read
    assert AsyncSession("tcp://127.0.0.1:1", timeout=1).bulk_lanes == 1


def _count_offers(bulk, monkeypatch, refuse: str | None = None) -> list[str]:
    """Count the listener's offers by kind; refuse those of ``refuse`` as a task at its cap would."""
    asked = []
    real = bulk.offer

    def offer(owner, kind="pull"):
        asked.append(kind)
        if kind == refuse:
            raise errors.ResourceExhausted(f"no {kind} streams here")
        return real(owner, kind)

    monkeypatch.setattr(bulk, "offer", offer)
    return asked


def test_a_lane_the_task_will_not_give_costs_that_lane_only_and_is_not_asked_for_again(monkeypatch):
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            bulk = servers["ps:0"].service("ps").bulk
            bulk.per_owner = 1  # the second lane is refused at the caller's cap
            asked = _count_offers(bulk, monkeypatch)
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.full((ROWS, 64), 3.0, np.float32)
                await sess.variable("w", x)
                for _ in range(3):
                    assert np.array_equal((await sess.pull(["w"]))["w"], x)
                assert asked == ["pull", "pull"]  # lane 0, then lane 1 once: its refusal is remembered
                first, second = await _streams(sess, "ps:0")
                assert first is not None and second is None
                assert first.received == 3 * x.nbytes and bulk.opened == 1

    arun(main(), 60)


def test_a_lane_whose_stream_cannot_be_opened_costs_that_lane_only(monkeypatch):
    from zmqflow.client import bulk_streams

    real = bulk_streams.BulkStreams._hello
    hellos = []

    async def hello(sock, host, token):
        hellos.append(token)
        if len(hellos) == 2:  # the second lane's connection fails, as a full listener's would
            raise ConnectionError("closed by the task")
        return await real(sock, host, token)

    monkeypatch.setattr(bulk_streams.BulkStreams, "_hello", staticmethod(hello))

    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.arange(ROWS * 64, dtype=np.float32).reshape(ROWS, 64)
                await sess.variable("w", x)
                assert np.array_equal((await sess.pull(["w"]))["w"], x)
                first, second = await _streams(sess, "ps:0")
                assert first is not None and first.received == x.nbytes and second is None
                await sess.push({"w": np.ones_like(x)})  # the push stream is not given up with it
                assert await sess.bulk_stream(zf.TaskId.parse("ps:0"), "push") is not None
                assert np.array_equal((await sess.pull(["w"]))["w"], x + 1)

    arun(main(), 60)


def test_a_refused_push_stream_leaves_the_pull_lanes_open(monkeypatch):
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            bulk = servers["ps:0"].service("ps").bulk
            _count_offers(bulk, monkeypatch, refuse="push")
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.zeros((ROWS, 64), np.float32)
                await sess.variable("w", x)
                await sess.push({"w": np.ones_like(x)})  # over ZeroMQ
                assert np.array_equal((await sess.pull(["w"]))["w"], x + 1)
                first, second = await _streams(sess, "ps:0")
                assert first is not None and second is not None
                assert first.received + second.received == x.nbytes

    arun(main(), 60)


def _pieces(lanes: Lanes, parts: list[int], row_bytes: int) -> list[Piece]:
    """Each part of ``parts`` rows cut by ``lanes``, as pieces over buffers of their bytes."""
    out = []
    for part, nrows in enumerate(parts):
        for a, b in lanes.rows(nrows, row_bytes):
            out.append(Piece(rq.PullItem("v", part, a, b), memoryview(bytearray((b - a) * row_bytes)), "float32"))
    return out


@pytest.mark.parametrize("parts,row_bytes,streams", [
    ([ROWS], 256, 2),  # one part, 3 lanes' worth
    ([192 << 12], 256, 2),  # 192 MiB: four transfers of 48, not 64 + 64 + 64
    ([10 << 12] * 3, 256, 2),  # three 10 MiB parts: 15 MiB a stream, not 20 and 10
    ([40 << 12] * 5, 256, 4),  # five 40 MiB parts over four streams
    ([3, 1000, 7, 1 << 16, 5], 1000, 3),  # odd rows, parts of a few rows
])
def test_spread_deals_about_equal_bytes_to_every_stream_in_whole_rows(parts, row_bytes, streams):
    total = sum(parts) * row_bytes
    lanes = Lanes(list(range(streams)), total)
    pieces = _pieces(lanes, parts, row_bytes)
    assert sum(p.view.nbytes for p in pieces) == total
    for part, nrows in enumerate(parts):  # each part's rows, whole and in order
        ranges = [(p.item.start, p.item.stop) for p in pieces if p.item.part == part]
        assert ranges[0][0] == 0 and ranges[-1][1] == nrows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    dealt = lanes.spread(pieces)
    assert [p for _, batch in dealt for p in batch] == pieces
    load = {s: 0 for s in range(streams)}
    for stream, batch in dealt:
        load[stream] += sum(p.view.nbytes for p in batch)
        assert sum(p.view.nbytes for p in batch) <= lanes.limit + row_bytes
    assert len(dealt) % streams == 0 or len(dealt) < streams
    assert max(load.values()) - min(load.values()) <= max(2 * row_bytes, total // 100)


def test_a_share_under_the_batch_goes_as_one_transfer_a_stream():
    lanes = Lanes(["a"], 10 * 6)
    pieces = _pieces(lanes, [6, 4], 6)
    assert [(s, len(b)) for s, b in lanes.spread(pieces)] == [("a", 2)]
