"""In-process delivery without sockets: the base the fault injector wraps, and a reference for the contract.

A ``LocalTransport`` is one private network: endpoints are names in its table, and a message is
handed over on the loop (``call_soon``, so order per connection holds and no handler runs inside a
send). It behaves as the ZeroMQ transport does where the RPC layer can tell: a connection is up
while its listener is bound, goes down when the listener closes and comes back up when the name is
bound again (a restart); a send to an absent peer is refused (as IMMEDIATE does); a reply to an
identity that has no connection raises SendFailed (as ROUTER_MANDATORY does); the newest
connection of an identity takes its replies (ROUTER_HANDOVER). Frames below the copy threshold are
copied; bigger buffers are handed over zero-copy, as inproc ZeroMQ does: the receiver shares the
sender's memory, so a sender must not change a buffer it has sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ..errors import AddressInUse
from .base import CONNECTING, DOWN, UP, OnFrames, OnState, SendFailed
from .options import SocketOptions

__all__ = ["LocalTransport", "LocalListener", "LocalConnection"]


def _handover(frames: Sequence[Any], threshold: int) -> list[Any]:
    out = []
    for f in frames:
        view = memoryview(f)
        out.append(bytes(view) if view.nbytes < threshold else view.cast("B"))
    return out


class LocalListener:
    """A bound name in a LocalTransport."""

    def __init__(self, net: "LocalTransport", endpoint: str, on_frames: OnFrames, loop: asyncio.AbstractEventLoop, threshold: int):
        self.endpoint = endpoint
        self._net = net
        self._on_frames = on_frames
        self._loop = loop
        self._threshold = threshold
        self._closed = False
        self.peers: dict[bytes, LocalConnection] = {}  # identity -> the newest live connection

    @property
    def closed(self) -> bool:
        return self._closed

    def deliver(self, frames: list[Any]) -> None:
        if not self._closed:
            self._on_frames(frames)

    def try_send(self, frames: Sequence[Any]) -> bool:
        if self._closed:
            raise SendFailed(f"listener {self.endpoint} is closed")
        conn = self.peers.get(bytes(frames[0]))
        if conn is None:
            raise SendFailed(f"{self.endpoint}: no peer {bytes(frames[0])!r} is connected")
        self._loop.call_soon(conn.deliver, self, _handover(frames[1:], self._threshold))
        return True

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        return self.try_send(frames)  # local pipes have no high-water mark: never full

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._net.unbind(self)
        for conn in list(self.peers.values()):
            conn.lost(self)
        self.peers.clear()


class LocalConnection:
    """One identity's connection to a name; follows the name across re-binds."""

    monitored = True

    def __init__(self, net: "LocalTransport", endpoint: str, identity: bytes, on_frames: OnFrames, on_state: OnState,
                 loop: asyncio.AbstractEventLoop, threshold: int):
        self.endpoint = endpoint
        self.identity = identity
        self._net = net
        self._on_frames = on_frames
        self._on_state = on_state
        self._loop = loop
        self._threshold = threshold
        self._listener: LocalListener | None = None
        self._state = CONNECTING
        self._up = asyncio.Event()
        self._closed = False

    @property
    def state(self) -> str:
        return self._state

    def attach(self, listener: LocalListener) -> None:
        """The name is bound (now or again): connect, and say so once the handshake would be done."""
        self._listener = listener
        listener.peers[self.identity] = self
        self._loop.call_soon(self._announce, listener)

    def _announce(self, listener: LocalListener) -> None:
        if self._listener is listener and not self._closed:
            self._state = UP
            self._up.set()
            self._on_state(UP)

    def lost(self, listener: LocalListener) -> None:
        if self._listener is not listener:
            return
        self._listener = None
        self._up.clear()
        if self._state == UP:
            self._state = DOWN
            self._loop.call_soon(self._report_down)

    def _report_down(self) -> None:
        if not self._closed and self._state == DOWN:
            self._on_state(DOWN)

    def deliver(self, listener: LocalListener, frames: list[Any]) -> None:
        if self._listener is listener and not self._closed:  # a reply from before a drop is lost with it
            self._on_frames(frames)

    def try_send(self, frames: Sequence[Any]) -> bool:
        if self._closed:
            raise SendFailed(f"connection to {self.endpoint} is closed")
        listener = self._listener
        if listener is None or self._state != UP:
            return False
        self._loop.call_soon(listener.deliver, [self.identity, *_handover(frames, self._threshold)])
        return True

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        while not self.try_send(frames):
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._up.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def refresh(self) -> bool:
        return False  # it follows re-binds by itself

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._up.clear()
        self._net.forget(self)
        listener, self._listener = self._listener, None
        if listener is not None and listener.peers.get(self.identity) is self:
            del listener.peers[self.identity]


class LocalTransport:
    """A private in-process network of names (any endpoint string is a name)."""

    def __init__(self) -> None:
        self._listeners: dict[str, LocalListener] = {}
        self._connections: dict[str, list[LocalConnection]] = {}

    async def listen(
        self, endpoint: str, on_frames: OnFrames, *, loop: asyncio.AbstractEventLoop, options: SocketOptions, name: str
    ) -> LocalListener:
        if endpoint in self._listeners:
            raise AddressInUse(f"address {endpoint} for {name} is in use", task=name)
        listener = LocalListener(self, endpoint, on_frames, loop, options.copy_threshold)
        self._listeners[endpoint] = listener
        for conn in self._connections.get(endpoint, []):
            conn.attach(listener)
        return listener

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
    ) -> LocalConnection:
        conn = LocalConnection(self, endpoint, identity, on_frames, on_state, loop, options.copy_threshold)
        self._connections.setdefault(endpoint, []).append(conn)
        listener = self._listeners.get(endpoint)
        if listener is not None:
            conn.attach(listener)
        return conn

    def unbind(self, listener: LocalListener) -> None:
        if self._listeners.get(listener.endpoint) is listener:
            del self._listeners[listener.endpoint]

    def forget(self, conn: LocalConnection) -> None:
        conns = self._connections.get(conn.endpoint, [])
        if conn in conns:
            conns.remove(conn)
        if not conns:
            self._connections.pop(conn.endpoint, None)

    def open_count(self) -> tuple[int, int]:
        """(listeners, connections) still open: close must leave (0, 0)."""
        return len(self._listeners), sum(map(len, self._connections.values()))
