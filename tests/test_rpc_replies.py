"""A reply ends a call only when it comes from the peer the call went to, over real ZeroMQ sockets.

Request ids are the client's own, numbered across all its peers, so a peer that answers an id it
was never sent (a bug, or a hostile server guessing a neighbour's id) must not complete or fail a
call made to another peer: not with a reply, an error, an unreadable reply, an entry of a batch
envelope, nor by refusing another peer's envelope. Each is counted and ignored.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import zmq
import zmq.asyncio

from zmqflow.errors import InvalidArgument
from zmqflow.rpc import RpcClient
from zmqflow.testing import free_port
from zmqflow.wire import Message, decode, encode, encode_reply, error_message
from zmqflow.wire.batch import batch_id, decode_batch, encode_batch

from .conftest import arun

_names = itertools.count()


class _Peer:
    """A bare ROUTER standing for a server: the test reads each request and writes each answer."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.client_id = b""

    async def request(self) -> Message:
        """The next request (a lone one, not an envelope)."""
        self.client_id, *frames = await self.sock.recv_multipart()
        return decode(frames)

    async def send(self, frames: list) -> None:
        await self.sock.send_multipart([self.client_id, *frames])


@asynccontextmanager
async def _peers(n: int, **client_kw) -> AsyncIterator[tuple[RpcClient, list[_Peer]]]:
    client = RpcClient(identity=f"replies-{next(_names)}", **client_kw)
    peers = [_Peer() for _ in range(n)]
    try:
        yield client, peers
    finally:
        client.close()
        for p in peers:
            p.sock.close(linger=0)


def test_a_reply_error_or_unreadable_reply_from_another_peer_does_not_end_a_call():
    async def main():
        async with _peers(2, coalesce=False) as (client, (honest, rogue)):
            to_honest = client.call(honest.endpoint, "calc", "get", timeout=10)
            rid = (await honest.request()).id
            to_rogue = client.call(rogue.endpoint, "calc", "get", timeout=10)
            own = (await rogue.request()).id
            late, dropped = client.counters.late_replies, client.counters.dropped
            forged = [
                encode_reply(rid, "forged"),
                encode(error_message(rid, InvalidArgument("forged refusal"))),
                [msgpack.packb({"v": 1, "k": "rep", "id": rid, "a": None, "t": "unreadable"})],
                encode_batch(0, [encode_reply(rid, "forged in an envelope")]),
            ]
            for frames in forged:
                await rogue.send(frames)
            await rogue.send(encode_reply(own, "the rogue's own"))
            assert await to_rogue == "the rogue's own"  # after every forged one: one pipe, in order
            assert not to_honest.done()
            assert client.counters.late_replies - late == 3 and client.counters.dropped - dropped == 1
            await honest.send(encode_reply(rid, "honest"))
            assert await to_honest == "honest"

    arun(main())


def test_another_peer_cannot_refuse_an_envelope_sent_elsewhere():
    async def main():
        async with _peers(2) as (client, (honest, rogue)):
            warm = [client.call(p.endpoint, "calc", "get", timeout=10) for p in (honest, rogue)]
            for p, fut in zip((honest, rogue), warm):
                await p.send(encode_reply((await p.request()).id, "up"))
                assert await fut == "up"
            lone = client.call(honest.endpoint, "calc", "get", timeout=10)
            held = [client.call(honest.endpoint, "calc", "get", timeout=10) for _ in range(2)]
            first = await honest.request()
            _, *envelope = await honest.sock.recv_multipart()
            bid = batch_id(envelope[0])
            assert bid is not None
            to_rogue = client.call(rogue.endpoint, "calc", "get", timeout=10)
            own = (await rogue.request()).id
            late = client.counters.late_replies
            await rogue.send(encode(error_message(bid, InvalidArgument("forged refusal of an envelope"))))
            await rogue.send(encode_reply(own, "own"))
            assert await to_rogue == "own"
            assert client.peer(honest.endpoint).batching  # not turned to one by one, nothing sent again
            assert client.counters.late_replies - late == 1
            await honest.send(encode_reply(first.id, 0))
            for i, entry in enumerate(decode_batch(envelope).entries):
                await honest.send(encode_reply(decode(entry).id, i + 1))
            assert [await lone, *[await f for f in held]] == [0, 1, 2]

    arun(main())
