"""What any peer may send a server and see refused cheaply, over real ZeroMQ sockets: argument
names that are not strings (a msgpack bin key) are the caller's error, not the server's, and a
refusal quotes the peer's field briefly, however large it was."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from zmqflow.rpc import CallContext, RpcServer, Service, op
from zmqflow.testing import free_port
from zmqflow.wire import ERROR, REPLY, Message, decode
from zmqflow.wire.requests import OPEN

from .conftest import arun

_names = itertools.count()


class _Open(Service):
    name = "open"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    @op(OPEN)
    def echo(self, ctx: CallContext, **values: Any) -> dict[str, Any]:
        self.runs += 1
        return values

    @op
    def broken(self, ctx: CallContext, **values: Any) -> None:
        self.runs += 1
        raise TypeError("a bug in the handler")


@asynccontextmanager
async def _served() -> AsyncIterator[tuple[RpcServer, _Open, Any]]:
    ep = f"tcp://127.0.0.1:{free_port()}"
    service = _Open()
    server = RpcServer(ep, {"open": service}, name="open:0")
    await server.start()
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"refused-{next(_names)}".encode())
    sock.connect(ep)

    async def ask(fields: dict[str, Any], *tensors: bytes) -> Message:
        head = {"v": 1, "k": "req", "id": 7, "svc": "open", "op": "echo", "a": None, "t": [], **fields}
        await sock.send_multipart([msgpack.packb(head, use_bin_type=True), *tensors])
        return decode(await sock.recv_multipart())

    try:
        yield server, service, ask
    finally:
        sock.close(linger=0)
        await server.close()


def test_argument_names_that_are_not_strings_are_refused_naming_the_op_and_the_name(caplog):
    async def main():
        async with _served() as (server, service, ask):
            with caplog.at_level(logging.WARNING, logger="zmqflow.rpc.server"):
                for rid, key in enumerate((b"x", b"k" * 100_000, b"\xff"), start=1):  # msgpack map keys: str or bin
                    got = await ask({"id": rid, "a": {"fine": 1, key: 2}})
                    assert got.kind == ERROR and got.error["code"] == "INVALID_ARGUMENT", got.error
                    message = got.error["message"]
                    assert message.startswith("open.echo: argument names must be strings") and len(message) < 160
                    assert repr(key)[:20] in message
                assert service.runs == 0 and server.counters.errors == 3
                assert not caplog.records  # the caller's error: no traceback logged, no task error noted
                assert (await ask({"id": 4, "a": {"fine": 1}})).body == {"fine": 1}
                bug = await ask({"id": 5, "op": "broken", "a": {"fine": 1}})
                assert bug.error["code"] == "INTERNAL" and service.runs == 2  # a handler's own TypeError stays one

    arun(main())


def test_an_error_reply_does_not_grow_with_the_field_it_refuses():
    async def main():
        async with _served() as (_server, _service, ask):
            shape = await ask({"a": msgpack.ExtType(1, bytes(4)), "t": [["float32", [0] * 1_000_000, 1]]}, b"")
            kind = await ask({"k": "\u00e9" * 1_000_000})
            for got in (shape, kind):
                assert got.kind == ERROR and got.id == 7 and len(got.error["message"]) < 300
            assert "shape" in shape.error["message"] and "kind" in kind.error["message"]
            assert (await ask({"id": 8, "a": {"x": 1}})).kind == REPLY  # still serving

    arun(main())
