"""The ZeroMQ transport: a ROUTER per listener, a DEALER (plus a monitor) per connection.

Each endpoint wraps a ``Channel`` and exposes the channel's own ``try_send`` and ``send`` as its
methods, so a message costs exactly what it cost before the seam existed. What ZeroMQ needs
beyond sockets lives here too: ROUTER_MANDATORY/HANDOVER and heartbeats (``options``), retried
binds of addresses this process released a moment ago, monitor events as connection state, and a
fresh socket for an inproc name that was bound again (inproc never reconnects by itself).

With ``security`` a listener is a CURVE server whose ZAP domain admits only its allow-list
(:mod:`.zap`) and hands ``on_frames(frames, user)`` the sender's authenticated name; a connection
is a CURVE client, and a handshake its peer refuses is reported as ``AUTH_FAILED``. inproc never
runs a handshake (it stays in this process), so there ``security`` changes nothing.

libzmq resolves a tcp host name when it connects, in its own I/O thread, and retries a name that
does not resolve every reconnect interval without a word. Pods start in any order and a peer's
DNS name exists only once its pod does, so a connection to a host name also asks the loop's
resolver (``loop.getaddrinfo``: a thread, never the loop) until the name resolves, logs at most
every ``RESOLVE_LOG_S`` that it does not yet, and names the host in ``unresolved`` for the caller's error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import socket
import time
import weakref
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import AddressInUse, Unavailable
from . import zap
from .base import AUTH_FAILED, CONNECTING, DOWN, UP, OnFrames, OnState
from .channel import AuthChannel, Channel
from .context import context
from .curve import CurveClient, CurveServer
from .options import SocketOptions, apply_dealer, apply_router

__all__ = ["ZmqTransport", "ZmqListener", "ZmqConnection", "REBIND_S", "RESOLVE_RETRY_S", "RESOLVE_LOG_S",
           "open_connections"]

log = logging.getLogger(__name__)

# libzmq releases an address a moment after its socket closes (its I/O thread does it), so a
# server restarted in the same process may find its address still taken: it retries this long.
# Inproc names always; other addresses only when this process released them just now.
REBIND_S = 1.0
_released: dict[str, float] = {}  # endpoint -> when this process closed a listener bound to it
RESOLVE_RETRY_S = 0.5  # how often a host name that does not resolve is looked up again
RESOLVE_LOG_S = 10.0  # at most one "does not resolve yet" line per host and port this often
_unresolved_logged: dict[str, float] = {}  # "host:port" -> loop time of its last log line
# The events a connection's state is read from, and no others: a peer that is away makes its
# connection retry every quarter second, and an event per retry (CLOSED, CONNECT_RETRIED) would say
# nothing the state does not.
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_monitor_ids = itertools.count()
_live: "weakref.WeakSet[ZmqConnection]" = weakref.WeakSet()  # not closed yet

# a refused key (ZAP said no), or a handshake that failed on security: one side has CURVE, the
# other not, or the keys do not match
_AUTH_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
# with CURVE, a server that cannot read our HELLO (we expected another server key) just hangs up
_CURVE_EVENTS = (*_AUTH_EVENTS, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_EVENTS, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLOUT)


def open_connections() -> list[str]:
    """The connections of this process not closed yet, by peer name: a test's leak check (one
    left open retries its peer for as long as the process lives)."""
    return sorted(c._name for c in list(_live))


class ZmqListener:
    """A bound ROUTER. ``try_send``/``send`` are its channel's (no layer in between)."""

    def __init__(self, channel: Channel, endpoint: str, bind_endpoint: str, domain: bytes | None = None):
        self.endpoint = endpoint
        self._domain = domain
        self._bind_endpoint = bind_endpoint
        self._channel = channel
        self._socket_file = _ipc_file(endpoint)
        self.try_send = channel.try_send
        self.send = channel.send

    @property
    def closed(self) -> bool:
        return self._channel.closed

    def close(self) -> None:
        if self._channel.closed:
            return
        self._channel.close()
        if self._socket_file is not None:
            _remove_ipc_file(*self._socket_file)
        if self._domain is not None:
            zap.unregister(self._domain)
        now = time.monotonic()
        for endpoint in [e for e, t in _released.items() if now - t >= REBIND_S]:
            del _released[endpoint]
        _released[self._bind_endpoint] = now


