"""Limits: every resource a request can grow is capped, each refusal typed, naming what is at
fault, and changing nothing; the defaults let big-but-legal cases through."""

from __future__ import annotations

import asyncio
import contextlib
import time
import typing
from collections.abc import Awaitable, Callable, Iterator

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

import zmqflow as zf
from zmqflow import errors, wire
from zmqflow.cli.serve import limits_from_flags, parse_size
from zmqflow.rpc import CallContext
from zmqflow.server.limits import ROUTER_HEADROOM, ServerLimits
from zmqflow.server.services.ps import OFF_LOOP_BYTES
from zmqflow.state.limits import StateLimits
from zmqflow.state.store import ShardStore
from zmqflow.state.tables import DEFAULT_CAPACITY, HashTable
from zmqflow.testing import async_wait_until, local_cluster
from zmqflow.transport.base import UP
from zmqflow.transport.context import context
from zmqflow.wire.codec import LimitExceeded, Limits, decode
from zmqflow.wire.requests import SERVICES
from zmqflow.wire.requests.base import Item, field_types, unwrap

from .conftest import DiagService, arun

HUGE = [1 << 20, 1 << 20]  # 2**40 elements: 4 TiB of float32, refused before any allocation


def cluster(ps: int = 1, **kw):
    return local_cluster({"ps": ps, "worker": 1}, timeout=10, transport="inproc", **kw)


@contextlib.contextmanager
def _raw_dealer(target: str) -> Iterator[tuple[zmq.Socket, Callable[[], Awaitable[wire.Message]]]]:
    """A bare DEALER to ``target`` (what any peer could send) and a coroutine reading its next reply."""
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(target)
    loop = asyncio.get_running_loop()

    async def reply() -> wire.Message:
        return wire.decode(await loop.run_in_executor(None, sock.recv_multipart))

    try:
        yield sock, reply
    finally:
        sock.close(0)


def _raw_header(rid: int, depth: int) -> bytes:
    """A request header whose body nests ``depth`` one-element arrays (keys v, k, id first)."""
    pairs = [("v", 1), ("k", "req"), ("id", rid), ("svc", "worker"), ("op", "echo")]
    out = b"\x87" + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)
    return out + msgpack.packb("a") + b"\x91" * depth + b"\x00" + msgpack.packb("t") + b"\x90"


# the defaults ---------------------------------------------------------------------------------


def test_defaults_are_sized_for_real_models():
    lim = ServerLimits()
    assert lim.max_frame_bytes >= 64 << 20 and lim.router_max_msg_bytes == lim.max_frame_bytes + ROUTER_HEADROOM
    assert lim.max_variable_bytes >= 8 << 30  # a single tensor of several GiB
    table_part = 10_000_000 // 4 * 64 * 4 * 3  # a 10M x 64 float32 table over 4 shards, with Adam's slots
    assert lim.table_capacity >= 10_000_000 // 4 and lim.max_variable_bytes >= table_part
    assert 0 < lim.max_deadline < float("inf") and lim.max_in_flight >= 1024
    assert HashTable(4, np.dtype("float32")).capacity == DEFAULT_CAPACITY == lim.table_capacity
    with pytest.raises(ValueError, match="max_in_flight"):
        ServerLimits(max_in_flight=0)


def test_serve_flags_build_server_limits():
    assert parse_size("64MiB") == 64 << 20 and parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000
    lim = limits_from_flags({"max_frame_bytes": "64MiB", "max_deadline": 30.0, "max_in_flight": None, "max_variables": 10})
    assert (lim.max_frame_bytes, lim.max_deadline, lim.max_variables) == (64 << 20, 30.0, 10)
    assert lim.max_in_flight == ServerLimits().max_in_flight
    with pytest.raises(errors.ConfigError, match="not a size"):
        parse_size("lots")


def test_serve_documents_its_limit_flags():
    from click.testing import CliRunner

    from zmqflow.cli.serve import serve

    out = CliRunner().invoke(serve, ["--help"]).output
    for flag in ("--debug", "--max-deadline", "--max-in-flight", "--max-frame-bytes", "--max-variable-bytes",
                 "--max-shard-bytes", "--max-variables", "--table-capacity"):
        assert flag in out


