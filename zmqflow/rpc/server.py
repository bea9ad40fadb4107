"""Incoming calls: a ROUTER that decodes, dispatches to services, and always answers.

Whatever a client sends, the server keeps serving: a message that cannot be decoded, names an
unknown service or op, or has bad arguments gets an error reply when its request id can be read,
and is dropped and counted when it cannot. Short handlers run inline on the loop; handlers that
return a coroutine run as tasks, cancelled at the request's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import zmq

from ..errors import AddressInUse, DeadlineExceeded, NotFound, Unavailable
from ..transport.channel import Channel
from ..transport.context import context
from ..transport.options import DEFAULT_OPTIONS, SocketOptions, apply_router
from ..wire import REPLY, REQUEST, DecodeError, Limits, Message, decode, encode, error_message
from ..wire.codec import DEFAULT_LIMITS
from .counters import Counters, frames_nbytes
from .service import CallContext, Service

__all__ = ["RpcServer", "REPLY_GRACE"]

log = logging.getLogger(__name__)

# How long a reply may wait for room in a slow client's pipe when the request had no deadline.
REPLY_GRACE = 5.0
# libzmq releases an address a moment after its socket closes (its I/O thread does it), so a
# server restarted in the same process may find its address still taken: it retries this long.
# Inproc names always; other addresses only when this process released them just now.
REBIND_S = 1.0
_released: dict[str, float] = {}  # endpoint -> when this process closed a server bound to it


class RpcServer:
    """Serves ``services`` on a bound ROUTER socket."""

    def __init__(
        self,
        bind_endpoint: str,
        services: Mapping[str, Service],
        *,
        name: str,
        loop: asyncio.AbstractEventLoop | None = None,
        limits: Limits = DEFAULT_LIMITS,
        options: SocketOptions = DEFAULT_OPTIONS,
        counters: Counters | None = None,
    ):
        self.bind_endpoint = bind_endpoint
        self.services = dict(services)
        self.name = name
        self.limits = limits
        self.options = options
        self.counters = counters if counters is not None else Counters()
        self._loop = loop or asyncio.get_running_loop()
        self._channel: Channel | None = None
        self._tasks: set[asyncio.Task] = set()
        self.endpoint = bind_endpoint

    async def start(self) -> None:
        sock = context().socket(zmq.ROUTER)
        apply_router(sock, self.options)
        released = _released.get(self.bind_endpoint)
        rebind = self.bind_endpoint.startswith("inproc://") or (
            released is not None and time.monotonic() - released < REBIND_S)
        until = self._loop.time() + (REBIND_S if rebind else 0.0)
        while True:
            try:
                sock.bind(self.bind_endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and self._loop.time() < until:
                    await asyncio.sleep(0.01)
                    continue
                sock.close(linger=0)
                if exc.errno == zmq.EADDRINUSE:
                    raise AddressInUse(f"address {self.bind_endpoint} for {self.name} is in use", task=self.name) from None
                raise Unavailable(f"cannot bind {self.bind_endpoint} for {self.name}: {exc}", task=self.name) from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.bind_endpoint
        self._channel = Channel(sock, self._on_request, self._loop, name=f"router {self.name}", copied=2)

    # receiving --------------------------------------------------------------------------
    def _on_request(self, frames: list[Any]) -> None:
        counters = self.counters
        counters.msgs_in += 1
        counters.bytes_in += sum(map(len, frames))
        identity = frames[0]
        try:
            msg = decode(frames[1:], self.limits)
        except DecodeError as exc:
            if exc.request_id is not None and exc.kind in (REQUEST, None):
                self._reply_error(identity, exc.request_id, exc, None)
            else:
                counters.dropped += 1
                log.warning("%s dropped an unreadable message: %s", self.name, exc)
            return
        if msg.kind != REQUEST:
            counters.dropped += 1
            return
        deadline = None if msg.deadline is None else self._loop.time() + msg.deadline
        ctx = CallContext(msg.service, msg.op, identity, msg.source, deadline)
        try:
            service = self.services.get(msg.service)
            if service is None:
                raise NotFound(f"task {self.name} has no service {msg.service!r} (services: {', '.join(sorted(self.services))})")
            service.admit(ctx)
            call = service.find_op(msg.op).bind(msg.service, msg.op, ctx, msg.body)
            result = call()
        except Exception as exc:
            self._reply_error(identity, msg.id, exc, deadline)
            return
        if asyncio.iscoroutine(result):
            task = self._loop.create_task(self._run_async(identity, msg.id, result, ctx))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._reply(identity, Message(REPLY, msg.id, body=result), deadline)

    async def _run_async(self, identity: bytes, rid: int, coro: Any, ctx: CallContext) -> None:
        try:
            if ctx.deadline is None:
                result = await coro
            else:
                timer = asyncio.timeout_at(ctx.deadline)
                try:
                    async with timer:
                        result = await coro
                except TimeoutError:
                    if not timer.expired():  # the handler's own error (ClusterNotReady is a TimeoutError)
                        raise
                    raise DeadlineExceeded(f"{ctx.service}.{ctx.op} on {self.name} ran past its deadline", task=self.name) from None
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._reply_error(identity, rid, exc, ctx.deadline)
            return
        self._reply(identity, Message(REPLY, rid, body=result), ctx.deadline)

    # replying ---------------------------------------------------------------------------
    def _reply_error(self, identity: bytes, rid: int, exc: BaseException, deadline: float | None) -> None:
        self.counters.errors += 1
        self._reply(identity, error_message(rid, exc, source=self.name), deadline)

    def _reply(self, identity: bytes, msg: Message, deadline: float | None) -> None:
        channel = self._channel
        if channel is None or channel.closed:
            return
        try:
            frames = [identity, *encode(msg)]
        except Exception as exc:  # a result that cannot be encoded is the handler's error
            self.counters.errors += 1
            frames = [identity, *encode(error_message(msg.id, exc, source=self.name))]
        try:
            sent = channel.try_send(frames)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the requester is gone (ROUTER_MANDATORY)
            self.counters.undeliverable += 1
            log.debug("%s: reply %d undeliverable: %s", self.name, msg.id, exc)
            return
        if sent:
            self._count_out(frames)
            return
        until = deadline if deadline is not None else self._loop.time() + REPLY_GRACE
        task = self._loop.create_task(self._reply_later(frames, until))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply_later(self, frames: list[Any], until: float) -> None:
        try:
            sent = await self._channel.send(frames, until) if self._channel else False
        except zmq.ZMQError:
            sent = False
        if sent:
            self._count_out(frames)
        else:
            self.counters.undeliverable += 1

    def reachable(self, identity: bytes) -> bool:
        """Whether the client with this routing id is still connected. ROUTER_MANDATORY refuses a
        message to a peer that is gone; the probe (a reply to request 0) is ignored by clients."""
        if self._channel is None or self._channel.closed:
            return False
        try:
            self._channel.try_send([identity, *encode(Message(REPLY, 0, body=None))])
        except zmq.ZMQError:
            return False
        return True

    def _count_out(self, frames: list[Any]) -> None:
        self.counters.msgs_out += 1
        self.counters.bytes_out += frames_nbytes(frames)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            self._channel.close()
            now = time.monotonic()
            for endpoint in [e for e, t in _released.items() if now - t >= REBIND_S]:
                del _released[endpoint]
            _released[self.bind_endpoint] = now
