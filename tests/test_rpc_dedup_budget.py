"""The replies a server keeps to answer retries are capped in bytes, per peer and in all: every
routing identity a peer makes up gets a record of its own, so ids per peer alone do not bound
memory. Over a cap the oldest kept replies are let go and their ids stay done: a retry of one is
told the call ran, never run again."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq
import zmq.asyncio

from zmqflow.rpc import CallContext, RpcServer, Service, op
from zmqflow.rpc.dedup import DONE, MAX_KEPT_BYTES, MAX_KEPT_REPLY, MAX_PEER_KEPT_BYTES, Dedup
from zmqflow.rpc.service import Answer
from zmqflow.server.limits import ServerLimits
from zmqflow.testing import free_port
from zmqflow.wire import ERROR, REPLY, Message, decode, encode_request

from .conftest import arun

_names = itertools.count()


def _run(d: Dedup, peer: bytes, rid: int, nbytes: int) -> None:
    """A new request and its reply of ``nbytes``, as the server records them."""
    assert d.begin(peer, rid, b"h%d" % rid, 0.0) is None
    d.finish(peer, rid, [b"r" * nbytes], nbytes)


def test_a_peer_over_its_cap_lets_its_oldest_replies_go_and_never_runs_them_again():
    d = Dedup(per_peer=100, max_kept_reply=10, max_peer_bytes=40, max_bytes=1000)
    for rid in range(1, 21):
        _run(d, b"p", rid, 10)
        assert d.kept <= 40
    assert d.kept >= 20  # what fits is still kept
    assert d.begin(b"p", 20, b"h20", 0.0) == (b"r" * 10,)  # the newest: its reply again
    assert d.begin(b"p", 1, b"h1", 0.0) is DONE  # the oldest: told it ran, not run again
    for rid in range(1, 21):
        assert d.begin(b"p", rid, b"h%d" % rid, 0.0) is not None  # none of them runs twice


def test_the_server_wide_cap_holds_however_many_identities_send():
    d = Dedup(per_peer=100, max_kept_reply=10, max_peer_bytes=60, max_bytes=100)
    for rid in range(1, 7):
        _run(d, b"big", rid, 10)
    for n in range(30):
        _run(d, b"id-%d" % n, 1, 10)
        assert d.kept <= 100
    assert d.begin(b"big", 1, b"h1", 0.0) is DONE  # the peer keeping the most gave first
    assert d.begin(b"id-29", 1, b"h1", 0.0) == (b"r" * 10,)


def test_bytes_kept_are_given_back_when_ids_are_forgotten():
    d = Dedup(per_peer=3, max_kept_reply=10)
    for rid in range(1, 4):
        _run(d, b"p", rid, 10)
    assert d.kept == 30
    _run(d, b"p", 4, 4)  # the oldest id (and its reply) forgotten to make room for the new
    assert d.kept == 24
    assert d.begin(b"p", 4, b"another request", 0.0) is None  # a restarted client: its record starts afresh
    assert d.kept == 0
    _run(d, b"q", 1, 10)
    assert d.sweep(1.0, lambda peer: False) == 2 and d.kept == 0


def test_the_caps_are_server_limits_and_must_be_positive():
    lim = ServerLimits()
    assert (lim.max_kept_bytes, lim.max_peer_kept_bytes) == (MAX_KEPT_BYTES, MAX_PEER_KEPT_BYTES)
    assert MAX_PEER_KEPT_BYTES <= MAX_KEPT_BYTES
    for field in ("max_kept_bytes", "max_peer_kept_bytes"):
        with pytest.raises(ValueError, match=field):
            ServerLimits(**{field: 0})
    with pytest.raises(ValueError, match="max_bytes"):
        Dedup(max_bytes=0)


class _Blob(Service):
    name = "blob"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    @op
    def get(self, ctx: CallContext, i: int) -> bytes:
        self.runs += 1
        return b"x" * 4096


def test_a_server_keeps_replies_within_its_caps_and_answers_every_retry_without_running_it_again():
    async def main():
        ep = f"tcp://127.0.0.1:{free_port()}"
        blob = _Blob()
        server = RpcServer(ep, {"blob": blob}, name="blob:0", max_kept_bytes=48 << 10, max_peer_kept_bytes=32 << 10)
        await server.start()
        socks = []
        try:
            for peer in range(2):
                sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, f"blob-peer-{next(_names)}".encode())
                sock.connect(ep)
                socks.append(sock)
                for i in range(1, 21):
                    await sock.send_multipart(encode_request(i, "blob", "get", {"i": i}, 10.0, ""))
                    assert decode(await sock.recv_multipart()).kind == REPLY
                    assert server.dedup.kept <= 48 << 10
            assert blob.runs == 40

            async def retry(sock: zmq.asyncio.Socket, i: int) -> Message:
                await sock.send_multipart(encode_request(i, "blob", "get", {"i": i}, 10.0, ""))
                async with asyncio.timeout(10):
                    return decode(await sock.recv_multipart())

            newest = await retry(socks[1], 20)
            assert newest.kind == REPLY and newest.body == b"x" * 4096
            oldest = await retry(socks[0], 1)
            assert oldest.kind == ERROR and oldest.error["code"] == "RESOURCE_EXHAUSTED"
            assert "already ran" in oldest.error["message"] and "not kept" in oldest.error["message"]
            assert blob.runs == 40  # neither retry ran again
        finally:
            for sock in socks:
                sock.close(linger=0)
            await server.close()

    arun(main())


class _Told(Service):
    """Answers with a value and the shorter one a duplicate gets (``rpc.service.Answer``)."""

    name = "told"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    @op
    def get(self, ctx: CallContext, n: int, retry: object = "short") -> Answer:
        self.runs += 1
        return Answer(b"x" * n, retry if retry != "unencodable" else object())


def test_a_duplicate_of_a_reply_too_big_to_keep_gets_the_ops_shorter_answer():
    """The first answer goes whole; a resent request gets the whole answer where it was small
    enough to keep, else the op's ``retry``, else (unencodable) "already ran". None runs twice."""
    async def main():
        ep = f"tcp://127.0.0.1:{free_port()}"
        told = _Told()
        server = RpcServer(ep, {"told": told}, name="told:0")
        await server.start()
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep)

        async def call(i: int, body: dict) -> Message:
            await sock.send_multipart(encode_request(i, "told", "get", body, 10.0, ""))
            async with asyncio.timeout(10):
                return decode(await sock.recv_multipart())

        big = MAX_KEPT_REPLY + 1
        try:
            cases = [(1, {"n": 100}, b"x" * 100), (2, {"n": big}, "short"), (3, {"n": big, "retry": None}, None),
                     (4, {"n": big, "retry": "unencodable"}, None)]
            for i, body, _ in cases:
                first = await call(i, body)
                assert first.kind == REPLY and first.body == b"x" * body["n"]
            for i, body, again in cases:
                second = await call(i, body)
                if i < 3:
                    assert second.kind == REPLY and second.body == again
                else:  # no shorter answer to keep: told the call ran
                    assert second.kind == ERROR and "already ran" in second.error["message"]
            assert told.runs == len(cases)
        finally:
            sock.close(linger=0)
            await server.close()

    arun(main())
