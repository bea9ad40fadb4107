"""Bulk pulls and pushes that the task refuses, or that a session's close or a task's restart cuts
short: the caller hears the error a ZeroMQ transfer would give it, its arrays are its own again at
once, and the streams stay usable or are replaced."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.bulk import BulkStream
from zmqflow.client.bulk_pull import BULK_FROM
from zmqflow.client.session import AsyncSession
from zmqflow.testing import async_wait_until, local_cluster
from zmqflow.transport.bulk import HEADER, as_bytes

from .conftest import arun
from .test_bulk import _pair

ROWS = BULK_FROM // (64 * 4) * 3  # 3 MiB of float32: one stream, one transfer
PS0 = zf.TaskId.parse("ps:0")


def test_a_transfer_given_up_lets_go_of_its_arrays_and_its_bytes_are_still_drained():
    async def main():
        mine, task = _pair()
        stream = BulkStream("ps:0", 1, mine)
        try:
            dest = np.zeros(1000, np.uint8)
            gone = weakref.ref(dest)
            t = stream.expect([as_bytes(dest)])
            await stream.abandon(t, sent=True)  # the task may send it yet
            del dest
            gc.collect()
            assert gone() is None  # the caller's array is not held for bytes that may never come
            after = np.zeros(10, np.uint8)
            t2 = stream.expect([as_bytes(after)])
            task.sendall(HEADER.pack(t.tag, 1000) + bytes([7]) * 1000 + HEADER.pack(t2.tag, 10) + bytes([9]) * 10)
            assert await asyncio.wait_for(t2.done, 5) == 10
            assert (after == 9).all() and not stream.closed and not stream._waiting
        finally:
            task.close()
            await stream.close()

    arun(main(), 30)


def test_pulls_refused_by_a_fenced_shard_leave_nothing_registered_and_hold_no_array():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.arange(ROWS * 64, dtype=np.float32).reshape(ROWS, 64)
                v = await sess.variable("v", x)
                await v.read()
                stream = await sess.bulk_stream(PS0)
                epoch = await sess.call_task(PS0, "ps", "fence")
                for _ in range(3):
                    out = np.ones_like(x)
                    gone = weakref.ref(out)
                    with pytest.raises(errors.Recovering, match="refused"):
                        await v.read(out=out)
                    del out  # the error's own traceback lets go of it once the loop has moved on
                    await async_wait_until(lambda: gc.collect() >= 0 and gone() is None, 5, what="the array let go")
                assert not stream._waiting and not stream.closed  # refused before a byte: forgotten
                assert await sess.call_task(PS0, "ps", "unfence", {"epoch": epoch})
                assert np.array_equal(await v.read(), x)
                assert await sess.bulk_stream(PS0) is stream and stream.received == 2 * x.nbytes

    arun(main(), 60)


def test_a_large_read_or_push_on_a_shard_restarted_empty_raises_shard_state_lost():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                big = np.ones((ROWS, 64), np.float32)
                v = await sess.variable("big", big)
                await v.read()
                await sess.push({"big": big})
                old = await sess.bulk_stream(PS0)
                spec = servers["ps:0"].spec
                await servers["ps:0"].stop()
                servers["ps:0"] = await zf.AsyncServer(spec, PS0, checkpoint_roots="*").start()
                await asyncio.wait_for(asyncio.shield(old.stopped), 5)  # the old task's close seen
                with pytest.raises(errors.ShardStateLost, match="ps:0 lost its state"):
                    await v.read()
                stream = await sess.bulk_stream(PS0)
                assert stream is not old and not stream._waiting  # refused: nothing waits for its bytes
                with pytest.raises(errors.ShardStateLost, match="ps:0 lost its state"):
                    await sess.push({"big": big})

    arun(main(), 60)


def _hold_offers(sess: AsyncSession) -> asyncio.Event:
    """Make the session's stream offers wait for the returned event: an open stays in progress."""
    gate = asyncio.Event()
    real = sess._bulk_call

    async def held(task, op, body):
        await gate.wait()
        return await real(task, op, body)

    assert sess._bulk is None  # its streams are made from here on with the held call
    sess._bulk_call = held
    return gate


def test_closing_a_session_while_a_large_read_opens_its_stream_ends_the_read_with_session_closed():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            sess = AsyncSession(servers["ps:0"].target, timeout=10)
            try:
                v = await sess.variable("big", np.zeros((ROWS, 64), np.float32))
                _hold_offers(sess)
                cancelled, reader = asyncio.ensure_future(v.read()), asyncio.ensure_future(v.read())
                await async_wait_until(lambda: sess._bulk is not None and sess._bulk._opening, 5,
                                       what="the stream opening")
                cancelled.cancel()  # a caller that is cancelled is: the open goes on for the other
                with pytest.raises(asyncio.CancelledError):
                    await cancelled
                assert sess._bulk._opening
                await sess.close()
                with pytest.raises(errors.SessionClosed, match="is closed"):
                    await asyncio.wait_for(reader, 5)
                assert not reader.cancelled()
            finally:
                await sess.close()

    arun(main(), 60)


def test_a_pull_on_a_stream_the_task_no_longer_holds_is_unavailable_and_the_next_opens_a_new_one():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.arange(ROWS * 64, dtype=np.float32).reshape(ROWS, 64)
                await sess.variable("v", x)
                await sess.pull(["v"])
                stream = await sess.bulk_stream(PS0)
                # the task forgets the stream, and its end stays open: this end has not seen a close,
                # as when a retry races the task's close of a stream past a transfer's deadline
                forgotten = servers["ps:0"].service("ps").bulk._conns.pop(stream.handle)
                try:
                    with pytest.raises(errors.Unavailable, match=f"bulk stream {stream.handle} is not open"):
                        await sess.pull(["v"])
                    assert stream.closed and not stream._waiting
                    assert np.array_equal((await sess.pull(["v"]))["v"], x)
                    assert await sess.bulk_stream(PS0) is not stream
                finally:
                    forgotten.close()

    arun(main(), 60)


def test_a_push_on_a_stream_the_task_no_longer_holds_is_unavailable_and_the_next_opens_a_new_one():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.zeros((ROWS, 64), np.float32)
                g = np.ones_like(x)
                await sess.variable("v", x)
                await sess.push({"v": g})
                stream = await sess.bulk_stream(PS0, "push")
                forgotten = servers["ps:0"].service("ps").bulk._conns.pop(stream.handle)
                try:
                    with pytest.raises(errors.Unavailable, match=f"bulk stream {stream.handle} is not open"):
                        await sess.push({"v": g})
                    assert stream.closed
                    await sess.push({"v": g})
                    assert await sess.bulk_stream(PS0, "push") is not stream
                    assert ((await sess.pull(["v"]))["v"] == 2).all()  # the refused push changed nothing
                finally:
                    forgotten.close()

    arun(main(), 60)
