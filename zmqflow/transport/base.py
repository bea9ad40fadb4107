"""The transport seam: what the RPC layer needs from a network, and nothing more.

The RPC layer talks to two kinds of endpoint. A ``Listener`` is router-like: it is bound to an
address, receives ``[peer identity, *frames]`` and sends to a peer by putting its identity first.
A ``Connection`` is dealer-like: it sends frames to one listener, receives that listener's replies,
and reports when the connection goes up or down (as a socket monitor does). A ``Transport`` makes
both. ZeroMQ (tcp, ipc, inproc) is one; an in-process one and a fault-injecting wrapper serve tests.

Both sides send with ``try_send`` (never blocks: False when the peer's pipe is full or not
connected) and ``send`` (waits for room until a loop-time deadline). A message that can never be
delivered on that path (an unroutable identity, a closed endpoint) raises ``SendFailed``. The
implementations bind these to their fastest callable once, so the seam costs nothing per message.

Security is optional and ZeroMQ's alone (CurveZMQ, :mod:`.curve`): ``listen(..., security=
CurveServer)`` makes a listener that admits only listed keys and calls ``on_frames(frames, user)``
with the sender's authenticated ``role/name``; ``connect(..., security=CurveClient)`` presents a
key, and a connection whose handshake the peer refuses reports ``AUTH_FAILED``. Callers pass
``security`` only when they have keys, so transports without it (in-process ones) keep their
signatures, and a plaintext listener's callback keeps its one argument.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .options import SocketOptions

__all__ = ["CONNECTING", "UP", "DOWN", "AUTH_FAILED", "SendFailed", "Listener", "Connection", "Transport", "OnFrames", "OnState"]

CONNECTING, UP, DOWN = "connecting", "up", "down"
AUTH_FAILED = "auth-failed"  # the peer refused our key, or only one side uses keys: no message passes

OnFrames = Callable[[list[Any]], None]
"""Called with each received message; a listener's first frame is the sender's identity."""
OnState = Callable[[str], None]
"""Called with ``UP``, ``DOWN`` or ``AUTH_FAILED`` when a connection's state changes (may repeat a state)."""


class SendFailed(ConnectionError):
    """The message cannot be delivered on this path: the peer is gone or the endpoint is closed.

    A full pipe is not this (``try_send`` returns False for it): waiting may help there, not here.
    """


@runtime_checkable
class Listener(Protocol):
    """A bound router-like endpoint. Messages in and out are ``[identity, *frames]``."""

    endpoint: str
    """The address actually bound (a tcp port chosen by the system is filled in)."""

    try_send: Callable[[Sequence[Any]], bool]
    """Queue a message for ``frames[0]``; False when its pipe is full; SendFailed when it is gone."""

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        """``try_send`` until it succeeds or the loop's clock passes ``deadline`` (then False)."""
        ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """Stop receiving and release the address; idempotent."""
        ...


@runtime_checkable
class Connection(Protocol):
    """A dealer-like connection from one client identity to one listener's endpoint."""

    try_send: Callable[[Sequence[Any]], bool]
    """Queue a message; False while the peer is not connected or its pipe is full."""

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        """``try_send`` until it succeeds or the loop's clock passes ``deadline`` (then False)."""
        ...

    @property
    def monitored(self) -> bool:
        """Whether drops are reported through ``on_state`` (inproc ZeroMQ has no connection events)."""
        ...

    @property
    def state(self) -> str:
        """``CONNECTING``, ``UP``, ``DOWN`` or ``AUTH_FAILED`` now (not hot-path: it may ask the socket)."""
        ...

    def refresh(self) -> bool:
        """Replace a connection that cannot recover by itself (an inproc one to a re-bound name).

        True when a fresh connection was opened: what was in flight on the old one is lost, so the
        caller does this only when nothing is. False where the transport reconnects on its own.
        """
        ...

    def close(self) -> None:
        """Drop the connection and whatever it still queues; idempotent, never calls on_state."""
        ...


class Transport(Protocol):
    """Makes listeners and connections for endpoints of the schemes it is registered for. One may
    set ``envelopes = False`` to have RPC clients send each request alone, never in a batch."""

    async def listen(
        self, endpoint: str, on_frames: OnFrames, *, loop: asyncio.AbstractEventLoop, options: SocketOptions, name: str
    ) -> Listener:
        """Bind ``endpoint``; raise AddressInUse when it is taken, Unavailable when it cannot be bound."""
        ...

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
    ) -> Connection:
        """Start connecting to ``endpoint`` as ``identity``; returns at once (the peer may be absent)."""
        ...
