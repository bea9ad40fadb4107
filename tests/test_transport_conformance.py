"""The transport contract, checked on every transport: ZeroMQ tcp, ipc and inproc, in-process
delivery, and the fault injector with no rules. The RPC layer relies on exactly this."""

from __future__ import annotations

import asyncio
import itertools
import os
import time

import numpy as np
import pytest

from zmqflow import errors, wire
from zmqflow.rpc import RpcClient, RpcServer
from zmqflow.testing import async_wait_until, free_port
from zmqflow.transport import DEFAULT_OPTIONS, DOWN, UP, FaultInjector, LocalTransport, SendFailed, ZmqTransport

from .conftest import DiagService, arun

KINDS = ["tcp", "ipc", "inproc", "local", "faults"]
_names = itertools.count()


class Net:
    """One transport under test and fresh endpoints for it."""

    def __init__(self, kind: str, tmp_path):
        self.kind = kind
        self.transport = {"local": LocalTransport, "faults": FaultInjector}.get(kind, ZmqTransport)()
        self._tmp = tmp_path

    def endpoint(self) -> str:
        n = next(_names)
        if self.kind == "tcp":
            return f"tcp://127.0.0.1:{free_port()}"
        if self.kind == "ipc":
            return f"ipc://{self._tmp}/c{n}.sock"
        return f"inproc://conformance-{os.getpid()}-{n}"

    @property
    def sees_drops(self) -> bool:
        return self.kind != "inproc"

    def open_count(self) -> tuple[int, int] | None:
        return self.transport.open_count() if hasattr(self.transport, "open_count") else None


@pytest.fixture(params=KINDS)
def net(request, tmp_path):
    return Net(request.param, tmp_path)


async def _echo(net: Net, endpoint: str, received: list | None = None):
    """A listener that sends every message back to its sender (in order, waiting for room)."""
    holder: dict = {}
    backlog: list = []

    async def drain():
        while backlog:
            assert await holder["l"].send(backlog[0], asyncio.get_running_loop().time() + 10)
            backlog.pop(0)

    def on_frames(frames):
        if received is not None:
            received.append([bytes(memoryview(f)) for f in frames[1:]])
        if backlog or not holder["l"].try_send(frames):
            backlog.append(frames)
            if len(backlog) == 1:
                holder["task"] = asyncio.ensure_future(drain())

    loop = asyncio.get_running_loop()
    holder["l"] = await net.transport.listen(endpoint, on_frames, loop=loop, options=DEFAULT_OPTIONS, name="echo")
    return holder["l"]


def _connect(net: Net, endpoint: str, identity: bytes, inbox: list, states: list | None = None):
    loop = asyncio.get_running_loop()
    return net.transport.connect(endpoint, identity, inbox.append, (states if states is not None else []).append,
                                 loop=loop, options=DEFAULT_OPTIONS, name=endpoint)


def test_multipart_frames_round_trip_small_and_big_zero_copy(net):
    async def main():
        endpoint = net.endpoint()
        listener = await _echo(net, endpoint)
        inbox: list = []
        conn = _connect(net, endpoint, b"client-a", inbox)
        try:
            big = (np.arange(8 << 20, dtype=np.uint8) % 251).reshape(-1)  # 8 MiB: above the copy threshold
            frames = [b"head", b"", memoryview(b"tail bytes"), big]
            assert await conn.send(frames, asyncio.get_running_loop().time() + 5)
            await async_wait_until(lambda: inbox, 5, what="the echo")
            got = inbox[0]
            assert len(got) == 4
            assert [bytes(memoryview(f)) for f in got[:3]] == [b"head", b"", b"tail bytes"]
            np.testing.assert_array_equal(np.frombuffer(memoryview(got[3]), np.uint8), big)
            assert listener.endpoint.startswith(endpoint.split(":")[0])
        finally:
            conn.close()
            listener.close()

    arun(main())