def _ipc_file(endpoint: str) -> tuple[str, int, int] | None:
    """(path, device, inode) of the socket file an ipc listener just bound; None for other
    transports, Linux's abstract names (``ipc://@name``) and a file that is gone already."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    path = os.path.abspath(endpoint[len("ipc://"):])
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_dev, st.st_ino


def _remove_ipc_file(path: str, dev: int, ino: int) -> None:
    """Remove a closed listener's socket file, which libzmq leaves behind, unless another socket
    has bound the path since (a new file there, not ours)."""
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except OSError:
        pass


class ZmqConnection:
    """A DEALER to one peer, its state from a socket monitor (inproc: from the pipe's room)."""

    def __init__(
        self,
        endpoint: str,
        identity: bytes,
        on_frames: OnFrames,
        on_state: OnState,
        loop: asyncio.AbstractEventLoop,
        options: SocketOptions,
        name: str,
        security: CurveClient | None = None,
    ):
        self.endpoint = endpoint
        self._security = security
        self._identity = identity
        self._on_frames = on_frames
        self._on_state = on_state
        self._loop = loop
        self._options = options
        self._name = name
        self._inproc = endpoint.startswith("inproc://")  # inproc has no connection events; up once bound
        self._state = CONNECTING
        # the peer's host name while it does not resolve (yet): why the peer is not up
        self.unresolved: str | None = None
        self._resolving: asyncio.Task | None = None
        self._open()

    def _open(self) -> None:
        sock = context().socket(zmq.DEALER)
        apply_dealer(sock, self._options, self._identity)
        if self._security is not None and not self._inproc:
            sock.curve_serverkey = self._security.server
            sock.curve_publickey = self._security.public
            sock.curve_secretkey = self._security.secret
        self._channel = Channel(sock, self._on_frames, self._loop, name=f"dealer->{self._name}", local=self._inproc,
                                max_parts=self._options.max_msg_parts)
        self.try_send = self._channel.try_send
        self.send = self._channel.send
        self._monitor: Channel | None = None
        if not self._inproc:
            self._monitor = Channel(_monitor(sock), self._on_monitor, self._loop, name=f"monitor->{self._name}", local=False)
        sock.connect(self.endpoint)
        _live.add(self)
        self._watch_name()

    def _watch_name(self) -> None:
        """Look the peer's host name up until it resolves (tcp names only, one watcher at a time)."""
        if self._resolving is not None and not self._resolving.done():
            return
        target = _named_host(self.endpoint)
        if target is not None:
            self._resolving = self._loop.create_task(self._resolve(*target))

    async def _resolve(self, host: str, port: int) -> None:
        where = f"{host}:{port}" if self._name == self.endpoint else f"{self._name} at {host}:{port}"
        while self._state in (CONNECTING, DOWN) and not self._channel.closed:
            try:
                await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                self.unresolved = host
                key, now = f"{host}:{port}", self._loop.time()
                if now - _unresolved_logged.get(key, -RESOLVE_LOG_S) >= RESOLVE_LOG_S:
                    _unresolved_logged[key] = now
                    log.warning("%s does not resolve yet; retrying (%s)", where, exc.strerror or exc)
                await asyncio.sleep(RESOLVE_RETRY_S)
                continue
            if self.unresolved is not None:
                log.info("%s resolves now", where)
                _unresolved_logged.pop(f"{host}:{port}", None)
            self.unresolved = None
            return

    def _on_monitor(self, frames: list[Any]) -> None:
        try:
            event = parse_monitor_message([bytes(f) for f in frames])["event"]
        except Exception:  # a malformed monitor frame is a libzmq matter; ignore it
            return
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._state = UP
            self._on_state(UP)
        elif event == zmq.EVENT_DISCONNECTED:
            if self._state is not AUTH_FAILED:  # the drop that follows a refusal is part of it
                self._state = DOWN
                self._on_state(DOWN)
                self._watch_name()  # a peer that comes back may come back under a name not yet published
        elif event in (_AUTH_EVENTS if self._security is None else _CURVE_EVENTS):
            self._state = AUTH_FAILED
            self._on_state(AUTH_FAILED)

    @property
    def monitored(self) -> bool:
        return not self._inproc

    @property
    def state(self) -> str:
        if self._inproc:
            if self._channel.closed:
                return DOWN
            return UP if self._channel.sock.getsockopt(_EVENTS) & _POLLOUT else DOWN
        return self._state

    def refresh(self) -> bool:
        if not self._inproc:
            return False
        self._close_sockets()
        self._open()
        return True

    def _close_sockets(self) -> None:
        _live.discard(self)
        if self._monitor is not None:
            try:
                self._channel.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close()
        self._channel.close()

    def close(self) -> None:
        if self._resolving is not None:
            self._resolving.cancel()
        self._close_sockets()


def _monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR that receives ``sock``'s ``_MONITOR_EVENTS``, its queue without a high-water mark.

    libzmq's I/O thread sends each event with a blocking send: were the queue bounded (pyzmq's
    ``get_monitor_socket`` keeps libzmq's 1000), a reader that stopped reading (its loop blocked or
    gone while the socket lives on) would stall that thread once the queue filled, and with it
    every tcp and ipc connection of the process. Unbounded, such a queue only grows."""
    endpoint = f"inproc://zmqflow.monitor.{os.getpid()}.{next(_monitor_ids)}"
    sock.monitor(endpoint, _MONITOR_EVENTS)
    reader = sock.context.socket(zmq.PAIR)
    reader.setsockopt(zmq.LINGER, 0)
    reader.setsockopt(zmq.RCVHWM, 0)  # before connecting: an inproc pipe takes its bound then
    reader.connect(endpoint)
    return reader


def _named_host(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a tcp endpoint that names its host (not an IP address), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host.split("%")[0])
        return None
    except ValueError:
        pass
    if host in ("", "*", "localhost") or not port.isdigit():
        return None
    return host, int(port)


class ZmqTransport:
    """tcp, ipc and inproc endpoints on the process's ZeroMQ context."""

    async def listen(
        self, endpoint: str, on_frames: OnFrames, *, loop: asyncio.AbstractEventLoop, options: SocketOptions, name: str,
        security: CurveServer | None = None,
    ) -> ZmqListener:
        sock = context().socket(zmq.ROUTER)
        apply_router(sock, options)
        domain = None
        if security is not None and not endpoint.startswith("inproc://"):
            sock.curve_server = 1
            sock.curve_publickey = security.public
            sock.curve_secretkey = security.secret
            try:
                domain = zap.register(security.allow)
            except BaseException:
                sock.close(linger=0)
                raise
            sock.zap_domain = domain
            if hasattr(zmq, "ZAP_ENFORCE_DOMAIN"):  # libzmq >= 4.3: no ZAP handler means refused, not admitted
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        released = _released.get(endpoint)
        rebind = endpoint.startswith("inproc://") or (released is not None and time.monotonic() - released < REBIND_S)
        until = loop.time() + (REBIND_S if rebind else 0.0)
        while True:
            try:
                sock.bind(endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and loop.time() < until:
                    await asyncio.sleep(0.01)
                    continue
                sock.close(linger=0)
                if domain is not None:
                    zap.unregister(domain)
                if exc.errno == zmq.EADDRINUSE:
                    raise AddressInUse(f"address {endpoint} for {name} is in use", task=name) from None
                raise Unavailable(f"cannot bind {endpoint} for {name}: {exc}", task=name) from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        local = endpoint.startswith("inproc://")
        if domain is not None:
            channel: Channel = AuthChannel(sock, on_frames, loop, name=f"router {name}",  # type: ignore[arg-type]
                                           copied=2, local=local, max_parts=options.max_msg_parts)
        else:
            channel = Channel(sock, on_frames, loop, name=f"router {name}", copied=2, local=local,
                              max_parts=options.max_msg_parts)
        return ZmqListener(channel, bound, endpoint, domain)

    def connect(
        self,
        endpoint: str,
        identity: bytes,
        on_frames: OnFrames,
        on_state: OnState,
        *,
        loop: asyncio.AbstractEventLoop,
        options: SocketOptions,
        name: str,
        security: CurveClient | None = None,
    ) -> ZmqConnection:
        return ZmqConnection(endpoint, identity, on_frames, on_state, loop, options, name, security)
