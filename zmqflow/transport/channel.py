"""A ZeroMQ socket driven by an asyncio loop without pyzmq's per-message futures.

The socket is an ordinary (blocking-API) socket. The loop watches its FD; when it fires we drain
every ready message with NOBLOCK and hand each to a callback. That is several times faster than
``await sock.recv_multipart()`` for small messages. The ZeroMQ FD is edge-triggered, so after
each of our own sends we look at ``EVENTS`` and drain again if input slipped in unannounced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from .base import SendFailed

__all__ = ["Channel", "AuthChannel"]

log = logging.getLogger(__name__)

_MAX_BATCH = 256
# Plain ints: pyzmq's enum flags cost microseconds per bitwise operation on the hot path.
_POLLIN, _POLLOUT, _NOBLOCK, _EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK), int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_SNDMORE_NB = int(zmq.SNDMORE) | _NOBLOCK
# pyzmq's Cython-level send: send_multipart's Python wrapper costs ~5 us a message (enum flag
# arithmetic, per-part checks); this is the same call without it.
_send = getattr(zmq.backend.Socket, "send", zmq.Socket.send)


_RETRY_FIRST_S = 0.0005
_RETRY_MAX_S = 0.02


class Channel:
    """One socket on one loop: ``on_frames`` gets each received message; sends never block."""

    def __init__(
        self,
        sock: zmq.Socket,
        on_frames: Callable[[list[Any]], None],
        loop: asyncio.AbstractEventLoop,
        *,
        name: str = "",
        copied: int = 1,
    ):
        self.sock = sock
        self._threshold = sock.copy_threshold
        self._copied = copied
        self.name = name
        self._on_frames = on_frames
        self._loop = loop
        self._fd = sock.getsockopt(zmq.FD)
        self._closed = False
        self._drain_pending = False
        self._events_pending = False
        self._writable = asyncio.Event()
        loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # the FD may already be signalled from before we watched it

    @property
    def closed(self) -> bool:
        return self._closed

    def _schedule_drain(self) -> None:
        if not self._drain_pending and not self._closed:
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_pending = False
        sock = self.sock
        for _ in range(_MAX_BATCH):
            if self._closed:
                return
            try:
                # asking EVENTS first avoids raising (and building) a zmq.Again per drain
                events = sock.getsockopt(_EVENTS)
                if events & _POLLOUT:
                    self._writable.set()
                if not events & _POLLIN:
                    return
                frames = self._recv(sock)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                if not self._closed:
                    log.warning("%s: receive failed: %s", self.name, exc)
                return
            try:
                self._on_frames(frames)
            except Exception:  # a handler bug must not stop the socket
                log.exception("%s: message handler failed", self.name)
        else:
            self._schedule_drain()  # more may be waiting: let other callbacks run first
            return
        self._poll_events()

    def _recv(self, sock: zmq.Socket) -> list[Any]:
        """One multipart message: the leading ``copied`` frames (identity, header) as bytes, the
        rest (tensor data) as zero-copy Frames. Small bytes are cheaper to make than Frames."""
        frames: list[Any] = []
        for _ in range(self._copied):
            frames.append(sock.recv(_NOBLOCK))
            if not sock.getsockopt(_RCVMORE):
                return frames
        while True:
            frame = sock.recv(_NOBLOCK, copy=False)
            frames.append(frame)
            if not frame.more:
                return frames

    def _poll_events(self) -> None:
        if self._closed:
            return
        try:
            events = self.sock.getsockopt(_EVENTS)
        except zmq.ZMQError:
            return
        if events & _POLLOUT:
            self._writable.set()
        if events & _POLLIN:
            self._schedule_drain()

    def try_send(self, frames: Sequence[Any]) -> bool:
        """Send without blocking; False when the peer's pipe is full or not connected; SendFailed
        when it never can be (EHOSTUNREACH from a ROUTER_MANDATORY router, a closed channel)."""
        if self._closed:
            raise SendFailed(f"{self.name}: channel is closed")
        sock = self.sock
        last = len(frames) - 1
        threshold = self._threshold
        try:  # only the first part can be refused (HWM, unroutable): a message is queued whole or not at all
            # copy small frames (cheaper than pinning them; bytes have no nbytes), send big buffers zero-copy
            f = frames[0]
            _send(sock, f, _SNDMORE_NB if last else _NOBLOCK, getattr(f, "nbytes", 0) < threshold)
            for i in range(1, last + 1):
                f = frames[i]
                _send(sock, f, _SNDMORE_NB if i < last else _NOBLOCK, getattr(f, "nbytes", 0) < threshold)
        except zmq.Again:
            self._writable.clear()
            self._poll_events()
            return False
        except zmq.ZMQError as exc:  # costs nothing unless raised
            raise SendFailed(f"{self.name}: {exc}") from exc
        # A send may swallow the FD's edge for input that arrived meanwhile: look at EVENTS once
        # before the loop sleeps again, not after every send (a pipelined burst sends hundreds).
        if not self._events_pending:
            self._events_pending = True
            self._loop.call_soon(self._deferred_events)
        return True

    def _deferred_events(self) -> None:
        self._events_pending = False
        self._poll_events()

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        """Send, waiting (without blocking the loop) until ``deadline`` (loop time) at most."""
        delay = _RETRY_FIRST_S
        while True:
            if self.try_send(frames):
                return True
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            try:  # woken by the FD when the socket turns writable, else retried on a short backoff
                await asyncio.wait_for(self._writable.wait(), min(delay, remaining))
            except TimeoutError:
                pass
            delay = min(delay * 2, _RETRY_MAX_S)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.remove_reader(self._fd)
        except Exception:  # the loop may already be closed
            pass
        self.sock.close(linger=0)


class AuthChannel(Channel):
    """A CURVE router's channel: ``on_auth(frames, user)`` gets each message with the user id the
    ZAP handler gave its sender's key (read from the routing-id frame's ``User-Id`` property, which
    the sender cannot forge). Only keyed routers pay for the extra Frame."""

    def __init__(self, sock: zmq.Socket, on_auth: Callable[[list[Any], str], None], loop: asyncio.AbstractEventLoop,
                 *, name: str = "", copied: int = 2):
        self._user = ""
        super().__init__(sock, lambda frames: on_auth(frames, self._user), loop, name=name, copied=copied)

    def _recv(self, sock: zmq.Socket) -> list[Any]:
        first = sock.recv(_NOBLOCK, copy=False)
        try:
            self._user = first.get("User-Id")
        except zmq.ZMQError:  # no ZAP user id: never admitted as anyone (the RPC edge refuses it)
            self._user = ""
        frames: list[Any] = [first.bytes]
        more = first.more
        for _ in range(self._copied - 1):
            if not more:
                return frames
            frames.append(sock.recv(_NOBLOCK))
            more = sock.getsockopt(_RCVMORE)
        while more:
            frame = sock.recv(_NOBLOCK, copy=False)
            frames.append(frame)
            more = frame.more
        return frames