def test_messages_on_one_connection_arrive_in_order(net):
    async def main():
        endpoint = net.endpoint()
        received: list = []
        listener = await _echo(net, endpoint, received)
        inbox: list = []
        conn = _connect(net, endpoint, b"orderly", inbox)
        loop = asyncio.get_running_loop()
        try:
            for i in range(500):
                assert await conn.send([b"%d" % i, np.full(16 if i % 2 else 1 << 17, i % 256, np.uint8)], loop.time() + 5)
            await async_wait_until(lambda: len(inbox) == 500, 10, what="every echo")
            assert [int(bytes(f[0])) for f in inbox] == list(range(500))
            assert [int(f[0]) for f in received] == list(range(500))
        finally:
            conn.close()
            listener.close()

    arun(main())


def test_many_peers_each_get_their_own_replies(net):
    async def main():
        endpoint = net.endpoint()
        listener = await _echo(net, endpoint)
        inboxes = [[] for _ in range(16)]
        conns = [_connect(net, endpoint, b"peer-%d" % i, inboxes[i]) for i in range(16)]
        loop = asyncio.get_running_loop()
        try:
            for i, conn in enumerate(conns):
                for j in range(3):
                    assert await conn.send([b"%d:%d" % (i, j)], loop.time() + 5)
            await async_wait_until(lambda: all(len(b) == 3 for b in inboxes), 10, what="every peer's echoes")
            for i, box in enumerate(inboxes):
                assert [bytes(f[0]) for f in box] == [b"%d:%d" % (i, j) for j in range(3)]
        finally:
            for conn in conns:
                conn.close()
            listener.close()

    arun(main())


def test_a_reply_to_an_identity_that_is_not_connected_raises_send_failed(net):
    async def main():
        listener = await _echo(net, net.endpoint())
        try:
            with pytest.raises(SendFailed):
                listener.try_send([b"nobody", b"hello"])
        finally:
            listener.close()
        with pytest.raises(SendFailed):
            listener.try_send([b"nobody", b"hello"])

    arun(main())


def test_a_peer_that_is_not_there_fails_the_call_within_its_deadline(net):
    async def main():
        client = RpcClient(identity="lonely", transport=net.transport)
        try:
            # inproc queues into a name nobody bound: there an absent peer is only a silent one
            expected = errors.Unavailable if net.sees_drops else errors.DeadlineExceeded
            start = time.monotonic()
            with pytest.raises(expected, match="diag.add on absent") as info:
                await client.call(net.endpoint(), "diag", "add", {"a": 1}, timeout=0.3, name="absent")
            assert 0.25 <= time.monotonic() - start < 3
            assert info.value.details["task"] == "absent"
        finally:
            client.close()

    arun(main())


def test_rpc_round_trip_with_tensors_and_typed_errors(net):
    async def main():
        endpoint = net.endpoint()
        server = RpcServer(endpoint, {"diag": DiagService()}, name="srv", transport=net.transport)
        await server.start()
        client = RpcClient(identity="caller", transport=net.transport)
        try:
            futures = [client.start_call(server.endpoint, "diag", "add", {"a": i, "b": 1}, name="srv") for i in range(200)]
            assert await asyncio.gather(*futures) == [i + 1 for i in range(200)]
            with pytest.raises(errors.NotFound, match="no op 'nope'"):
                await client.call(server.endpoint, "diag", "nope", name="srv")
            assert client.peer_state(server.endpoint) == UP
        finally:
            client.close()
            await server.close()

    arun(main())


def test_a_peer_that_goes_away_and_returns_is_seen_down_then_reachable(net):
    async def main():
        endpoint = net.endpoint()
        diag = DiagService()
        first = RpcServer(endpoint, {"diag": diag}, name="srv", transport=net.transport)
        await first.start()
        client = RpcClient(identity="survivor", transport=net.transport)
        try:
            assert await client.call(endpoint, "diag", "add", {"a": 1}, name="srv") == 1
            if net.sees_drops:  # a call in flight fails at once, naming what dropped
                hanging = client.start_call(endpoint, "diag", "hang", timeout=30, name="srv")
                await async_wait_until(lambda: first.counters.msgs_in >= 2, 5, what="the hanging call to arrive")
                await first.close()
                with pytest.raises(errors.Unavailable, match="connection to srv dropped during diag.hang"):
                    await hanging
            else:  # inproc reports no drop; its state follows the pipe, and a fresh pipe reaches the new server
                await first.close()
            await async_wait_until(lambda: client.peer_state(endpoint) == DOWN, 5, what="the drop seen")
            second = RpcServer(endpoint, {"diag": DiagService()}, name="srv", transport=net.transport)
            await second.start()
            try:
                assert await client.call(endpoint, "diag", "add", {"a": 2}, timeout=5, name="srv") == 2
                assert second.counters.msgs_in >= 1
            finally:
                await second.close()
        finally:
            client.close()

    arun(main())


