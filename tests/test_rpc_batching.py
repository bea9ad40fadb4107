"""Small requests for one peer made in one loop tick travel in one batch envelope, over real
ZeroMQ sockets: each still gets its own reply or error, a lone call goes alone, large ones are
never held, and a malformed envelope is refused whole with a typed error while the server goes
on serving."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from zmqflow import errors
from zmqflow.rpc import CallContext, RpcClient, RpcServer, Service, op
from zmqflow.rpc.coalesce import MAX_ENTRIES, Coalescer
from zmqflow.testing import free_port
from zmqflow.wire import ERROR, REPLY, REQUEST, Message, decode, encode
from zmqflow.wire.batch import BatchLimits, decode_batch, encode_batch

from .conftest import arun

VECTORS = Path(__file__).resolve().parent.parent / "protocol" / "vectors" / "batch"
_names = itertools.count()


class Calc(Service):
    name = "calc"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    @op
    def add(self, ctx: CallContext, a: int, b: int = 0) -> int:
        self.runs += 1
        return a + b

    @op
    def fail(self, ctx: CallContext) -> None:
        self.runs += 1
        raise errors.InvalidArgument("calc.fail was asked to fail")

    @op
    def nbytes(self, ctx: CallContext, x: np.ndarray) -> int:
        self.runs += 1
        return int(x.nbytes)

    @op
    async def slow(self, ctx: CallContext, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "late"

    @op
    def who(self, ctx: CallContext) -> list[str]:
        return [ctx.peer.decode(), ctx.source]


async def _pair(**server_kw):
    ep = f"tcp://127.0.0.1:{free_port()}"
    calc = Calc()
    server = RpcServer(ep, {"calc": calc}, name="calc:0", **server_kw)
    await server.start()
    client = RpcClient(identity=f"batcher-{next(_names)}", source="worker:0")
    assert await client.call(ep, "calc", "add", {"a": 1}, timeout=10) == 1  # connected: what follows goes now
    return ep, calc, server, client


async def _close(server, client, *socks):
    client.close()
    for s in socks:
        s.close(linger=0)
    await server.close()


def test_calls_made_in_one_tick_share_an_envelope_and_each_gets_its_own_answer():
    async def main():
        ep, calc, server, client = await _pair()
        try:
            msgs_in, runs = server.counters.msgs_in, calc.runs
            futs = []
            for i in range(60):
                if i % 7 == 3:
                    futs.append(client.start_call(ep, "calc", "fail", {}, timeout=10))
                elif i == 11:
                    futs.append(client.start_call(ep, "calc", "slow", {"seconds": 30.0}, timeout=0.5))
                else:
                    futs.append(client.start_call(ep, "calc", "add", {"a": i, "b": 1000}, timeout=10))
            got = await asyncio.gather(*futs, return_exceptions=True)
            for i, r in enumerate(got):
                if i % 7 == 3:
                    assert isinstance(r, errors.InvalidArgument) and "asked to fail" in str(r)
                elif i == 11:  # its own deadline, not its neighbours'
                    assert isinstance(r, errors.DeadlineExceeded)
                else:
                    assert r == i + 1000
            # the first went out alone at once, the other 59 in envelopes of at most MAX_ENTRIES
            envelopes = -(-59 // MAX_ENTRIES)
            assert client.batches_out == envelopes and server.batches_in == envelopes
            assert server.counters.msgs_in - msgs_in == 1 + envelopes
            assert calc.runs - runs == 59
            assert server.batches_out >= 1  # the replies made while answering the envelope went back in one
        finally:
            await _close(server, client)

    arun(main())


def test_a_lone_call_goes_alone():
    async def main():
        ep, _calc, server, client = await _pair()
        try:
            for i in range(5):
                assert await client.call(ep, "calc", "add", {"a": i}, timeout=10) == i
            assert client.batches_out == 0 and server.batches_in == 0
        finally:
            await _close(server, client)

    arun(main())


def test_large_requests_are_never_held_and_keep_their_place():
    async def main():
        ep, _calc, server, client = await _pair()
        try:
            big = np.ones(1 << 18, np.float32)  # 1 MiB
            small = [client.start_call(ep, "calc", "add", {"a": i}, timeout=10) for i in range(5)]
            large = client.start_call(ep, "calc", "nbytes", {"x": big}, timeout=10)
            # the held four went out before the large one; it did not wait for the tick
            assert client.batches_out == 1
            later = [client.start_call(ep, "calc", "add", {"a": i}, timeout=10) for i in range(5, 8)]
            assert await asyncio.gather(*small, *later) == list(range(8))
            assert await large == big.nbytes
            assert client.batches_out == 2
        finally:
            await _close(server, client)

    arun(main())


def test_a_server_that_refuses_envelopes_gets_the_requests_one_by_one():
    async def main():
        # an envelope of more than 2 is refused whole, as a server without envelopes refuses any
        ep, calc, server, client = await _pair(batch_limits=BatchLimits(max_entries=2))
        try:
            runs = calc.runs
            futs = [client.start_call(ep, "calc", "add", {"a": i}, timeout=10) for i in range(6)]
            assert await asyncio.gather(*futs) == list(range(6))
            assert calc.runs - runs == 6  # each ran exactly once: the refused envelope ran nothing
            assert not client.peer(ep).batching
            futs = [client.start_call(ep, "calc", "add", {"a": i}, timeout=10) for i in range(6)]
            assert await asyncio.gather(*futs) == list(range(6))
            assert client.batches_out == 1 and server.batches_in == 0
        finally:
            await _close(server, client)

    arun(main())


# raw envelopes ------------------------------------------------------------------------------


def _req(rid: int, op_name: str, body, source: str = "") -> list:
    return encode(Message(REQUEST, rid, "calc", op_name, body, deadline=10.0, source=source))


async def _recv_all(sock, want: int, timeout: float = 10.0) -> dict[int, Message]:
    """Replies by id, read from single messages and envelopes alike."""
    out: dict[int, Message] = {}
    async with asyncio.timeout(timeout):
        while len(out) < want:
            frames = await sock.recv_multipart()
            head = msgpack.unpackb(frames[0])
            entries = decode_batch(frames).entries if head.get("k") == "bat" else [frames]
            for entry in entries:
                msg = decode(entry)
                if msg.id:  # id 0: the server's reachability probe
                    out[msg.id] = msg
    return out


def _raw_dealer(ep: str) -> zmq.asyncio.Socket:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"raw-{next(_names)}".encode())
    sock.connect(ep)
    return sock


def test_each_request_of_an_envelope_is_served_alone_and_a_duplicate_envelope_runs_nothing_again():
    async def main():
        ep, calc, server, client = await _pair()
        sock = _raw_dealer(ep)
        try:
            entries = [_req(1, "add", {"a": 2, "b": 3}), _req(2, "fail", {}), _req(3, "add", {"c": 1}),
                       _req(4, "who", {}, source="ps:0"), [b"\x92garbage"], _req(5, "nope", {})]
            envelope = encode_batch(99, entries)
            runs = calc.runs
            await sock.send_multipart(envelope)
            got = await _recv_all(sock, 5)
            assert (got[1].kind, got[1].body) == (REPLY, 5)
            assert got[2].kind == ERROR and got[2].error["code"] == "INVALID_ARGUMENT"
            assert got[3].kind == ERROR and "calc.add" in got[3].error["message"]
            # who called is the connection's routing id, whatever an entry's header claims
            assert got[4].body == [sock.getsockopt(zmq.ROUTING_ID).decode(), "ps:0"]
            assert got[5].kind == ERROR and got[5].error["code"] == "NOT_FOUND"
            assert 99 not in got and server.counters.dropped >= 1  # the unreadable entry: no id to answer
            assert calc.runs - runs == 2
            await sock.send_multipart(envelope)  # a retried envelope: answered from the record
            again = await _recv_all(sock, 5)
            assert again[1].body == 5 and again[2].error["code"] == "INVALID_ARGUMENT"
            assert calc.runs - runs == 2
            assert server.dedup.duplicates >= 5
        finally:
            await _close(server, client, sock)

    arun(main())


def _bad_envelopes() -> list[tuple[str, list[bytes], str, str]]:
    good = encode_batch(7, [_req(70, "add", {"a": 1}), _req(71, "add", {"a": 2})])
    head = msgpack.unpackb(good[0])

    def with_head(**fields) -> bytes:
        return msgpack.packb({**head, **fields})

    return [
        ("n not a list", [with_head(n="many"), good[1]], "PROTOCOL", "'n' must be a non-empty list"),
        ("entry lengths not ints", [with_head(n=[["a"], [3]]), good[1]], "PROTOCOL", "frame length"),
        ("no entries", [with_head(n=[]), b""], "PROTOCOL", "'n' must be a non-empty list"),
        ("too many entries", encode_batch(7, [_req(80 + i, "add", {"a": i}) for i in range(5)]), "RESOURCE_EXHAUSTED",
         "5 entries exceed the limit of 4"),
        ("truncated data", [good[0], good[1][:-3]], "PROTOCOL", "truncated"),
        ("trailing bytes", [good[0], good[1] + bytes(9)], "PROTOCOL", "bytes after the last entry"),
        ("data frame missing", [good[0]], "PROTOCOL", "2 frames"),
        ("too many bytes", encode_batch(7, [_req(90, "add", {"a": 1}), [bytes(5000)]]),
         "RESOURCE_EXHAUSTED", "exceed the limit of 4096"),
    ]


@pytest.mark.parametrize("case", _bad_envelopes(), ids=lambda c: c[0])
def test_a_malformed_envelope_is_refused_whole_with_a_typed_error_and_the_server_goes_on(case):
    _name, frames, code, words = case

    async def main():
        ep, calc, server, client = await _pair(batch_limits=BatchLimits(max_entries=4, max_bytes=4096))
        sock = _raw_dealer(ep)
        try:
            runs = calc.runs
            await sock.send_multipart(frames)
            got = await _recv_all(sock, 1)
            assert set(got) == {7}
            err = got[7]
            assert err.kind == ERROR and err.error["code"] == code, err.error
            assert words in err.error["message"] and "none of its requests ran" in err.error["message"]
            assert calc.runs == runs
            assert await client.call(ep, "calc", "add", {"a": 4, "b": 5}, timeout=10) == 9
            await sock.send_multipart(_req(100, "add", {"a": 1}))
            assert (await _recv_all(sock, 1))[100].body == 1
        finally:
            await _close(server, client, sock)

    arun(main())


# sans-IO parts ------------------------------------------------------------------------------


def test_coalescer_sends_the_first_alone_holds_the_rest_and_cuts_full_groups():
    co = Coalescer(small_bytes=100, max_entries=3, max_bytes=200)
    assert co.add("p", "a", 10) == (["a"], True)
    assert co.add("p", "b", 10) == (None, False)
    assert co.add("q", "x", 10) == (["x"], True)  # each peer has its own tick
    assert co.add("p", "c", 10) == (None, False)
    assert co.add("p", "d", 10) == (None, False)
    assert co.add("p", "e", 10) == (["b", "c", "d"], False)  # full by count: handed back, e held
    assert co.add("p", "f", 100) == (None, False)
    assert co.add("p", "g", 100) == (["e", "f"], False)  # full by bytes
    assert co.take("p") == ["g"] and co.held("p") == 0
    assert co.end_tick("p") == [] and co.end_tick("q") == []
    assert co.add("p", "h", 10) == (["h"], True)  # a new tick
    assert co.small(100) and not co.small(101)


def test_envelope_round_trip_keeps_tensors_aligned_and_whole():
    arrays = [np.arange(3, dtype=np.float64), np.arange(5, dtype=np.int8), np.ones((2, 2), np.complex128)]
    entries = [encode(Message(REQUEST, i + 1, "calc", "nbytes", {"x": a}, deadline=1.0)) for i, a in enumerate(arrays)]
    frames = encode_batch(5, entries)
    batch = decode_batch([frames[0], bytearray(frames[1])])
    assert batch.id == 5 and len(batch.entries) == 3
    for entry, arr in zip(batch.entries, arrays):
        got = decode(entry).body["x"]
        assert got.ctypes.data % 8 == 0
        np.testing.assert_array_equal(got, arr)


VECTOR_FILES = sorted(VECTORS.glob("*.json"))


def test_batch_vectors_exist():
    names = {p.stem for p in VECTOR_FILES}
    assert {"batch_requests", "batch_replies", "invalid_batch_truncated", "invalid_batch_n_not_a_list"} <= names


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_golden_batch_vector(path):
    vector = json.loads(path.read_text())
    frames = [bytes.fromhex(h) for h in vector["frames_hex"]]
    if vector["entries_hex"] is None:
        with pytest.raises(errors.ProtocolError) as info:
            decode_batch(frames)
        assert info.value.request_id == vector["expect"]["request_id"]
        assert type(info.value).__name__ == vector["expect"]["error"]
        return
    batch = decode_batch(frames)
    entries = [[bytes(f) for f in e] for e in batch.entries]
    assert [[f.hex() for f in e] for e in entries] == vector["entries_hex"]
    for e in entries:
        decode(e)  # each entry is a valid message on its own
    assert [f.hex() for f in encode_batch(batch.id, entries)] == vector["frames_hex"]
