"""Bulk streams: large pulls landing in their arrays over a plain TCP stream beside the router,
opened only with a token the task issued, closed on anything out of step, never waited on forever."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.bulk import BulkStream
from zmqflow.client.bulk_pull import BULK_FROM
from zmqflow.client.session import AsyncSession
from zmqflow.server.bulk_listener import BulkListener, bulk_host
from zmqflow.testing import FaultInjector, async_wait_until, local_cluster
from zmqflow.transport import registry
from zmqflow.transport.bulk import HEADER, HELLO, MAGIC, OPENED, as_bytes

from .conftest import arun

ROWS = BULK_FROM // (64 * 4) * 3  # each of two parts well past BULK_FROM


@contextlib.asynccontextmanager
async def _listener(**limits: float) -> AsyncIterator[BulkListener]:
    """A started listener on loopback with ``limits``, closed on the way out."""
    lis = await BulkListener("127.0.0.1", **limits).start()
    try:
        yield lis
    finally:
        await lis.close()


async def _hello(port: int, token: bytes) -> bytes:
    """Connect as a client would, present ``token``, and return what the task answers (b"" = closed)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, HELLO.pack(MAGIC, token))
        return await asyncio.wait_for(loop.sock_recv(sock, 1), 5)
    finally:
        sock.close()