def test_close_releases_everything(net):
    async def main():
        endpoint = net.endpoint()
        server = RpcServer(endpoint, {"diag": DiagService()}, name="srv", transport=net.transport)
        await server.start()
        client = RpcClient(identity="closer", transport=net.transport)
        assert await client.call(endpoint, "diag", "add", {"a": 1}, name="srv") == 1
        hanging = client.start_call(endpoint, "diag", "hang", timeout=30, name="srv")
        client.close()
        with pytest.raises(errors.Unavailable, match="client closed during diag.hang"):
            await hanging
        await server.close()
        if net.open_count() is not None:
            assert net.open_count() == (0, 0)
        # the address is free again: it can be bound at once (ZeroMQ retries what this process released)
        again = RpcServer(endpoint, {}, name="srv", transport=net.transport)
        await again.start()
        await again.close()
        with pytest.raises(errors.Unavailable, match="is closed"):
            client.start_call(endpoint, "diag", "add", {"a": 1})

    arun(main())


def test_bad_frames_are_answered_or_counted_and_serving_goes_on(net):
    async def main():
        endpoint = net.endpoint()
        server = RpcServer(endpoint, {"diag": DiagService()}, name="srv", transport=net.transport)
        await server.start()
        inbox: list = []
        conn = _connect(net, endpoint, b"rogue", inbox)
        loop = asyncio.get_running_loop()
        try:
            assert await conn.send([b"\xc1 not msgpack"], loop.time() + 5)
            assert await conn.send([b"x" * 100_000, b"y"], loop.time() + 5)
            ok = wire.encode(wire.Message(wire.REQUEST, 5, "diag", "add", {"a": np.zeros(2, "f4")}))
            assert await conn.send([ok[0]], loop.time() + 5)  # a tensor frame short: answered with an error
            await async_wait_until(lambda: inbox, 5, what="the error reply")
            reply = wire.decode(inbox[0])
            assert reply.kind == wire.ERROR and reply.id == 5 and reply.error["code"] == "PROTOCOL"
            await async_wait_until(lambda: server.counters.dropped == 2, 5, what="the unreadable ones counted")
            assert await conn.send(wire.encode(wire.Message(wire.REQUEST, 6, "diag", "add", {"a": 3})), loop.time() + 5)
            await async_wait_until(lambda: len(inbox) == 2, 5, what="the good reply")
            assert wire.decode(inbox[1]).body == 3
        finally:
            conn.close()
            await server.close()

    arun(main())


def test_an_ipc_listener_removes_its_socket_file_on_close_but_not_a_newer_ones(tmp_path):
    """libzmq leaves a closed ipc listener's file behind: a server stopped on ipc would litter its
    directory. The listener removes its own file, and leaves one another socket bound since."""
    async def main():
        loop = asyncio.get_running_loop()
        t = ZmqTransport()
        path = tmp_path / "srv.sock"
        first = await t.listen(f"ipc://{path}", lambda f, user: None, loop=loop, options=DEFAULT_OPTIONS, name="a")
        assert path.exists()
        first.close()
        assert not path.exists()
        old = await t.listen(f"ipc://{path}", lambda f, user: None, loop=loop, options=DEFAULT_OPTIONS, name="b")
        new = await t.listen(f"ipc://{path}", lambda f, user: None, loop=loop, options=DEFAULT_OPTIONS, name="c")
        try:
            old.close()  # its file was replaced by the newer bind: not its to remove
            assert path.exists()
        finally:
            new.close()
        assert not path.exists()

    arun(main())
