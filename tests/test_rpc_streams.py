"""Several connections per peer (``ZMQFLOW_STREAMS``): large requests are dealt over them in turn,
small ones keep to the first, each reply comes back to its call, and a bad setting is refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.variables import SLICE_BYTES
from zmqflow.rpc import RpcClient, RpcServer, Service, op
from zmqflow.rpc.streams import STREAM_MIN_BYTES, STREAMS_ENV, Streams, configured_streams
from zmqflow.testing import free_port, local_cluster, make_spec

pytestmark = pytest.mark.timeout(60)


class _Seen(Service):
    """Answers with the routing identity each call came in on, and the sum of what it carried."""

    name = "seen"

    @op
    def take(self, ctx, x: np.ndarray) -> list:
        return [ctx.peer.decode(), float(x.sum())]


def test_large_calls_take_the_streams_in_turn_and_small_ones_the_first() -> None:
    async def main() -> None:
        server = RpcServer(f"tcp://127.0.0.1:{free_port()}", {"seen": _Seen()}, name="t")
        await server.start()
        client = RpcClient(identity="c", streams=3)
        try:
            big = [np.full(STREAM_MIN_BYTES // 4, i, np.float32) for i in range(6)]
            small = np.ones(16, np.float32)
            replies = await asyncio.gather(*(client.call(server.endpoint, "seen", "take", {"x": b}) for b in big))
            assert [who for who, _ in replies] == ["c", "c~1", "c~2", "c", "c~1", "c~2"]
            assert [total for _, total in replies] == [float(b.sum()) for b in big]  # each reply to its own call
            for _ in range(3):
                who, total = await client.call(server.endpoint, "seen", "take", {"x": small})
                assert who == "c" and total == 16.0
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_one_stream_is_the_default_and_a_bad_setting_names_the_variable() -> None:
    assert configured_streams({}) == 1
    assert configured_streams({STREAMS_ENV: " 4 "}) == 4
    for bad in ("0", "17", "two", "-1"):
        with pytest.raises(errors.ConfigError, match=STREAMS_ENV):
            configured_streams({STREAMS_ENV: bad})
    with pytest.raises(errors.ConfigError, match="streams"):
        Streams(0)
    one = Streams(1)
    assert {one.pick("tcp://h:1", 1 << 30) for _ in range(4)} == {0}
    many = Streams(4)
    assert [many.pick("inproc://x", 1 << 30) for _ in range(3)] == [0, 0, 0]  # inproc: one pipe is enough
    assert [many.pick("tcp://h:1", STREAM_MIN_BYTES - 1) for _ in range(3)] == [0, 0, 0]
    assert [many.pick("tcp://h:1", STREAM_MIN_BYTES) for _ in range(5)] == [0, 1, 2, 3, 0]
    assert many.pick("tcp://h:2", STREAM_MIN_BYTES) == 0  # each peer has its own turn


def test_a_session_with_streams_pulls_and_pushes_a_sliced_model_exactly(monkeypatch) -> None:
    monkeypatch.setenv(STREAMS_ENV, "2")
    monkeypatch.setenv("ZMQFLOW_BULK", "0")  # the pulls' large replies over ZeroMQ's streams, not a bulk stream
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    rows = 3 * SLICE_BYTES // (64 * 4) + 5  # several slices of 4 MiB, dealt over both streams
    want = np.arange(rows * 64, dtype=np.float32).reshape(rows, 64)

    async def main() -> None:
        async with local_cluster(spec, timeout=10):
            async with zf.AsyncSession(cluster=spec, task="ps:0") as sess:
                ps0 = spec.address("ps:0").endpoint
                v = await sess.variable("m", shape=(rows, 64))
                assert sess.client.connections(ps0) == 1  # small calls only so far
                out = np.full((rows, 64), -1, np.float32)
                await sess.pull(["m"], out={"m": out})  # small requests, large replies: dealt by reply size
                assert sess.client.connections(ps0) == 2 and (out == 0).all()
                await v.assign(want)
                for step in range(1, 4):
                    await sess.push({"m": np.ones((rows, 64), np.float32)})
                    out = np.empty((rows, 64), np.float32)
                    assert (await sess.pull(["m"], out={"m": out}))["m"] is out
                    assert (out == want + step).all()

    asyncio.run(main())
