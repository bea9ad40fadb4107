"""A ZeroMQ socket driven by an asyncio loop without pyzmq's per-message futures.

The socket is an ordinary (blocking-API) socket. The loop watches its FD, which fires when libzmq
has commands for the socket (usually: a message arrived). Receiving is ``recv(NOBLOCK)`` straight
away: a receive that finds nothing processes libzmq's pending commands itself, so no ``EVENTS``
query (a ``poll`` syscall each) is asked per message. A wake-up takes one message and leaves one
deferred ``EVENTS`` look for later in the same loop pass; only when that look finds more input do
we drain: one message, a look, and past that until ``Again``. The ZeroMQ FD is edge-triggered and
a send may swallow its edge, so that same deferred look also covers every send made outside a
drain (one look per loop pass, however many messages were sent); sends made inside a drain are
covered by the drain's own next look or receive.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from . import sockops
from .base import SendFailed
from .options import DEFAULT_OPTIONS

__all__ = ["Channel", "AuthChannel"]

log = logging.getLogger(__name__)

_MAX_BATCH = 256
# Plain ints: pyzmq's enum flags cost microseconds per bitwise operation on the hot path.
_POLLIN, _POLLOUT, _NOBLOCK, _EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK), int(zmq.EVENTS)
_SNDMORE_NB = int(zmq.SNDMORE) | _NOBLOCK
# pyzmq's Cython-level send: send_multipart's Python wrapper costs ~5 us a message (enum flag
# arithmetic, per-part checks); this is the same call without it.
_send = getattr(zmq.backend.Socket, "send", zmq.Socket.send)
_Frame = zmq.Frame
_Msg = sockops.MSG or zmq.Frame  # a received frame's type through the C calls (sockops)
_ndarray = np.ndarray


_RETRY_FIRST_S = 0.0005
_RETRY_MAX_S = 0.02


def received_frame(buf: Any) -> Any:
    """The received frame (``zmq.Frame``, or ``sockops.MSG`` from the C calls) that ``buf`` (an
    array or memoryview) covers exactly, else None.

    pyzmq's send path (the C calls find the message themselves): sending that Frame shares
    libzmq's message (a reference count) where sending the array would pin it through pyzmq's
    zero-copy machinery, whose release wakes pyzmq's garbage-collector thread (and takes the GIL)
    once per message: echoed and forwarded tensors go out as the frame they came in as. Only a
    C-ordered view of the whole frame qualifies, so the bytes are the same.
    """
    base = buf
    while base.__class__ is _ndarray:
        if not base.flags.c_contiguous:
            return None
        base = base.base
    if base.__class__ is memoryview:
        if not base.c_contiguous:
            return None
        base = base.obj
    if base.__class__ is not _Frame and base.__class__ is not _Msg:
        return None
    return base if buf.nbytes == len(base) else None


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
        local: bool = True,
        max_parts: int = DEFAULT_OPTIONS.max_msg_parts,
    ):
        """``copied``: the leading parts of each message received as bytes (routing id, header).
        ``local``: the socket's peers may be in this process (inproc), so their zero-copy buffers
        may be freed in our calls (see ``zsock_c.h``); False only where every peer is elsewhere.
        ``max_parts``: the parts of a message kept; the rest are read and dropped."""
        if max_parts < max(1, copied):
            raise ValueError(f"max_parts must be at least {max(1, copied)}, got {max_parts}")
        self.sock = sock
        self._max_parts = max_parts
        self._threshold = sock.copy_threshold
        self._copied = copied
        self.name = name
        self._on_frames = on_frames
        self._loop = loop
        self._fd = sock.getsockopt(zmq.FD)
        # libzmq called from C on this socket's handle where it can be (sockops), else pyzmq's calls
        ops = sockops.ops()
        if ops is not None:
            handle = sock.underlying
            self._events: Callable[[], int] = functools.partial(ops.events, handle)
            self._csend: Callable[[Sequence[Any]], int] | None = functools.partial(ops.send, handle, self._threshold)
            self._take: Callable[[], list[Any] | None] = (
                functools.partial(ops.recv, handle, copied, local, max_parts) if type(self)._recv is Channel._recv
                else self._recv_or_none)
        else:
            self._events = functools.partial(sock.getsockopt, _EVENTS)
            self._csend = None
            self._take = self._recv_or_none
        self._closed = False
        self._drain_pending = False
        self._check_pending = False
        self._draining = False  # inside a receive loop: its next receive covers our sends' edges
        self._writable = asyncio.Event()
        self._full = True  # ``_writable`` is clear: set it at the next look that finds room (no call per look)
        loop.add_reader(self._fd, self._on_readable)
        self._schedule_check()  # the FD may already be signalled from before we watched it

    @property
    def closed(self) -> bool:
        return self._closed

    def _schedule_check(self) -> None:
        if not self._check_pending and not self._closed:
            self._check_pending = True
            self._loop.call_soon(self._check)

    def _schedule_drain(self) -> None:
        if not self._drain_pending and not self._closed:
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _deliver(self, frames: list[Any]) -> None:
        self._draining = True
        try:
            self._on_frames(frames)
        except Exception:  # a handler bug must not stop the socket
            log.exception("%s: message handler failed", self.name)
        finally:
            self._draining = False

    def _on_readable(self) -> None:
        """The FD fired: take one message now (its receive processes libzmq's commands), then look
        for more once the callbacks it set off (a reply sent, a waiter woken) have run."""
        if self._closed:
            return
        try:
            frames = self._take()  # None: commands only (room to send again, a peer's pipe), nothing to read
        except zmq.ZMQError as exc:
            if not self._closed:
                log.warning("%s: receive failed: %s", self.name, exc)
            return
        if frames is not None:
            self._deliver(frames)
        self._schedule_check()

    def _look(self) -> bool:
        """Read ``EVENTS``: note room to send; True when input is waiting."""
        if self._closed:
            return False
        try:
            events = self._events()
        except zmq.ZMQError:
            return False
        if events < 0:  # the C call's -errno
            return False
        if events & _POLLOUT and self._full:
            self._full = False
            self._writable.set()
        return events & _POLLIN != 0

    def _check(self) -> None:
        """The one ``EVENTS`` look per loop pass: room to send, and input a send's edge may hide."""
        self._check_pending = False
        if self._look():
            self._drain()

    def _drain(self) -> None:
        """Input is waiting: receive it. After the first message one ``EVENTS`` look says whether
        more is queued: most drains find one message, and the ``Again`` that a receive on an empty
        socket raises costs more than the look (pyzmq builds an exception). A burst is then
        received until ``Again`` (cheap while messages are queued: no syscall)."""
        self._drain_pending = False
        take = self._take
        for n in range(_MAX_BATCH):
            if self._closed:
                return
            if n == 1 and not self._look():  # nothing more: the look processed libzmq's commands (the
                return  # FD's edge is armed again, our sends' edges covered) and noted room to send
            try:
                frames = take()
            except zmq.ZMQError as exc:
                if not self._closed:
                    log.warning("%s: receive failed: %s", self.name, exc)
                return
            if frames is None:  # that receive processed libzmq's commands: the FD's edge is armed again
                break
            self._deliver(frames)
        else:
            self._schedule_drain()  # more may be waiting: let other callbacks run first
            return
        if self._full:  # a sender waits: the commands just processed may have made room
            self._schedule_check()

    def _recv_or_none(self) -> list[Any] | None:
        """pyzmq's receive of one message (:meth:`_recv`), None when none is waiting."""
        try:
            return self._recv(self.sock)
        except zmq.Again:
            return None

    def _recv(self, sock: zmq.Socket) -> list[Any]:
        """One multipart message: the leading ``copied`` frames (identity, header) as bytes, the
        rest (tensor data) as zero-copy Frames. Every part is received as a Frame: its ``more`` is
        cheaper to read than ``RCVMORE`` (pyzmq turns each option into an enum)."""
        recv = sock.recv
        frames: list[Any] = []
        for _ in range(self._copied):
            frame = recv(_NOBLOCK, copy=False)
            frames.append(frame.bytes)
            if not frame.more:
                return frames
        return self._recv_rest(sock, frames)

    def _recv_rest(self, sock: zmq.Socket, frames: list[Any]) -> list[Any]:
        """The rest of a message whose leading parts are in ``frames``, as zero-copy Frames: at
        most ``max_parts`` parts in all, each part past that read and let go at once."""
        recv = sock.recv
        keep = self._max_parts
        while True:
            frame = recv(_NOBLOCK, copy=False)
            if len(frames) < keep:
                frames.append(frame)
            if not frame.more:
                return frames

    def _poll_events(self) -> None:
        if self._look():
            self._schedule_drain()

    def try_send(self, frames: Sequence[Any]) -> bool:
        """Send without blocking; False when the peer's pipe is full or not connected; SendFailed
        when it never can be (EHOSTUNREACH from a ROUTER_MANDATORY router, a closed channel)."""
        if self._closed:
            raise SendFailed(f"{self.name}: channel is closed")
        csend = self._csend
        try:  # only the first part can be refused (HWM, unroutable): a message is queued whole or not at all
            done = 0 if csend is None else csend(frames)
            if done < 0:  # the C call's EAGAIN on the first part: nothing went
                return self._refused()
            if done < len(frames):  # what the C call left (or everything): pyzmq's calls
                self._send_from(frames, done)
        except zmq.Again:
            return self._refused()
        except zmq.ZMQError as exc:  # costs nothing unless raised
            raise SendFailed(f"{self.name}: {exc}") from exc
        # A send may swallow the FD's edge for input that arrived meanwhile: look at EVENTS once
        # before the loop sleeps again, not after every send (a pipelined burst sends hundreds).
        # A drain under way looks by itself: its next receive processes whatever the send hid.
        if not self._draining:
            self._schedule_check()
        return True

    def _refused(self) -> bool:
        self._full = True
        self._writable.clear()
        self._poll_events()
        return False

    def _send_from(self, frames: Sequence[Any], first: int) -> None:
        """Send ``frames[first:]`` with pyzmq: small frames copied (cheaper than pinning them; bytes
        have no nbytes), big buffers zero-copy (a received Frame shared, see :func:`received_frame`)."""
        sock = self.sock
        last = len(frames) - 1
        threshold = self._threshold
        for i in range(first, last + 1):
            f = frames[i]
            flags = _SNDMORE_NB if i < last else _NOBLOCK
            if getattr(f, "nbytes", 0) < threshold:
                _send(sock, f, flags, True)
            else:
                _send(sock, received_frame(f) or f, flags, False)

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
                 *, name: str = "", copied: int = 2, local: bool = True,
                 max_parts: int = DEFAULT_OPTIONS.max_msg_parts):
        self._user = ""
        super().__init__(sock, lambda frames: on_auth(frames, self._user), loop, name=name, copied=copied, local=local,
                         max_parts=max_parts)

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
            frame = sock.recv(_NOBLOCK, copy=False)
            frames.append(frame.bytes)
            more = frame.more
        return self._recv_rest(sock, frames) if more else frames
