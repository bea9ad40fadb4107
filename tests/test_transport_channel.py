"""The ZeroMQ channel's receive and send paths on real sockets: bursts drained whole and in order,
replies sent outside a receive still waking the peer (the FD's edge), frame types, and received
frames sent on as themselves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import zmq

from zmqflow.testing import TRANSPORTS, async_wait_until, free_port
from zmqflow.transport.base import UP
from zmqflow.transport import sockops
from zmqflow.transport.channel import received_frame
from zmqflow.transport.context import context
from zmqflow.transport.options import DEFAULT_OPTIONS
from zmqflow.transport.zeromq import ZmqTransport

from .conftest import arun


# what a channel gives for a data frame: zmq.Frame from pyzmq's receive, sockops.MSG from the C calls
_FRAMES = (zmq.Frame,) if sockops.MSG is None else (zmq.Frame, sockops.MSG)


@pytest.fixture(autouse=True, params=["c-calls", "pyzmq-calls"])
def socket_calls(request):
    """Every channel test runs on both receive and send paths: libzmq called from C (sockops) and
    pyzmq's calls (where the C calls were not built, the first run says so and skips)."""
    if request.param == "c-calls" and not sockops.compiled():
        pytest.skip(f"the C socket calls are not available here: {sockops.why_not()}")
    before = sockops.use_compiled(request.param == "c-calls")
    yield request.param
    sockops.use_compiled(before)


def _endpoint(transport: str, tmp: str) -> str:
    if transport == "inproc":
        return f"inproc://chan-{uuid.uuid4().hex[:8]}"
    if transport == "ipc":
        return f"ipc://{tmp}/chan.sock"
    return f"tcp://127.0.0.1:{free_port()}"


@contextlib.asynccontextmanager
async def _pair(transport: str, on_request: Any, on_reply: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A listener answering with ``on_request(listener, frames)`` and an up connection to it."""
    loop = asyncio.get_running_loop()
    holder: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="zf-chan-") as tmp:
        listener = await ZmqTransport().listen(
            _endpoint(transport, tmp), lambda frames: on_request(holder[0], frames), loop=loop,
            options=DEFAULT_OPTIONS, name="chan-test")
        holder.append(listener)
        conn = ZmqTransport().connect(listener.endpoint, b"client-1", on_reply, lambda _s: None, loop=loop,
                                      options=DEFAULT_OPTIONS, name="chan-test")
        try:
            await async_wait_until(lambda: conn.state == UP, 10, what="connection up")
            yield listener, conn
        finally:
            conn.close()
            listener.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pipelined_burst_is_received_whole_and_in_order(transport):
    """More messages than one drain takes (256) queue up at once; each arrives once, in order,
    as [identity, header bytes, Frame], and each reply reaches the client, in order. A reply goes
    inline unless the client's pipe is full (the client may not have read yet: the pipes hold a
    few dozen messages): then, as a real server does, it waits for room behind the others."""
    n = 1500
    seen: list[int] = []
    replies: list[int] = []
    backlog: list[list[Any]] = []
    flushing: list[asyncio.Task] = []  # held: the loop keeps only weak references to tasks

    async def flush(listener):
        loop = asyncio.get_running_loop()
        while backlog:
            assert await listener.send(backlog[0], loop.time() + 10)
            backlog.pop(0)

    def on_request(listener, frames):
        assert frames[0] == b"client-1" and isinstance(frames[1], bytes) and isinstance(frames[2], _FRAMES)
        seen.append(int.from_bytes(frames[1], "little"))
        reply = [frames[0], frames[1]]
        if backlog or not listener.try_send(reply):
            backlog.append(reply)
            if len(backlog) == 1:
                flushing.append(asyncio.get_running_loop().create_task(flush(listener)))

    def on_reply(frames):
        assert len(frames) == 1 and isinstance(frames[0], bytes)
        replies.append(int.from_bytes(frames[0], "little"))

    async def main():
        async with _pair(transport, on_request, on_reply) as (_listener, conn):
            loop = asyncio.get_running_loop()
            body = np.arange(16, dtype=np.float32)
            for i in range(n):  # no await in between: the server finds them all queued
                assert await conn.send([i.to_bytes(4, "little"), body], loop.time() + 10)
            await async_wait_until(lambda: len(replies) == n, 30, what="all replies")
        assert seen == list(range(n)) and replies == list(range(n))

    arun(main())


class _EchoThread:
    """A plain ROUTER on its own thread echoing every message but ``noise``: it answers while the
    client's loop is busy elsewhere, which a listener on that same loop cannot."""

    def __init__(self, endpoint: str, then: tuple[int, float] = (0, 0.0)):
        self.then = then  # (copies, seconds): more copies of each echo, each after a pause
        self.sock = context().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                if self.sock.poll(20):
                    frames = self.sock.recv_multipart()
                    if frames[1] != b"noise":
                        self.sock.send_multipart(frames)
                        for copy in range(self.then[0]):
                            time.sleep(self.then[1])
                            self.sock.send_multipart([frames[0], frames[1] + b"+%d" % copy])
        finally:
            self.sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("then", [(1, 0.003), (3, 0.0)], ids=["one-later", "burst"])
