"""Pushes through bulk streams: async gradients applied a chunk at a time as their bytes land on
the shard, with the same result as over ZeroMQ; a transfer and its request in either order; a
stream closed, never left out of step, on anything that goes wrong."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.bulk_pull import BULK_FROM
from zmqflow.client.session import AsyncSession
from zmqflow.server.bulk_receive import PushConn, Sink
from zmqflow.server.services.bulk_ops import PUSH_CHUNK
from zmqflow.testing import async_wait_until, local_cluster
from zmqflow.transport.bulk import HEADER, as_bytes

from .conftest import arun

ROWS = BULK_FROM // (64 * 4) * 3 + 7  # each of two parts past BULK_FROM, chunks that do not divide it


async def _none(task, kind="pull"):
    return None


def test_an_async_push_through_the_streams_matches_zeromqs_with_and_without_an_optimizer():
    async def main():
        async with local_cluster({"ps": 2}, timeout=20, transport="tcp") as servers:
            rng = np.random.default_rng(1)
            x = rng.standard_normal((ROWS, 64)).astype(np.float32)
            grads = [rng.standard_normal((ROWS, 64)).astype(np.float32) for _ in range(3)]
            results = {}
            for way in ("bulk", "zeromq"):
                async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                    if way == "zeromq":
                        sess.bulk_stream = _none
                    await sess.variable(f"plain_{way}", x, partitioner=zf.fixed_size_partitioner(2))
                    await sess.variable(f"sgd_{way}", x, partitioner=zf.fixed_size_partitioner(2),
                                        optimizer=zf.optim.Momentum(0.1, 0.9))
                    for g in grads:
                        assert (await sess.push({f"plain_{way}": g, f"sgd_{way}": g})) is None
                    got = await sess.pull([f"plain_{way}", f"sgd_{way}"])
                    results[way] = (got[f"plain_{way}"], got[f"sgd_{way}"])
                    if way == "bulk":
                        for t in ("ps:0", "ps:1"):
                            stream = await sess.bulk_stream(zf.TaskId.parse(t), "push")
                            assert stream is not None and not stream.closed
            np.testing.assert_array_equal(results["bulk"][0], results["zeromq"][0])
            np.testing.assert_array_equal(results["bulk"][1], results["zeromq"][1])
            np.testing.assert_allclose(results["bulk"][0], x + sum(grads), rtol=1e-5, atol=1e-5)
            pushed = [servers[t].service("ps").pushes_applied["async"] for t in ("ps:0", "ps:1")]
            assert pushed == [12, 12]  # 3 pushes x 2 variables x one part each way, per shard

    arun(main(), 60)


def test_a_synchronous_variable_and_a_refused_push_go_as_before():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["worker:0"].target, timeout=10) as sess:
                task = zf.TaskId.parse("ps:0")
                sync = zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                await sess.variable("s", np.zeros((ROWS, 64), np.float32), optimizer=sync)
                await sess.variable("a", np.zeros((ROWS, 64), np.float32))
                stream = await sess.bulk_stream(task, "push")

                def announce(name, handle=stream.handle):
                    return sess.call_task(task, "ps", "push_bulk", {
                        "items": [[name, 0, None, None]], "dtypes": ["float32"], "sizes": [ROWS * 64 * 4],
                        "stream": handle, "tag": stream.next_tag()})

                with pytest.raises(errors.InvalidArgument, match="is synchronous: its gradients go over ZeroMQ"):
                    await announce("s")
                with pytest.raises(errors.NotFound, match="nope"):
                    await announce("nope")
                with pytest.raises(errors.Unavailable, match=f"is not open for {sess.name!r} to push on"):
                    await announce("a", handle=stream.handle + 99)
                received = servers["ps:0"].service("ps").bulk.push_conn(stream.handle, sess.name).received
                await sess.push({"s": np.ones((ROWS, 64), np.float32)}, step=0)  # the sync part: over ZeroMQ
                assert servers["ps:0"].service("ps").bulk.push_conn(stream.handle, sess.name).received == received
                assert ((await sess.pull(["s"]))["s"] == -1).all()

    arun(main(), 60)


def test_a_fence_before_the_bytes_land_fails_the_push_with_recovering_and_changes_nothing():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                task = zf.TaskId.parse("ps:0")
                await sess.variable("v", np.zeros((ROWS, 64), np.float32))
                stream = await sess.bulk_stream(task, "push")
                conn = servers["ps:0"].service("ps").bulk.push_conn(stream.handle, sess.name)
                tag = stream.next_tag()
                call = asyncio.ensure_future(sess.call_task(task, "ps", "push_bulk", {
                    "items": [["v", 0, None, None]], "dtypes": ["float32"], "sizes": [ROWS * 64 * 4],
                    "stream": stream.handle, "tag": tag}))
                await async_wait_until(lambda: conn.expected == 1, 5, what="the request in, its bytes not")
                epoch = await sess.call_task(task, "ps", "fence")
                grad = np.ones((ROWS, 64), np.float32)
                await stream.send(tag, [as_bytes(grad)], asyncio.get_running_loop().time() + 5)
                with pytest.raises(errors.Recovering, match="began recovery"):
                    await call
                assert conn.expected == 0 and not conn.closed  # the bytes read and dropped: still in step
                assert await sess.call_task(task, "ps", "unfence", {"epoch": epoch})
                assert ((await sess.pull(["v"]))["v"] == 0).all()
                await sess.push({"v": grad})  # the stream, still in step, carries the next push
                assert ((await sess.pull(["v"]))["v"] == 1).all() and conn.received == 2 * grad.nbytes

    arun(main(), 60)


async def _conn(request_wait: float = 5.0) -> tuple[PushConn, socket.socket]:
    mine, peer = socket.socketpair()
    mine.setblocking(False)
    return await PushConn(1, "a", mine, request_wait).open(), peer


def _sink(chunks: list[int], into: bytearray, fail_at: int = -1) -> Sink:
    def consume(i: int, data: memoryview) -> None:
        if i == fail_at:
            raise ValueError("a part that went away")
        into.extend(data)
    return Sink(chunks, consume)


def test_a_transfer_before_its_request_waits_for_it_and_one_after_a_failed_sink_still_lands():
    async def main():
        conn, peer = await _conn()
        try:
            peer.sendall(HEADER.pack(7, 10) + bytes(range(10)))  # before its request
            got = bytearray()
            sink = _sink([4, 0, 6], got)
            await async_wait_until(lambda: conn.paused_for == 7, 5, what="the header read, the stream paused")
            conn.expect(7, sink)
            assert await asyncio.wait_for(sink.done, 5) == 10 and got == bytes(range(10))
            failed, after = bytearray(), bytearray()
            bad, good = _sink([3, 3], failed, fail_at=0), _sink([5], after)
            conn.expect(8, bad)
            conn.expect(9, good)
            peer.sendall(HEADER.pack(8, 6) + b"abcdef" + HEADER.pack(9, 5) + b"ghijk")
            with pytest.raises(ValueError, match="went away"):
                await asyncio.wait_for(bad.done, 5)
            assert await asyncio.wait_for(good.done, 5) == 5 and after == b"ghijk" and failed == b""
            assert not conn.closed and conn.received == 21
        finally:
            peer.close()
            conn.close()

    arun(main(), 30)


@pytest.mark.parametrize("trouble", ["no request", "wrong count", "client gone"])
def test_a_stream_out_of_step_or_gone_is_closed_and_fails_what_waits_on_it(trouble):
    async def main():
        conn, peer = await _conn(request_wait=0.2)
        try:
            sink = _sink([8], bytearray())
            if trouble == "no request":
                peer.sendall(HEADER.pack(5, 8))
                conn.expect(6, sink)
                want, match = errors.ProtocolError, "transfer 5 came, its request did not"
            elif trouble == "wrong count":
                conn.expect(5, sink)
                peer.sendall(HEADER.pack(5, 9))
                want, match = errors.ProtocolError, "is 9 bytes, its request 8"
            else:
                conn.expect(5, sink)
                peer.sendall(HEADER.pack(5, 8) + b"abc")
                peer.close()
                want, match = errors.Unavailable, "closed by its client"
            with pytest.raises(want, match=match):
                await asyncio.wait_for(sink.done, 5)
            assert conn.closed
            await asyncio.wait_for(conn.ended, 5)
            with pytest.raises(errors.Unavailable, match="closed"):
                conn.expect(10, _sink([1], bytearray()))
        finally:
            peer.close()
            conn.close()

    arun(main(), 30)


def test_chunks_are_whole_rows_of_at_most_push_chunk_bytes():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                wide = PUSH_CHUNK // 4 + 16  # one row over a chunk: a chunk of one row
                await sess.variable("w", np.zeros((8, wide), np.float32))
                g = np.arange(8 * wide, dtype=np.float32).reshape(8, wide)
                await sess.push({"w": g})
                assert np.array_equal((await sess.pull(["w"]))["w"], g)
                stream = await sess.bulk_stream(zf.TaskId.parse("ps:0"), "push")
                assert servers["ps:0"].service("ps").bulk.push_conn(stream.handle, sess.name).received == g.nbytes

    arun(main(), 60)


def test_a_push_refused_by_a_fenced_shard_fails_with_its_error_while_its_bytes_wait():
    """The task stops reading a transfer whose request it refused: the session hears the refusal
    (Recovering, which tells it to read again) and closes the stream, instead of sending into a
    full socket until its deadline and calling that Unavailable."""
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=8) as sess:
                task = zf.TaskId.parse("ps:0")
                big = np.zeros(((32 << 20) // (64 * 4), 64), np.float32)  # 32 MiB: more than the sockets hold
                await sess.variable("big", big)
                await sess.push({"big": np.ones_like(big)})
                first = await sess.bulk_stream(task, "push")
                epoch = await sess.call_task(task, "ps", "fence")
                with pytest.raises(errors.Recovering, match="refused"):
                    await sess.push({"big": np.ones_like(big)})
                assert first.closed
                assert await sess.call_task(task, "ps", "unfence", {"epoch": epoch})
                await sess.push({"big": np.ones_like(big)})  # on a new stream
                assert (await sess.bulk_stream(task, "push")) is not first
                assert ((await sess.pull(["big"]))["big"] == 2).all()

    arun(main(), 60)