def test_a_large_pull_lands_through_the_streams_into_out_and_new_arrays_equal_to_zeromqs():
    async def main():
        async with local_cluster({"ps": 2}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.random.default_rng(0).standard_normal((ROWS, 64)).astype(np.float32)
                await sess.variable("big", x, partitioner=zf.fixed_size_partitioner(2))
                await sess.variable("small", np.arange(10, dtype=np.float32))  # rides with its task's big share
                out = {"big": np.zeros_like(x), "small": np.zeros(10, np.float32)}
                got = await sess.pull(["big", "small"], out=out)
                assert got["big"] is out["big"] and np.array_equal(out["big"], x)
                assert np.array_equal(out["small"], np.arange(10, dtype=np.float32))
                fresh = await sess.pull(["big"])
                assert np.array_equal(fresh["big"], x) and fresh["big"].flags.writeable
                streams = [await sess.bulk_stream(zf.TaskId.parse(t)) for t in ("ps:0", "ps:1")]
                assert all(s is not None for s in streams)
                assert sum(s.received for s in streams) == 2 * x.nbytes + 40  # both pulls of big, small once
                assert [servers[t].service("ps").bulk.opened for t in ("ps:0", "ps:1")] == [1, 1]
                assert (await sess.pull(["small"]))["small"][3] == 3  # alone, under BULK_FROM: over ZeroMQ
                assert sum(s.received for s in streams) == 2 * x.nbytes + 40
            async with AsyncSession(servers["ps:0"].target, timeout=10) as zs:  # the same pull over ZeroMQ alone
                zs.bulk_stream = _none
                assert np.array_equal((await zs.pull(["big"]))["big"], x)

    arun(main(), 60)


async def _none(task, kind="pull", lane=0):
    return None


def test_a_bfloat16_variable_comes_whole_through_its_stream():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (bfloat16) is not installed")

    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.linspace(-4, 4, BULK_FROM).astype(ml_dtypes.bfloat16)
                await sess.variable("b", x)
                got = (await sess.pull(["b"]))["b"]
                assert got.dtype == x.dtype and np.array_equal(got.view(np.uint16), x.view(np.uint16))
                assert (await sess.bulk_stream(zf.TaskId.parse("ps:0"))).received == x.nbytes

    arun(main(), 60)


def test_a_stream_opens_only_with_a_fresh_token_once_and_names_only_its_owner():
    async def main():
        async with _listener(hello_timeout=0.5) as lis:
            handle, token = lis.offer("worker:0")
            assert await _hello(lis.port, bytes(16)) == b""  # a token never issued: closed
            assert await _hello(lis.port, token) == OPENED
            assert await _hello(lis.port, token) == b""  # used once already
            assert lis.opened == 1 and lis.refused == 2
            with pytest.raises(errors.Unavailable, match=f"bulk stream {handle} is not open for 'ps:1'") as info:
                lis.conn(handle, "ps:1")
            assert info.value.details == {"bulk_stream": handle}  # named: its client closes its end
            assert lis.conn(handle, "worker:0").handle == handle
            loop = asyncio.get_running_loop()
            silent = socket.create_connection(("127.0.0.1", lis.port))  # says nothing: cut after hello_timeout
            silent.setblocking(False)
            try:
                assert await asyncio.wait_for(loop.sock_recv(silent, 1), 5) == b""
            finally:
                silent.close()
            assert lis.refused == 3

    arun(main(), 30)


def test_pending_tokens_are_capped_and_expire():
    async def main():
        async with _listener(max_pending=2, token_ttl=0.2) as lis:
            lis.offer("a")
            _, token = lis.offer("a")
            with pytest.raises(errors.ResourceExhausted, match="at the cap of 256 open and 2 pending"):
                lis.offer("a")
            await asyncio.sleep(0.3)  # the token's own lifetime, not a wait for something to happen
            assert await _hello(lis.port, token) == b""  # expired
            lis.offer("a")  # the expired ones were dropped

    arun(main(), 30)


def test_a_closed_stream_frees_its_slot_at_the_next_offer():
    async def main():
        async with _listener(max_streams=1) as lis:
            handle, token = lis.offer("a")
            assert await _hello(lis.port, token) == OPENED  # and closed again at once by the helper
            await async_wait_until(lambda: lis.conn(handle, "a").gone(), 5, what="the peer's close seen")
            lis.offer("a")  # the slot came back

    arun(main(), 30)


def test_a_stream_its_client_closed_is_swept_without_waiting_for_an_offer():
    async def main():
        async with _listener(sweep_every=0.05) as lis:
            _, token = lis.offer("a")
            assert await _hello(lis.port, token) == OPENED  # and closed again at once by the helper
            await async_wait_until(lambda: lis.held == 0, 5, what="the closed stream swept")

    arun(main(), 30)


def test_a_bad_pull_is_refused_before_a_byte_and_the_stream_stays_usable():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.ones((ROWS, 64), np.float32)
                await sess.variable("v", x)
                task = zf.TaskId.parse("ps:0")
                stream = await sess.bulk_stream(task)

                def ask(name, dtype="float32", size=x.nbytes, handle=stream.handle, items=None):
                    return sess.call_task(task, "ps", "pull_bulk", {
                        "items": items or [[name, 0, None, None]], "dtypes": [dtype], "sizes": [size],
                        "stream": handle, "tag": 99})

                with pytest.raises(errors.NotFound, match="nope"):
                    await ask("nope")
                with pytest.raises(errors.Unavailable, match=f"bulk stream {stream.handle + 1} is not open"):
                    await ask("v", handle=stream.handle + 1)
                # what raw bytes cannot say: a part whose dtype or size differs from the caller's idea of it
                with pytest.raises(errors.InvalidArgument, match=r"v rows \[0, \d+\) are \d+ bytes of float32 here, "
                                                                 r"the caller expects \d+ bytes of int32"):
                    await ask("v", dtype="int32")
                with pytest.raises(errors.InvalidArgument, match=f"the caller expects {x.nbytes - 4} bytes"):
                    await ask("v", size=x.nbytes - 4)
                with pytest.raises(errors.InvalidArgument, match="2 items, 1 dtypes and 1 sizes"):
                    await ask("v", items=[["v", 0, None, None]] * 2)
                with pytest.raises(errors.InvalidArgument, match="over the 1073741824 a transfer may carry"):
                    await ask("v", size=(1 << 30) + 1)
                assert np.array_equal((await sess.pull(["v"]))["v"], x)
                assert await sess.bulk_stream(task) is stream and stream.received == x.nbytes

    arun(main(), 60)


def test_a_stopped_task_fails_the_next_pull_instead_of_hanging():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            async with AsyncSession(servers["ps:0"].target, timeout=2) as sess:
                await sess.variable("v", np.ones((ROWS, 64), np.float32))
                await sess.pull(["v"])
                stream = await sess.bulk_stream(zf.TaskId.parse("ps:0"))
                await servers["ps:0"].stop()
                await asyncio.wait_for(asyncio.shield(stream.stopped), 5)  # the task's close ended the reader
                assert stream.closed
                with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
                    await sess.pull(["v"])

    arun(main(), 60)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.setblocking(True)
    return a, b


def test_the_reader_lands_transfers_by_tag_and_drops_the_bytes_of_one_given_up_before_it_began():
    async def main():
        mine, task = _pair()
        stream = BulkStream("ps:0", 1, mine)
        try:
            a, b = np.zeros(1000, np.uint8), np.zeros(500, np.uint8)
            ta, tb = stream.expect([as_bytes(a)]), stream.expect([as_bytes(b)])
            await stream.abandon(ta, sent=True)  # not begun: its bytes will be read and dropped
            task.sendall(HEADER.pack(ta.tag, 1000) + bytes([7]) * 1000 + HEADER.pack(tb.tag, 500) + bytes([9]) * 500)
            assert await asyncio.wait_for(tb.done, 5) == 500
            assert (a == 0).all() and (b == 9).all() and not stream.closed
        finally:
            task.close()
            await stream.close()

    arun(main(), 30)


@pytest.mark.parametrize("header", ["unknown tag", "wrong count"])
def test_a_header_out_of_step_closes_the_stream_and_fails_its_waiters(header):
    async def main():
        mine, task = _pair()
        stream = BulkStream("ps:0", 1, mine)
        try:
            dest = np.zeros(100, np.uint8)
            t = stream.expect([as_bytes(dest)])
            task.sendall(HEADER.pack(t.tag + 1, 100) if header == "unknown tag" else HEADER.pack(t.tag, 101))
            match = "unknown transfer" if header == "unknown tag" else "101 bytes where 100"
            with pytest.raises(errors.ProtocolError, match=match):
                await asyncio.wait_for(t.done, 5)
            assert stream.closed and (dest == 0).all()
            with pytest.raises(errors.Unavailable, match="closed"):
                stream.expect([as_bytes(dest)])
        finally:
            task.close()
            await stream.close()

    arun(main(), 30)


def test_giving_up_mid_transfer_closes_the_stream_before_returning_and_nothing_lands_after():
    async def main():
        mine, task = _pair()
        stream = BulkStream("ps:0", 1, mine)
        try:
            dest = np.zeros(1 << 16, np.uint8)
            t = stream.expect([as_bytes(dest)])
            task.sendall(HEADER.pack(t.tag, dest.nbytes) + bytes([5]) * 100)  # begun, then the task stalls
            await async_wait_until(lambda: t.started, 5, what="the transfer begun")
            await stream.abandon(t, sent=True)
            assert stream.closed and stream.stopped.done()
            before = dest.copy()
            try:
                task.sendall(bytes([6]) * 1000)
            except OSError:
                pass  # the stream is shut: the bytes go nowhere
            assert np.array_equal(dest, before) and not (dest == 6).any()
        finally:
            task.close()
            await stream.close()

    arun(main(), 30)


def test_where_a_task_offers_streams(monkeypatch):
    assert bulk_host("tcp://127.0.0.1:5000", None, True) == "127.0.0.1"
    assert bulk_host("tcp://*:5000", None, True) == "0.0.0.0"  # insecure, by the operator's word
    assert bulk_host("tcp://127.0.0.1:5000", object(), True) == "127.0.0.1"  # keys, loopback: no wire to read
    assert bulk_host("tcp://10.1.2.3:5000", object(), True) is None  # keys beyond loopback: never in the clear
    assert bulk_host("ipc:///tmp/x", None, True) is None and bulk_host("inproc://x", None, True) is None
    assert bulk_host("tcp://127.0.0.1:5000", None, False) is None  # another transport: its faults stay in force
    monkeypatch.setenv("ZMQFLOW_BULK", "0")
    assert bulk_host("tcp://127.0.0.1:5000", None, True) is None


def test_a_session_on_a_fault_injector_uses_no_stream():
    assert registry.plain_zeromq("tcp://127.0.0.1:5000")
    with registry.use(FaultInjector()):
        assert not registry.plain_zeromq("tcp://127.0.0.1:5000")
    assert not registry.plain_zeromq("tcp://127.0.0.1:5000", FaultInjector())


def test_each_caller_has_its_own_cap_of_streams():
    async def main():
        async with _listener(per_owner=2) as lis:
            lis.offer("a")
            lis.offer("a", "push")
            with pytest.raises(errors.ResourceExhausted, match="'a' holds 2 open or pending, the cap of 2"):
                lis.offer("a")
            handle, _ = lis.offer("b")  # another caller is not held back
            assert handle.bit_length() > 8  # unguessable, as the token

    arun(main(), 30)


def test_a_task_that_gives_no_stream_leaves_the_session_to_zeromq():
    async def main():
        async with local_cluster({"ps": 1}, timeout=20, transport="tcp") as servers:
            servers["ps:0"].service("ps").bulk.per_owner = 0  # at its cap: every offer refused
            async with AsyncSession(servers["ps:0"].target, timeout=10) as sess:
                x = np.arange(ROWS * 64, dtype=np.float32).reshape(ROWS, 64)
                await sess.variable("v", x)
                assert np.array_equal((await sess.pull(["v"]))["v"], x)
                await sess.push({"v": np.ones_like(x)})
                assert np.array_equal((await sess.pull(["v"]))["v"], x + 1)
                task = zf.TaskId.parse("ps:0")
                assert await sess.bulk_stream(task) is None and await sess.bulk_stream(task, "push") is None

    arun(main(), 60)


@pytest.mark.parametrize("offer", [None, [], {"port": 0, "token": bytes(16), "handle": 1},
                                   {"port": 5000, "token": b"short", "handle": 1},
                                   {"port": 5000, "token": bytes(16), "handle": -1}, {"port": "5000"}])
def test_a_malformed_offer_is_no_offer(offer):
    from zmqflow.client.bulk_streams import _well_formed

    assert not _well_formed(offer)
    assert _well_formed({"port": 5000, "token": bytes(16), "handle": 1})


def test_a_task_listens_for_streams_before_its_router_answers_anyone(monkeypatch):
    """A session asking the moment the router is up is offered a stream, not left to ZeroMQ."""
    from zmqflow.rpc import RpcServer
    from zmqflow.testing import free_port

    seen = []
    real = RpcServer.start

    async def start(rpc):
        seen.append(server.service("ps").bulk is not None)
        return await real(rpc)

    monkeypatch.setattr(RpcServer, "start", start)

    async def main():
        nonlocal server
        spec = zf.ClusterSpec({"ps": [f"127.0.0.1:{free_port()}"]})
        server = zf.AsyncServer(spec, "ps:0")
        async with server:
            assert seen == [True] and server.service("ps").bulk is not None

    server = None
    arun(main(), 30)


def test_a_task_whose_router_cannot_bind_leaves_no_listener_open():
    from zmqflow.testing import free_port

    async def main():
        port = free_port()
        spec = zf.ClusterSpec({"ps": [f"127.0.0.1:{port}"]})
        async with zf.AsyncServer(spec, "ps:0"):
            second = zf.AsyncServer(spec, "ps:0")
            with pytest.raises(errors.AddressInUse):
                await second.start()
            assert second.service("ps").bulk is None

    arun(main(), 30)


def test_a_service_that_fails_to_start_leaves_nothing_of_its_task_open():
    from zmqflow.rpc import Service
    from zmqflow.testing import free_port

    class Broken(Service):
        name = "broken"

        async def start(self) -> None:
            raise RuntimeError("cannot start")

    async def main():
        port = free_port()
        spec = zf.ClusterSpec({"ps": [f"127.0.0.1:{port}"]})
        server = zf.AsyncServer(spec, "ps:0", services={"broken": Broken()})
        with pytest.raises(RuntimeError, match="cannot start"):
            await server.start()
        assert not server.running and server.service("ps").bulk is None
        async with zf.AsyncServer(spec, "ps:0"):  # its port is free again
            pass

    arun(main(), 30)