def test_every_name_and_string_field_of_every_op_is_bounded():
    def strings(cls: type, where: str) -> typing.Iterator[tuple[str, typing.Any, list]]:
        for name, tp in field_types(cls).items():
            bare, meta = unwrap(tp)
            if bare is str:
                yield f"{where}.{name}", bare, meta
            elif typing.get_origin(bare) is list:
                item, item_meta = unwrap(typing.get_args(bare)[0])
                if item is str:
                    yield f"{where}.{name}[]", item, item_meta
                elif isinstance(item, type) and issubclass(item, Item):
                    yield from strings(item, f"{where}.{name}[]")

    checked = 0
    for service, ops in SERVICES.items():
        for op_name, cls in ops.items():
            for where, _, meta in strings(cls, f"{service}.{op_name}"):
                lengths = [m.max_length for m in meta if isinstance(m, msgspec.Meta) and m.max_length is not None]
                assert lengths and lengths[0] <= 1 << 16, f"{where} has no length limit"
                checked += 1
    assert checked > 20


# the codec ------------------------------------------------------------------------------------


def test_nesting_past_the_limit_is_refused_with_the_request_id():
    ok = decode([_raw_header(5, 100)])
    assert ok.id == 5
    for depth in (300, 950, 5000):  # past the limit, past Python's recursion, past msgpack's stack
        with pytest.raises(LimitExceeded) as info:
            decode([_raw_header(6, depth)])
        assert info.value.request_id == 6 and info.value.kind == "req" and info.value.code == "RESOURCE_EXHAUSTED"
        assert "nests containers deeper than the limit of 256" in str(info.value)
    assert decode([_raw_header(7, 20)], Limits(max_depth=30)).id == 7
    with pytest.raises(LimitExceeded):
        decode([_raw_header(7, 40)], Limits(max_depth=30))


def test_oversized_messages_are_refused_with_the_request_id():
    frames = wire.encode(wire.Message(wire.REQUEST, 11, "worker", "echo", {"a": np.zeros(8, "f4"), "b": np.zeros(8, "f4")}))
    assert len(decode(frames, Limits(max_message_bytes=64)).body) == 2
    with pytest.raises(LimitExceeded, match="more than 63 bytes in one message exceed the limit") as info:
        decode(frames, Limits(max_message_bytes=63))
    assert info.value.request_id == 11
    assert len(frames) == 2  # the header and the pack the two small arrays share
    with pytest.raises(LimitExceeded, match="exceed the limit of 1") as info:  # counted before the header is read
        decode(frames, Limits(max_frames=1))
    assert info.value.request_id == 11
    head = wire.encode(wire.Message(wire.REQUEST, 12, "worker", "echo", {"x": "y" * 1000}))
    with pytest.raises(LimitExceeded) as info:
        decode(head, Limits(max_header_bytes=100))
    assert info.value.request_id == 12
    head = wire.encode(wire.Message(wire.REQUEST, 13, "worker", "echo", {"x": list(range(100))}))
    with pytest.raises(LimitExceeded, match="max_array_len") as info:
        decode(head, Limits(max_container_len=50))
    assert info.value.request_id == 13


def test_a_deep_request_is_answered_not_dropped():
    async def main():
        async with local_cluster({"worker": 1}, timeout=10, transport="tcp") as servers:
            with _raw_dealer(servers["worker:0"].target) as (sock, reply):
                for rid, depth in ((21, 300), (22, 2000)):
                    sock.send(_raw_header(rid, depth))
                    got = await reply()
                    assert got.kind == wire.ERROR and got.id == rid and got.error["code"] == "RESOURCE_EXHAUSTED"
                    assert got.error["traceback"] == ""
                sock.send_multipart(wire.encode(wire.Message(wire.REQUEST, 23, "worker", "ping", {})))
                assert (await reply()).kind == wire.REPLY

    arun(main())


def test_a_message_of_very_many_parts_is_refused_and_the_server_serves_on():
    """libzmq caps a part's size, not a message's part count: 20,000 empty parts are read, the
    parts past the codec's frame limit dropped without an object each, and the request is refused
    naming the limit (the count it gives is where the channel cut: the frames the codec saw)."""
    async def main():
        async with local_cluster({"worker": 1}, timeout=10, transport="tcp") as servers:
            server = servers["worker:0"]
            assert server.options.max_msg_parts == wire.codec.DEFAULT_LIMITS.max_frames + 2
            with _raw_dealer(server.target) as (sock, reply):
                header = wire.encode(wire.Message(wire.REQUEST, 31, "worker", "ping", {}))[0]
                sock.send_multipart([header, *([b""] * 20_000)])
                got = await reply()
                assert got.kind == wire.ERROR and got.id == 31 and got.error["code"] == "RESOURCE_EXHAUSTED"
                assert "4097 frames exceed the limit of 4096" in got.error["message"]
                sock.send_multipart(wire.encode(wire.Message(wire.REQUEST, 32, "worker", "ping", {})))
                assert (await reply()).kind == wire.REPLY

    arun(main())


