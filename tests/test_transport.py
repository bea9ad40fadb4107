"""One conformance suite for the transport and rpc layers, run over inproc, ipc and tcp."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
import zmq

import zmqflow as zf
from zmqflow import errors, wire
from zmqflow.rpc import RpcClient
from zmqflow.client.session import AsyncSession
from zmqflow.testing import TRANSPORTS, async_wait_until, local_cluster, make_spec
from zmqflow.transport.context import context
from zmqflow.wire.codec import Limits

from .conftest import DiagService, arun

pytestmark = pytest.mark.parametrize("transport", TRANSPORTS)


def diag(_task):
    return {"diag": DiagService()}


def test_ping_status_and_session(transport):
    async def main():
        async with local_cluster({"worker": 2, "ps": 1}, timeout=10, transport=transport, services=diag) as servers:
            w0, ps0 = servers["worker:0"], servers["ps:0"]
            assert (await w0.call("ps:0", "master", "ping"))["task"] == "ps:0"
            status = await w0.call("ps:0", "master", "status")
            assert status["task"] == "ps:0" and status["roles"] == ["master", "worker", "ring", "ps", "catalog", "diag"]
            assert status["protocol"] == wire.VERSION and status["version"] == zf.__version__
            assert status["counters"]["msgs_in"] >= 1 and status["uptime_s"] >= 0
            async with AsyncSession(ps0.target) as sess:
                await sess.wait_for_cluster(timeout=5)
                assert (await sess.cluster()) == w0.spec
                assert (await sess.status("worker:1"))["task"] == "worker:1"
                assert await sess.call("diag", "add", {"a": 2, "b": 3}) == 5

    arun(main())


def test_many_requests_in_flight_are_matched_by_id(transport):
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport=transport, services=diag) as servers:
            w0 = servers["worker:0"]
            endpoint = w0.spec.address("worker:1").endpoint
            futures = [w0.client.start_call(endpoint, "diag", "add", {"a": i, "b": 1000}) for i in range(500)]
            assert await asyncio.gather(*futures) == [i + 1000 for i in range(500)]
            assert servers["worker:1"].service("diag").calls == 500

    arun(main())


@pytest.mark.parametrize("shape,dtype", [((), "float64"), ((0, 3), "float32"), ((7,), "int64"), ((1 << 21,), "float32"), ((33, 5, 2), "float16")])
def test_tensors_round_trip(transport, shape, dtype):
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport=transport) as servers:
            x = (np.arange(int(np.prod(shape))) % 251).astype(dtype).reshape(shape)
            back = await servers["worker:0"].call("worker:1", "worker", "echo", {"x": x, "meta": {"n": [x, 1]}})
            assert back["x"].dtype == x.dtype and back["x"].shape == x.shape
            np.testing.assert_array_equal(back["x"], x)
            np.testing.assert_array_equal(back["meta"]["n"][0], x)
            assert await servers["worker:0"].call("worker:1", "worker", "sink", {"x": x}) == x.nbytes

    arun(main())


def test_errors_are_typed_and_the_server_keeps_serving(transport):
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport=transport, services=diag, debug=True) as servers:
            w0 = servers["worker:0"]
            with pytest.raises(errors.NotFound, match="no service 'nope'"):
                await w0.call("worker:1", "nope", "ping")
            with pytest.raises(errors.NotFound, match="no op 'nope'"):
                await w0.call("worker:1", "diag", "nope")
            with pytest.raises(errors.InvalidArgument, match="unexpected argument"):
                await w0.call("worker:1", "diag", "add", {"a": 1, "c": 2})
            with pytest.raises(errors.InvalidArgument, match="missing argument"):
                await w0.call("worker:1", "diag", "add", {})
            with pytest.raises(errors.InvalidArgument, match="asked to fail") as info:
                await w0.call("worker:1", "diag", "fail")
            assert "diag.fail" in info.value.message and "Traceback" in info.value.remote_traceback
            with pytest.raises(errors.RemoteError, match="ValueError") as info:
                await w0.call("worker:1", "diag", "fail", {"kind": "value"})
            assert info.value.remote_type == "ValueError"
            assert await w0.call("worker:1", "diag", "add", {"a": 1}) == 1
            status = await w0.call("worker:1", "master", "status")
            assert status["counters"]["errors"] == 6

    arun(main())


def test_deadline_exceeded_names_task_and_op(transport):
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport=transport, services=diag) as servers:
            w0 = servers["worker:0"]
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded, match=r"diag\.hang on worker:1") as info:
                await w0.call("worker:1", "diag", "hang", timeout=0.3)
            assert 0.25 <= time.monotonic() - start < 3  # loop timers round to the millisecond
            assert info.value.details["task"] == "worker:1"
            assert await w0.call("worker:1", "diag", "add", {"a": 4}) == 4

    arun(main())


def _raw_dealer(endpoint: str) -> zmq.Socket:
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def test_malformed_messages_get_error_replies_or_are_counted(transport):
    async def main():
        async with local_cluster({"worker": 1}, timeout=10, transport=transport, limits=Limits(max_frame_bytes=1 << 20)) as servers:
            server = servers["worker:0"]
            loop = asyncio.get_running_loop()
            sock = _raw_dealer(server.target)

            async def exchange(frames):
                sock.send_multipart(frames)
                reply = await loop.run_in_executor(None, sock.recv_multipart)
                return wire.decode(reply)

            try:
                ok = wire.encode(wire.Message(wire.REQUEST, 7, "worker", "sink", {"x": np.zeros(4, "f4")}))
                # a tensor frame too many, then one too few
                reply = await exchange([ok[0], bytes(memoryview(ok[1])), b"extra"])
                assert reply.kind == wire.ERROR and reply.id == 7 and reply.error["code"] == "PROTOCOL"
                reply = await exchange([ok[0]])
                assert reply.error["code"] == "PROTOCOL" and "tensor frames" in reply.error["message"]
                # a frame past the server's limit
                big = wire.encode(wire.Message(wire.REQUEST, 8, "worker", "sink", {"x": np.zeros(1 << 19, "f4")}))
                reply = await exchange([big[0], bytes(memoryview(big[1]))])
                assert reply.id == 8 and "exceeds the limit" in reply.error["message"]
                # another protocol version is refused, and says so
                head = msgpack.packb({"v": 99, "k": "req", "id": 9, "svc": "worker", "op": "ping", "a": {}, "t": []})
                reply = await exchange([head])
                assert reply.id == 9 and reply.error["code"] == "VERSION_MISMATCH"
                # unreadable messages cannot be answered: counted as dropped
                before = server.counters.dropped
                sock.send_multipart([b"\xc1 not msgpack"])
                sock.send_multipart([msgpack.packb([1, 2, 3])])
                await async_wait_until(lambda: server.counters.dropped == before + 2, 5, what="drops counted")
                # and the server still serves
                reply = await exchange(wire.encode(wire.Message(wire.REQUEST, 10, "worker", "ping", {})))
                assert reply.kind == wire.REPLY and reply.body["service"] == "worker"
            finally:
                sock.close(0)

    arun(main())


def test_client_refuses_a_reply_of_another_version(transport):
    spec = make_spec({"worker": 1}, transport)
    endpoint = spec.address("worker:0").endpoint

    async def main():
        router = context().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        loop = asyncio.get_running_loop()
        client = RpcClient(identity="version-test")
        try:
            call = asyncio.ensure_future(client.call(endpoint, "worker", "ping", timeout=5))
            ident, head = await loop.run_in_executor(None, router.recv_multipart)
            rid = msgpack.unpackb(head)["id"]
            router.send_multipart([ident, msgpack.packb({"v": 2, "k": "rep", "id": rid, "a": None, "t": []})])
            with pytest.raises(errors.VersionMismatch, match="version 2"):
                await call
        finally:
            client.close()
            router.close(0)

    arun(main())


def test_unreachable_peer_raises_unavailable(transport):
    spec = make_spec({"worker": 2}, transport)

    async def main():
        async with zf.AsyncServer(spec, "worker:0") as w0:
            # inproc queues into a not-yet-bound endpoint, so there an absent peer is a silent one
            expected = errors.DeadlineExceeded if transport == "inproc" else errors.Unavailable
            with pytest.raises(expected, match="worker:1") as info:
                await w0.call("worker:1", "master", "ping", timeout=0.3)
            assert info.value.details["task"] == "worker:1"
            with pytest.raises(errors.ClusterNotReady, match="worker:1") as info:
                await w0.wait_for_cluster(timeout=0.5)
            assert info.value.missing == ["worker:1"]

    arun(main())


def test_peer_that_dies_mid_call_raises_unavailable_fast(transport):
    if transport == "inproc":
        pytest.skip("inproc has no connection to drop: a stopped inproc peer is seen only at the deadline")
    spec = make_spec({"worker": 2}, transport)

    async def main():
        async with zf.AsyncServer(spec, "worker:0") as w0:
            w1 = await zf.AsyncServer(spec, "worker:1", services={"diag": DiagService()}).start()
            try:
                assert (await w0.call("worker:1", "master", "ping"))["task"] == "worker:1"
                call = asyncio.ensure_future(w0.call("worker:1", "diag", "hang", timeout=30))
                await async_wait_until(lambda: w1.counters.msgs_in >= 2, 5, what="hang request received")
            finally:
                await w1.stop()
            start = time.monotonic()
            with pytest.raises(errors.Unavailable, match="worker:1"):
                await call
            assert time.monotonic() - start < 3

    arun(main())


def test_restarted_peer_on_the_same_address_is_reachable_again(transport):
    spec = make_spec({"worker": 2}, transport)

    async def main():
        async with zf.AsyncServer(spec, "worker:0") as w0:
            first = await zf.AsyncServer(spec, "worker:1").start()
            assert (await w0.call("worker:1", "master", "ping"))["task"] == "worker:1"
            await first.stop()
            # as after a real restart: the drop is seen before the new server is up
            endpoint = spec.address("worker:1").endpoint
            await async_wait_until(lambda: w0.client.peer_state(endpoint) == "down", 5, what="drop seen")
            async with zf.AsyncServer(spec, "worker:1"):
                reply = await w0.call("worker:1", "master", "status", timeout=5)
                assert reply["task"] == "worker:1" and reply["counters"]["msgs_in"] >= 1

    arun(main())


def test_wait_for_cluster_tolerates_any_start_order(transport):
    spec = make_spec({"worker": 2, "ps": 1}, transport)

    async def main():
        async with zf.AsyncServer(spec, "worker:1") as w1:
            waiting = asyncio.ensure_future(w1.wait_for_cluster(timeout=10))
            async with zf.AsyncServer(spec, "ps:0"), zf.AsyncServer(spec, "worker:0"):
                await waiting

    arun(main())


def test_address_in_use_names_the_address(transport):
    spec = make_spec({"worker": 1}, transport)

    async def main():
        async with zf.AsyncServer(spec, "worker:0"):
            with pytest.raises(errors.AddressInUse, match="in use"):
                await zf.AsyncServer(spec, "worker:0").start()

    if transport == "ipc":
        pytest.skip("ipc endpoints are taken over by a later bind, as libzmq documents; nothing to refuse")
    arun(main())
