"""What a bulk request may make a shard hold while it waits: a pull queued behind a stalled
transfer holds its items, not views of the parts (so writes meanwhile go in place, and it sends
the rows as they are at its turn); pulls and pushes waiting on one stream are capped; a push's
chunk plan, kept compact, still applies every item to its rows."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.session import AsyncSession
from zmqflow.server import bulk_receive, bulk_send
from zmqflow.server.services.bulk_ops import PUSH_CHUNK
from zmqflow.testing import async_wait_until, local_cluster
from zmqflow.transport.bulk import HEADER, HELLO, MAGIC, OPENED, as_bytes, recv_exact

from .conftest import arun
from .test_bulk_push import _conn, _sink

PS0 = zf.TaskId.parse("ps:0")
BIG_ROWS = (32 << 20) // (64 * 4)  # 32 MiB of float32: more than the sockets between the ends hold


async def _raw_pull_stream(sess: AsyncSession) -> tuple[int, socket.socket]:
    """A pull stream of the session's that nothing reads until the test does."""
    offer = await sess.call_task(PS0, "ps", "bulk_offer", {"kind": "pull"})
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", offer["port"]))
        await loop.sock_sendall(sock, HELLO.pack(MAGIC, offer["token"]))
        assert await asyncio.wait_for(recv_exact(sock, 1), 5) == OPENED
    except BaseException:
        sock.close()
        raise
    return offer["handle"], sock


def _pull(sess: AsyncSession, handle: int, tag: int, items: list[list], nbytes: list[int]) -> asyncio.Future:
    return asyncio.ensure_future(sess.call_task(PS0, "ps", "pull_bulk", {
        "items": items, "dtypes": ["float32"] * len(items), "sizes": nbytes, "stream": handle, "tag": tag}))


async def _transfer(sock: socket.socket) -> tuple[int, bytes]:
    tag, n = HEADER.unpack(await recv_exact(sock, HEADER.size))
    return tag, await recv_exact(sock, n)


def test_a_queued_pull_holds_no_view_sends_the_rows_of_its_turn_and_the_queue_is_capped(monkeypatch):
    monkeypatch.setattr(bulk_send, "QUEUED_ITEMS", 1500, raising=False)
    monkeypatch.setattr(bulk_send, "MAX_QUEUED", 3, raising=False)

    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=20) as sess:
                big = np.arange(BIG_ROWS * 64, dtype=np.float32).reshape(BIG_ROWS, 64)
                await sess.variable("big", big)
                await sess.variable("v", np.zeros((1000, 4), np.float32))
                handle, sock = await _raw_pull_stream(sess)
                calls: list[asyncio.Future] = []
                try:
                    svc = servers["ps:0"].service("ps")
                    conn = svc.bulk.conn(handle, sess.name)
                    calls.append(_pull(sess, handle, 1, [["big", 0, None, None]], [big.nbytes]))
                    await async_wait_until(lambda: conn.queued == 1 and conn.lock.locked(), 5, what="a stalled send")
                    rows = [["v", 0, i, i + 1] for i in range(1000)]
                    calls.append(_pull(sess, handle, 2, rows, [16] * 1000))
                    await async_wait_until(lambda: conn.queued == 2, 5, what="the second pull queued")
                    part = svc.store.get("v", 0)
                    before = id(part.value)  # not a reference: one would make the write copy the part
                    await sess.push({"v": np.ones((1000, 4), np.float32)})  # small: over ZeroMQ
                    assert id(part.value) == before  # nothing of the queued pull pins it: the write went in place
                    with pytest.raises(errors.ResourceExhausted, match="2 transfers of 1001 items wait"):
                        await _pull(sess, handle, 3, rows, [16] * 1000)
                    calls.append(_pull(sess, handle, 4, [["v", 0, 7, 9]], [32]))
                    await async_wait_until(lambda: conn.queued == 3, 5, what="the third pull queued")
                    with pytest.raises(errors.ResourceExhausted, match="the cap is 3 transfers"):
                        await _pull(sess, handle, 5, [["v", 0, 0, 1]], [16])
                    got = dict([await asyncio.wait_for(_transfer(sock), 10) for _ in range(3)])
                    assert sorted(got) == [1, 2, 4] and got[1] == big.tobytes()
                    assert got[2] == np.ones((1000, 4), np.float32).tobytes()  # as they were at its turn
                    assert got[4] == np.ones((2, 4), np.float32).tobytes()
                    assert await asyncio.gather(*calls) == [big.nbytes, 16000, 32]
                    assert conn.queued == 0 and conn.queued_items == 0 and not conn.closed
                finally:
                    for c in calls:
                        c.cancel()
                    await asyncio.gather(*calls, return_exceptions=True)
                    sock.close()

    arun(main(), 60)


def test_a_push_stream_caps_the_chunks_its_requests_wait_with_beyond_the_first(monkeypatch):
    monkeypatch.setattr(bulk_receive, "EXPECTED_CHUNKS", 15, raising=False)

    async def main():
        conn, peer = await _conn()
        try:
            first, second, alone = bytearray(), bytearray(), bytearray()
            a, b = _sink([1] * 10, first), _sink([1] * 10, second)
            conn.expect(1, a)
            with pytest.raises(errors.ResourceExhausted, match="1 transfers of 10 chunks expected, this one's 10"):
                conn.expect(2, b)
            assert conn.expected == 1  # the refused one changed nothing
            peer.sendall(HEADER.pack(1, 10) + bytes(range(10)))
            assert await asyncio.wait_for(a.done, 5) == 10 and first == bytes(range(10))
            conn.expect(2, b)  # room again
            peer.sendall(HEADER.pack(2, 10) + bytes(10))
            assert await asyncio.wait_for(b.done, 5) == 10
            big = _sink([1] * 20, alone)  # a transfer alone may have more than the cap
            conn.expect(3, big)
            peer.sendall(HEADER.pack(3, 20) + bytes(20))
            assert await asyncio.wait_for(big.done, 5) == 20 and not conn.closed
        finally:
            peer.close()
            conn.close()

    arun(main(), 30)


def test_a_push_of_many_items_applies_each_to_its_rows_chunk_by_chunk():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                wide = PUSH_CHUNK // 4 + 16  # a row over a chunk: a chunk a row
                narrow = (3 * PUSH_CHUNK) // (8 * 4) + 5  # rows of 8 floats: chunks that do not divide them
                await sess.variable("w", np.zeros((6, wide), np.float32))
                await sess.variable("n", np.zeros((narrow, 8), np.float32))
                stream = await sess.bulk_stream(PS0, "push")
                rng = np.random.default_rng(1)
                pieces = [("w", 0, 3), ("n", 5, 5), ("n", 2, narrow), ("w", 3, 6), ("n", 0, 2)]
                grads = [rng.standard_normal((b - a, wide if name == "w" else 8)).astype(np.float32)
                         for name, a, b in pieces]
                tag = stream.next_tag()
                call = sess.call_task(PS0, "ps", "push_bulk", {
                    "items": [[name, 0, a, b] for name, a, b in pieces], "dtypes": ["float32"] * len(pieces),
                    "sizes": [g.nbytes for g in grads], "stream": stream.handle, "tag": tag})
                send = stream.send(tag, [as_bytes(g) for g in grads], asyncio.get_running_loop().time() + 10)
                await asyncio.gather(call, send)
                got = await sess.pull(["w", "n"])
                assert np.array_equal(got["w"], np.concatenate([grads[0], grads[3]]))
                assert np.array_equal(got["n"], np.concatenate([grads[4], grads[2]]))

    arun(main(), 60)