def test_the_router_caps_frames_a_bit_over_the_codec_limit():
    async def main():
        lim = ServerLimits(max_frame_bytes=1 << 20)
        async with local_cluster({"worker": 1}, timeout=10, transport="tcp", limits=lim) as servers:
            server = servers["worker:0"]
            assert server.options.router_max_msg_bytes == (4 << 20) + ROUTER_HEADROOM  # the header's limit is larger
            with pytest.raises(errors.ResourceExhausted, match="exceeds the limit of 1048576"):
                await server.call("worker:0", "worker", "sink", {"x": np.zeros((1 << 18) + 1, "f4")}, timeout=5)
            await server.call("worker:0", "worker", "sink", {"x": np.zeros(1 << 18, "f4")}, timeout=5)

    arun(main())


def test_a_frame_past_the_routers_cap_fails_the_call_at_once_and_the_server_serves_on():
    async def main():
        lim = ServerLimits(max_frame_bytes=1 << 20, max_header_bytes=1 << 20)
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp", limits=lim) as servers:
            assert servers["worker:1"].options.router_max_msg_bytes == (1 << 20) + ROUTER_HEADROOM
            # Unavailable, not DeadlineExceeded: libzmq cut the connection and the call failed then,
            # not at its deadline (a wall-clock bound here would only measure the machine's load)
            with pytest.raises(errors.Unavailable, match="dropped during worker.sink"):
                await servers["worker:0"].call("worker:1", "worker", "sink", {"x": np.zeros((70 << 20) // 4, "f4")},
                                               timeout=20)
            endpoint = servers["worker:1"].spec.address("worker:1").endpoint
            await async_wait_until(lambda: servers["worker:0"].client.peer_state(endpoint) == UP, 10,
                                   what="the connection back")
            assert (await servers["worker:0"].call("worker:1", "worker", "ping", timeout=5))["service"] == "worker"

    arun(main())


# requests ---------------------------------------------------------------------------------------


def test_a_wait_without_a_deadline_ends_at_the_servers_maximum():
    async def main():
        async with cluster(limits=ServerLimits(max_deadline=0.5), services=lambda t: {"diag": DiagService()}) as servers:
            ps = servers["ps:0"]
            with _raw_dealer(ps.target) as (sock, reply):
                start = time.monotonic()
                sock.send(msgpack.packb({"v": 1, "k": "req", "id": 31, "svc": "catalog", "op": "lookup",
                                         "a": {"name": "never"}, "t": []}))  # no "dl"
                got = await reply()
                assert got.id == 31 and got.error["code"] == "NOT_FOUND" and 0.3 < time.monotonic() - start < 4
                # a longer deadline is capped too: the handler is cancelled at the server's maximum
                diag_start = time.monotonic()
                with pytest.raises(errors.DeadlineExceeded, match="the server's limit of 0.5s"):
                    await servers["worker:0"].call("worker:0", "diag", "hang", timeout=30)
                assert time.monotonic() - diag_start < 4
                assert not ps.service("catalog")._ready  # no event left behind by the wait

    arun(main())


def test_a_peer_over_its_in_flight_cap_is_answered_resource_exhausted():
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="inproc", limits=ServerLimits(max_in_flight=2),
                                 services=lambda t: {"diag": DiagService()}) as servers:
            w0 = servers["worker:0"]
            hangs = [asyncio.ensure_future(w0.call("worker:1", "diag", "hang", timeout=2)) for _ in range(2)]
            rpc = servers["worker:1"]._rpc
            await async_wait_until(lambda: sum(rpc._in_flight.values()) == 2, 5, what="two calls in flight")
            start = time.monotonic()
            with pytest.raises(errors.ResourceExhausted, match="already has 2 requests in flight") as info:
                await w0.call("worker:1", "diag", "hang", timeout=2)
            assert time.monotonic() - start < 1 and info.value.details["limit"] == 2
            with pytest.raises(errors.ResourceExhausted):  # every op of that peer, until it has room again
                await w0.call("worker:1", "diag", "add", {"a": 1}, timeout=2)
            assert await servers["worker:1"].call("worker:1", "diag", "add", {"a": 1}, timeout=2) == 1  # other peers not
            for h in hangs:
                with pytest.raises(errors.DeadlineExceeded):
                    await h
            await async_wait_until(lambda: not rpc._in_flight, 5, what="in-flight counts back to zero")
            assert await w0.call("worker:1", "diag", "add", {"a": 1}, timeout=2) == 1
            for h in [asyncio.ensure_future(w0.call("worker:1", "diag", "hang", timeout=0.3)) for _ in range(2)]:
                with pytest.raises(errors.DeadlineExceeded):
                    await h
            await async_wait_until(lambda: not rpc._in_flight, 5, what="in-flight counts back to zero")

    arun(main())


def test_replies_a_peer_never_reads_wait_up_to_its_in_flight_cap_and_the_rest_are_dropped():
    """A peer that sends and never reads fills its pipe; the replies past it wait for room, at most
    ``max_in_flight`` of them (each until its deadline), and the rest are dropped and counted."""
    async def main():
        async with local_cluster({"worker": 1}, timeout=10, transport="inproc", limits=ServerLimits(max_in_flight=4),
                                 services=lambda t: {"diag": DiagService()}) as servers:
            rpc = servers["worker:0"]._rpc
            sock = context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)  # its pipe holds the server's high-water mark of replies, and one
            sock.connect(servers["worker:0"].target)
            try:
                for rid in range(1, 1001):
                    sock.send_multipart(wire.encode(wire.Message(wire.REQUEST, rid, "diag", "add", {"a": rid},
                                                                 deadline=30.0)))
                await async_wait_until(lambda: rpc.counters.msgs_in >= 1000, 10, what="every request read")
                assert rpc.replies_waiting == 4 and rpc.counters.undeliverable > 900 - rpc.options.hwm
            finally:
                sock.close(0)
            await async_wait_until(lambda: rpc.replies_waiting == 0, 10, what="the peer gone: nothing waits")

    arun(main())


