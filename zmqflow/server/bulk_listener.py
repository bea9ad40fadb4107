"""A task's bulk listener: where sessions open the bulk streams (:mod:`zmqflow.transport.bulk`)
that their large pulls come back on and their large pushes go out on.

A stream is opened only with a token this task issued, over its ZeroMQ router, to the caller that
asked (``offer``): single use, expiring, and bound to that caller's name, so a request naming the
stream must come from the same caller (with keys, its authenticated key). A stream goes one way:
a pull stream carries transfers to its client (:mod:`.bulk_send`), a push stream from it
(:mod:`.bulk_receive`). Everything a peer can make it hold is capped: pending tokens, open
streams (in all, and per caller), connections still saying hello (each given ``hello_timeout``
to do so). A pull stream's peer sends nothing after its hello: one it closed (or sent anything
on) is dropped when the next stream is offered, or at the next sweep (every 10 s).

Where a task offers streams is the server's policy (:func:`bulk_host`): tcp only, and with keys
only on loopback, since the stream's bytes are not encrypted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from ..cluster import Address
from ..errors import ResourceExhausted, Unavailable
from ..transport.bulk import HELLO, MAGIC, OPENED, TOKEN_BYTES, Kind, bulk_enabled, family, recv_exact, tune
from .bulk_receive import PushConn
from .bulk_send import BulkConn
from ..transport.curve import is_loopback

__all__ = ["BulkListener", "bulk_host", "not_open"]

log = logging.getLogger("zmqflow.server.bulk")


class _Offer(NamedTuple):
    """A token issued and not yet presented."""

    owner: str
    handle: int
    expiry: float  # monotonic
    kind: Kind


def bulk_host(bind_endpoint: str, keys: object, default_transport: bool) -> str | None:
    """The host a task's bulk listener binds (the router's), or None where it offers none: not
    tcp, a transport other than ZeroMQ's own (a test's faults would be bypassed), keys beyond
    loopback (the bytes would cross a network in the clear), or ``ZMQFLOW_BULK=0``."""
    if not bulk_enabled() or not default_transport or not bind_endpoint.startswith("tcp://"):
        return None
    if keys is not None and not is_loopback(bind_endpoint):
        return None
    host = Address.parse(bind_endpoint).host
    return "0.0.0.0" if host == "*" else host


def not_open(handle: int, what: str) -> Unavailable:
    """A request naming a stream this task does not hold. Handles are unguessable, so its caller
    was given it: the task closed it (a transfer past its deadline, a stop) before the caller saw
    the close. Unavailable, not NotFound, and naming it (``bulk_stream``): the caller closes its end
    and its next transfer opens a new stream, or goes over ZeroMQ."""
    return Unavailable(f"bulk stream {handle} is not open {what}", bulk_stream=handle)


class BulkListener:
    """Listens on ``host`` at a port the OS picks; :meth:`offer` issues tokens, :meth:`conn`
    finds a caller's open stream."""

    def __init__(self, host: str, *, max_streams: int = 256, max_pending: int = 64, per_owner: int = 16,
                 token_ttl: float = 30.0, hello_timeout: float = 5.0, sweep_every: float = 10.0):
        self.host = host
        self.sweep_every = sweep_every
        self.max_streams, self.max_pending, self.per_owner = max_streams, max_pending, per_owner
        self.token_ttl, self.hello_timeout = token_ttl, hello_timeout
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._sweeping: asyncio.Task | None = None
        self._pending: dict[bytes, _Offer] = {}  # by token
        self._pool = ThreadPoolExecutor(max_streams, thread_name_prefix="zmqflow-bulk")
        self._conns: dict[int, BulkConn | PushConn] = {}
        self._hellos: set[asyncio.Task] = set()
        self.opened = 0  # streams opened, for metrics and tests
        self.refused = 0  # connections closed for a bad or missing hello, or over a cap

    @property
    def held(self) -> int:
        """Streams this listener holds (open, or closed by their client and not yet pruned)."""
        return len(self._conns)

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("bulk listener is not started")
        return self._sock.getsockname()[1]

    async def start(self) -> "BulkListener":
        sock = socket.socket(family(self.host), socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(self.max_streams)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock))
        self._sweeping = asyncio.get_running_loop().create_task(self._sweep())
        return self

    def _prune(self) -> float:
        """Forget expired tokens and streams their clients closed (their sockets with them);
        returns the time it looked."""
        now = time.monotonic()
        for token in [t for t, o in self._pending.items() if o.expiry <= now]:
            del self._pending[token]
        for handle in [h for h, c in self._conns.items() if c.gone()]:
            del self._conns[handle]
        return now

    async def _sweep(self) -> None:
        """Prune every ``sweep_every`` seconds, so a closed session's streams do not hold their
        sockets until the next offer."""
        while True:
            await asyncio.sleep(self.sweep_every)
            self._prune()

    def offer(self, owner: str, kind: Kind = "pull") -> tuple[int, bytes]:
        """A new stream's handle and the token that opens it, for ``owner`` only."""
        now = self._prune()
        if len(self._pending) >= self.max_pending or len(self._conns) >= self.max_streams:
            raise ResourceExhausted(f"bulk streams: {len(self._conns)} open and {len(self._pending)} pending, "
                                    f"at the cap of {self.max_streams} open and {self.max_pending} pending")
        mine = sum(c.owner == owner for c in [*self._conns.values(), *self._pending.values()])
        if mine >= self.per_owner:
            raise ResourceExhausted(f"bulk streams: {owner!r} holds {mine} open or pending, "
                                    f"the cap of {self.per_owner}")
        handle, token = self._new_handle(), secrets.token_bytes(TOKEN_BYTES)
        self._pending[token] = _Offer(owner, handle, now + self.token_ttl, kind)
        return handle, token

    def _new_handle(self) -> int:
        """Unguessable, as the token: a request naming a stream names one its caller was given."""
        while True:
            handle = secrets.randbits(62)
            if handle not in self._conns and all(o.handle != handle for o in self._pending.values()):
                return handle

    def conn(self, handle: int, owner: str) -> BulkConn:
        """The open pull stream ``handle`` of ``owner``: Unavailable for one it does not hold."""
        c = self._conns.get(handle)
        if not isinstance(c, BulkConn) or c.closed or c.owner != owner:
            raise not_open(handle, f"for {owner!r} to pull on")
        return c

    def push_conn(self, handle: int, owner: str) -> PushConn:
        """The open push stream ``handle`` of ``owner``: Unavailable for one it does not hold."""
        c = self._conns.get(handle)
        if not isinstance(c, PushConn) or c.closed or c.owner != owner:
            raise not_open(handle, f"for {owner!r} to push on")
        return c

    async def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(lsock)
            except OSError as exc:  # out of descriptors, say: the next accept may do
                log.warning("bulk listener: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._hellos) >= self.max_pending or len(self._conns) >= self.max_streams:
                self.refused += 1
                sock.close()
                continue
            task = loop.create_task(self._hello(sock))
            self._hellos.add(task)
            task.add_done_callback(self._hellos.discard)

    async def _hello(self, sock: socket.socket) -> None:
        try:
            tune(sock)
            magic, token = HELLO.unpack(await asyncio.wait_for(recv_exact(sock, HELLO.size), self.hello_timeout))
        except (OSError, TimeoutError, ConnectionError):
            magic, token = b"", b""
        except asyncio.CancelledError:
            sock.close()
            raise
        offer = self._pending.pop(token, None) if magic == MAGIC else None
        if offer is None or offer.expiry <= time.monotonic() or len(self._conns) >= self.max_streams:
            self.refused += 1
            sock.close()
            return
        owner, handle, kind = offer.owner, offer.handle, offer.kind
        # registered before its word, which a request naming it may follow at once
        c: BulkConn | PushConn
        if kind == "push":  # read on the loop, a chunk at a time, once the loop's transport has it
            c = self._conns[handle] = PushConn(handle, owner, sock)
        else:  # blocking once open: its sends run on the pool's threads
            c = self._conns[handle] = BulkConn(handle, owner, sock, self._pool)
        try:
            await asyncio.get_running_loop().sock_sendall(sock, OPENED)
            if isinstance(c, PushConn):
                await c.open()
        except (OSError, asyncio.CancelledError) as exc:
            self._conns.pop(handle, None)
            c.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if kind == "pull":
            sock.settimeout(None)
        self.opened += 1

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, self._sweeping, *self._hellos) if t is not None]
        for c in list(self._conns.values()):
            c.close()
        self._conns.clear()
        self._pending.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False)  # a thread still sending fails at once on its shut socket
        if self._sock is not None:
            self._sock.close()
            self._sock = None
