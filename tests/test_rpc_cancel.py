"""A call its caller cancels ends: it leaves the client's calls in flight and nothing of it goes
out again (no retry, no send that was waiting for the connection, no place in an envelope), so a
cancelled request that is not idempotent is not applied later. Over real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import itertools

import zmq
import zmq.asyncio

from zmqflow.rpc import RpcClient
from zmqflow.testing import async_wait_until, free_port
from zmqflow.wire import Message, decode, encode_reply

from .conftest import arun

_names = itertools.count()


def _router(endpoint: str) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


async def _request(sock: zmq.asyncio.Socket) -> tuple[bytes, Message]:
    client_id, *frames = await sock.recv_multipart()
    return client_id, decode(frames)


def test_a_cancelled_call_is_not_retried():
    async def main():
        ep = f"tcp://127.0.0.1:{free_port()}"
        sock = _router(ep)
        client = RpcClient(identity=f"cancel-{next(_names)}", retry_interval=0.05, coalesce=False)
        try:
            cancelled = client.call(ep, "ps", "push", {"x": 1}, timeout=20)
            rid = (await _request(sock))[1].id
            assert (await _request(sock))[1].id == rid  # retried while it is live
            cancelled.cancel()
            await async_wait_until(lambda: rid not in client.peer(ep).inflight, 5, what="the cancelled call ending")
            later = client.call(ep, "ps", "push", {"x": 2}, timeout=20)
            while (msg := (await _request(sock))[1]).id == rid:
                pass  # sent before it ended: one pipe, in order, so all of it comes before the next call
            rid2 = msg.id
            for _ in range(3):  # three retries of the next call: the cancelled one would have gone again meanwhile
                client_id, msg = await _request(sock)
                assert msg.id == rid2
            await sock.send_multipart([client_id, *encode_reply(rid2, "done")])
            assert await later == "done"
        finally:
            client.close()
            sock.close(linger=0)

    arun(main())


def test_a_cancelled_call_waiting_for_its_peer_is_never_sent():
    async def main():
        ep = f"tcp://127.0.0.1:{free_port()}"
        client = RpcClient(identity=f"cancel-{next(_names)}", coalesce=False)
        sock = None
        try:
            cancelled = client.call(ep, "ps", "push", {"x": 1}, timeout=20)  # nobody listens: its send waits
            await asyncio.sleep(0)  # one loop step: its send starts waiting for the connection
            assert client.peer(ep).inflight
            cancelled.cancel()
            await async_wait_until(lambda: not client.peer(ep).inflight, 5, what="the cancelled call ending")
            sock = _router(ep)
            for value in ("first", "second"):
                later = client.call(ep, "ps", "push", {"x": 2}, timeout=20)
                client_id, msg = await _request(sock)
                assert msg.body == {"x": 2}  # the cancelled push never arrives
                await sock.send_multipart([client_id, *encode_reply(msg.id, value)])
                assert await later == value
        finally:
            client.close()
            if sock is not None:
                sock.close(linger=0)

    arun(main())


def test_a_call_cancelled_while_held_for_an_envelope_is_left_out_of_it():
    async def main():
        ep = f"tcp://127.0.0.1:{free_port()}"
        sock = _router(ep)
        client = RpcClient(identity=f"cancel-{next(_names)}")
        try:
            warm = client.call(ep, "calc", "get", timeout=10)
            client_id, msg = await _request(sock)
            await sock.send_multipart([client_id, *encode_reply(msg.id, "up")])
            assert await warm == "up"
            lone = client.call(ep, "calc", "get", {"n": 0}, timeout=10)  # out at once, alone
            held = client.call(ep, "calc", "get", {"n": 1}, timeout=10)  # held for the tick
            kept = client.call(ep, "calc", "get", {"n": 2}, timeout=10)
            held.cancel()
            for want, fut in ((0, lone), (2, kept)):
                client_id, msg = await _request(sock)  # a lone request each: no envelope of two
                assert msg.body == {"n": want}
                await sock.send_multipart([client_id, *encode_reply(msg.id, want)])
                assert await fut == want
            assert not client.peer(ep).inflight and client.batches_out == 0
        finally:
            client.close()
            sock.close(linger=0)

    arun(main())