def test_error_replies_carry_tracebacks_only_with_debug():
    async def main():
        for debug in (False, True):
            async with local_cluster({"worker": 1}, timeout=10, transport="inproc", debug=debug,
                                     services=lambda t: {"diag": DiagService()}) as servers:
                w0 = servers["worker:0"]
                with pytest.raises(errors.InvalidArgument, match="asked to fail") as info:
                    await w0.call("worker:0", "diag", "fail", timeout=5)
                with pytest.raises(errors.RemoteError, match="ValueError") as plain:
                    await w0.call("worker:0", "diag", "fail", {"kind": "value"}, timeout=5)
                for got in (info.value, plain.value):
                    assert ("Traceback" in (got.remote_traceback or "")) is debug

    arun(main())


# variables ----------------------------------------------------------------------------------------


def test_a_huge_shape_is_refused_before_anything_is_recorded_and_the_name_stays_usable():
    async def main():
        async with cluster(ps=2) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                with pytest.raises(errors.ResourceExhausted, match=r"'w'.* 1099511627776 elements.*limit") as info:
                    await sess.variable("w", shape=HUGE, initializer=zf.init.normal())
                assert info.value.details["name"] == "w"
                assert "w" not in servers["ps:0"].service("catalog").catalog.records
                assert all(not servers[t].service("ps").store.parts for t in ("ps:0", "ps:1"))
                w = await sess.variable("w", shape=[4, 3])  # the name is free for a legal shape
                np.testing.assert_array_equal(await w.read(), np.zeros((4, 3), np.float32))
                # a raw create on a shard, past the catalog, is refused as well
                ctx = CallContext("ps", "create", b"", "", None)
                with pytest.raises(errors.ResourceExhausted, match="elements"):
                    servers["ps:1"].service("ps").create(ctx, name="raw", part=0, shape=HUGE, rows=[0, 1 << 20],
                                                         dtype="float32")
                assert ("raw", 0) not in servers["ps:1"].service("ps").store.parts
                # a name past 1024 characters is malformed input: InvalidArgument naming the field
                with pytest.raises(errors.InvalidArgument, match=r"catalog.declare: name must be a name of 1..1024"):
                    await sess.variable("n" * (1 << 20), shape=[1])
                assert set(servers["ps:0"].service("catalog").catalog.records) == {"w"}

    arun(main())