def test_messages_after_a_drain_ran_dry_still_arrive(transport, then):
    """A drain takes one message, then looks at ``EVENTS`` instead of receiving until ``Again``:
    that look must leave the FD's edge armed for the next message, whether it comes a moment
    later (the drain found nothing more) or with a burst (the drain goes on to ``Again``)."""
    copies, _ = then
    rounds = 20
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def main():
        loop = asyncio.get_running_loop()
        with tempfile.TemporaryDirectory(prefix="zf-chan-") as tmp:
            server = _EchoThread(_endpoint(transport, tmp), then)
            conn = ZmqTransport().connect(server.endpoint, b"client-1", lambda frames: got.put_nowait(frames[0]),
                                          lambda _s: None, loop=loop, options=DEFAULT_OPTIONS, name="echo")
            try:
                await async_wait_until(lambda: conn.state == UP, 10, what="connection up")
                for i in range(rounds):
                    assert conn.try_send([str(i).encode()])
                    want = [str(i).encode()] + [b"%d+%d" % (i, c) for c in range(copies)]
                    assert [await asyncio.wait_for(got.get(), 5) for _ in want] == want
            finally:
                conn.close()
                server.stop()

    arun(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_send_that_swallows_the_fd_edge_does_not_lose_the_reply(transport):
    """A send processes libzmq's pending commands (at most once a millisecond), and with them the
    "input arrived" signal the loop waits on: here each reply has arrived by the time the client
    sends again, outside any receive. The deferred look after sends finds it; without it the
    round would stall until the timeout."""
    rounds = 30
    got: asyncio.Queue[int] = asyncio.Queue()

    async def main():
        loop = asyncio.get_running_loop()
        with tempfile.TemporaryDirectory(prefix="zf-chan-") as tmp:
            server = _EchoThread(_endpoint(transport, tmp))
            conn = ZmqTransport().connect(server.endpoint, b"client-1", lambda frames: got.put_nowait(int(frames[0])),
                                          lambda _s: None, loop=loop, options=DEFAULT_OPTIONS, name="echo")
            try:
                await async_wait_until(lambda: conn.state == UP, 10, what="connection up")
                for i in range(rounds):
                    await asyncio.sleep(0.002)  # the loop settles: no look at the socket is left pending
                    assert conn.try_send([str(i).encode()])
                    time.sleep(0.005)  # (blocking on purpose) the reply lands while the loop is not looking
                    assert conn.try_send([b"noise"])
                    assert await asyncio.wait_for(got.get(), 5) == i
            finally:
                conn.close()
                server.stop()

    arun(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_message_of_very_many_parts_is_cut_at_max_parts_and_the_next_arrives_whole(transport):
    """The parts past the channel's cap are read and dropped (on both receive paths); what comes
    in after is untouched."""
    got: asyncio.Queue[list[Any]] = asyncio.Queue()

    async def main():
        async with _pair(transport, lambda _l, frames: got.put_nowait(frames), lambda _f: None) as (_listener, conn):
            assert conn.try_send([b"many", *([b""] * 10_000), b"last"])
            assert conn.try_send([b"next", b"x"])
            first = await asyncio.wait_for(got.get(), 10)
            assert len(first) == DEFAULT_OPTIONS.max_msg_parts and first[:2] == [b"client-1", b"many"]
            second = await asyncio.wait_for(got.get(), 10)
            assert second[:2] == [b"client-1", b"next"] and bytes(second[2]) == b"x"

    arun(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_echoed_tensor_goes_back_as_the_frame_it_came_in_as(transport):
    """A 1 MiB tensor echoed as a view of its received frame comes back intact; over inproc the
    reply shares the very memory the client sent (no copy anywhere on the path)."""
    arr = np.arange(1 << 18, dtype=np.float32)
    got: list[Any] = []

    def on_request(listener, frames):
        view = np.frombuffer(memoryview(frames[2]), dtype=np.float32).reshape(512, -1)
        assert received_frame(view) is frames[2]
        assert listener.try_send([frames[0], frames[1], view])

    async def main():
        async with _pair(transport, on_request, got.append) as (_l, conn):
            assert conn.try_send([b"echo", arr])
            await async_wait_until(lambda: got, 10, what="the echo")
        header, frame = got[0]
        assert header == b"echo" and isinstance(frame, _FRAMES)
        back = np.frombuffer(frame, dtype=np.float32)
        assert np.array_equal(back, arr)
        if transport == "inproc":
            assert back.ctypes.data == arr.ctypes.data

    arun(main())


def test_received_frame_accepts_only_whole_c_ordered_views_of_a_frame():
    a, b = context().socket(zmq.PAIR), context().socket(zmq.PAIR)
    name = f"inproc://rf-{uuid.uuid4().hex[:8]}"
    try:
        a.bind(name)
        b.connect(name)
        a.send(np.arange(64, dtype=np.float32), copy=False)
        frame = b.recv(copy=False)
    finally:
        a.close(0)
        b.close(0)
    whole = np.frombuffer(memoryview(frame), dtype=np.float32)
    assert received_frame(whole) is frame
    assert received_frame(memoryview(frame)) is frame
    assert received_frame(whole.reshape(8, 8)) is frame
    assert received_frame(whole.view(np.uint8)) is frame
    assert received_frame(whole[1:]) is None  # a part of it: the frame would send more
    assert received_frame(whole.reshape(8, 8).T) is None  # another byte order than the frame's
    assert received_frame(whole[::-1]) is None
    assert received_frame(np.arange(64, dtype=np.float32)) is None  # not from a frame at all
    assert received_frame(memoryview(b"x" * 256)) is None


def test_io_threads_come_from_the_environment_and_a_bad_value_is_named():
    from zmqflow.errors import ConfigError
    from zmqflow.transport.context import io_threads

    assert io_threads({}) == 1 and io_threads({"ZMQFLOW_IO_THREADS": " 4 "}) == 4
    for bad in ("0", "-1", "two", "65", "1.5"):
        with pytest.raises(ConfigError, match=f"ZMQFLOW_IO_THREADS must be an integer from 1 to 64, got '{bad}'"):
            io_threads({"ZMQFLOW_IO_THREADS": bad})
    script = ("import zmq\nfrom zmqflow.transport.context import context\n"
              "print(context().get(zmq.IO_THREADS))")
    env = {**os.environ, "ZMQFLOW_IO_THREADS": "3"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