def test_variable_bytes_shard_bytes_and_counts_each_have_a_limit():
    mib = 1 << 20
    lim = ServerLimits(max_variable_bytes=mib, max_shard_bytes=3 * mib, max_variables=4)

    async def main():
        async with cluster(limits=lim) as servers:
            catalog = servers["ps:0"].service("catalog").catalog
            store = servers["ps:0"].service("ps").store
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("at_limit", shape=[mib // 4])  # exactly 1 MiB of float32
                with pytest.raises(errors.ResourceExhausted, match=r"'over'.* 1048580 bytes, over the limit of 1048576"):
                    await sess.variable("over", shape=[mib // 4 + 1])
                # 1 MiB held; with Momentum's slot a 1 MiB variable takes 2 MiB: 3 MiB in all, the shard's limit
                await sess.variable("slots", shape=[mib // 4], optimizer=zf.optim.Momentum(0.1, 0.9))
                with pytest.raises(errors.ResourceExhausted, match=r"'more'.* over the limit of 3145728 bytes per shard"):
                    await sess.variable("more", shape=[16])
                assert set(catalog.records) == {"at_limit", "slots"} and len(store.parts) == 2
                assert store.held_bytes() == 3 * mib
            async with cluster(limits=ServerLimits(max_variables=3)) as servers:
                async with zf.AsyncSession(servers["worker:0"].target) as sess:
                    for i in range(3):
                        await sess.variable(f"v{i}", shape=[2])
                    with pytest.raises(errors.ResourceExhausted, match=r"'v3'.* the catalog already holds 3 variables"):
                        await sess.variable("v3", shape=[2])
                    await sess.variable("v0", shape=[2])  # an existing name is still found
                    assert len(servers["ps:0"].service("catalog").catalog.records) == 3

    arun(main())


def test_the_store_checks_before_it_allocates():
    store = ShardStore(StateLimits(max_variable_elements=150, max_shard_bytes=1000, max_variables=2))
    assert store.create("a", 0, [100], [0, 100], "int8")
    with pytest.raises(errors.ResourceExhausted, match="151 elements"):
        store.create("b", 0, [151], [0, 151], "int8")
    with pytest.raises(errors.ResourceExhausted, match="over its limit of 1000"):
        store.create("c", 0, [120], [0, 120], "float64")
    assert store.create("c", 0, [10], [0, 10], "int8")
    with pytest.raises(errors.ResourceExhausted, match="already holds 2 variables"):
        store.create("d", 0, [1], [0, 1], "int8")
    assert set(store.parts) == {("a", 0), ("c", 0)} and not store._reserved and store.held_bytes() == 110
    store.parts.pop(("a", 0))  # removed behind the store's back (a sweep): recounted
    assert store.held_bytes() == 10 and store.create("d", 0, [1], [0, 1], "int8")


def test_big_initializers_run_off_the_loop_while_pings_are_answered():
    nbytes = 200 << 20
    assert nbytes >= OFF_LOOP_BYTES

    async def main():
        async with cluster() as servers:
            ps = servers["ps:0"]
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                created = asyncio.ensure_future(
                    sess.variable("big", shape=[nbytes // 4 // 1024, 1024], initializer=zf.init.truncated_normal(seed=3)))
                await async_wait_until(lambda: ps.service("ps")._building, 10, interval=0.001, what="the build started")
                answered, worst = 0, 0.0
                while ps.service("ps")._building:
                    start = time.monotonic()
                    await servers["worker:0"].call("ps:0", "master", "ping", timeout=5)
                    worst = max(worst, time.monotonic() - start)
                    answered += 1
                await created
                assert answered >= 3 and worst < 0.5, (answered, worst)
                part = ps.service("ps").store.get("big", 0)
                assert part.value.shape == (nbytes // 4 // 1024, 1024) and abs(float(part.value[:64].std()) - 0.88) < 0.1
                assert not ps.service("ps").store._reserved

    arun(main(), timeout=60)


def test_concurrent_creates_of_one_big_part_build_it_once():
    async def main():
        async with cluster() as servers:
            svc = servers["ps:0"].service("ps")
            ctx = CallContext("ps", "create", b"", "", None)
            kw = dict(name="twice", part=0, shape=[OFF_LOOP_BYTES // 4], rows=[0, OFF_LOOP_BYTES // 4], dtype="float32")
            first, second = svc.create(ctx, **kw), svc.create(ctx, **kw)
            assert await asyncio.gather(first, second) == [True, False]
            assert len(svc.store.parts) == 1 and not svc._building and not svc.store._reserved

    arun(main())


# dynamic tables ----------------------------------------------------------------------------------
