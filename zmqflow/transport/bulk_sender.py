"""The sending end of a bulk stream (:mod:`.bulk`), shared by a task's pull streams and a
session's push streams."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import Unavailable
from .bulk import HEADER

__all__ = ["Gather", "Sender", "send_blocking", "thread_out"]


class Gather:
    """A transfer whose views are made when its turn comes, not when it is asked for: one waiting
    behind others holds ``count`` items' rows in a few bytes each, not a view per item.
    :meth:`prepare` runs on the loop once the stream is its (it pins what is sent); iterating
    yields the views one at a time on the sending thread; :meth:`release` lets go once it is out."""

    nbytes: int  # the whole transfer's, for its header
    count: int  # items

    def prepare(self) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[memoryview]:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


class Sender:
    """The sending end of a stream: its socket (blocking: a transfer is sent by one pool thread in
    a few calls that sleep in the kernel, not by the loop a socket buffer at a time), and a lock
    that keeps transfers whole. ``name`` is what errors call it."""

    def __init__(self, name: str, sock: socket.socket, pool: ThreadPoolExecutor):
        self.name, self.sock, self._pool = name, sock, pool
        self.lock = asyncio.Lock()
        self.closed = False
        self._busy = False  # a thread is sending on the socket: it closes it when done
        self.details: dict[str, object] = {}  # what an error saying the stream is gone carries on the wire

    async def send(self, tag: int, views: Sequence[memoryview] | Gather, deadline: float | None) -> int:
        """One transfer, whole. ``deadline`` (loop time) bounds the wait for the lock and each
        stall of the peer. A transfer cut short leaves the stream out of step with its reader,
        so the stream is closed then (a cancelled send too); waiting for the lock is not."""
        loop = asyncio.get_running_loop()
        left = None if deadline is None else deadline - loop.time()
        if self.closed:
            raise Unavailable(f"{self.name} is closed", **self.details)
        try:
            await asyncio.wait_for(self.lock.acquire(), left)
        except TimeoutError:
            raise Unavailable(f"{self.name} stayed busy past the deadline") from None
        try:
            if self.closed:
                raise Unavailable(f"{self.name} is closed", **self.details)
            left = None if deadline is None else max(0.001, deadline - loop.time())
            if isinstance(views, Gather):
                views.prepare()
            self._busy = True
            sent = loop.run_in_executor(self._pool, send_blocking, self.sock, tag, views, left)
            try:
                return await asyncio.shield(sent)
            except asyncio.CancelledError:
                self.close()  # the thread's send fails at once
                await thread_out(sent)  # off the views and the socket before this returns
                raise
        except OSError as exc:  # the peer gone, or stalled past the deadline
            self.close()
            raise Unavailable(f"{self.name} failed mid-transfer: {exc or type(exc).__name__}",
                              **self.details) from None
        finally:
            if isinstance(views, Gather):
                views.release()  # the thread is out
            self._busy = False
            if self.closed:
                self.sock.close()
            self.lock.release()

    def gone(self) -> bool:
        """Whether the peer closed it (it sends nothing on a stream it only reads: anything else
        ends it too)."""
        if self.closed:
            return True
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            pass
        self.close()
        return True

    def close(self) -> None:
        """Shut at once (a thread sending on it wakes with an error); the socket is closed here,
        or by the sending side once its thread is out."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self._busy:
            self.sock.close()


async def thread_out(fut: asyncio.Future) -> None:
    """Wait until a thread's future is done, however often the waiter is cancelled meanwhile (a
    thread cannot be stopped: what it holds, it holds until it returns); the cancel then stands."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    if not fut.cancelled():
        fut.exception()  # retrieved: the caller raises its own error
    if cancelled:
        raise asyncio.CancelledError


def send_blocking(sock: socket.socket, tag: int, views: Sequence[memoryview] | Gather, left: float | None) -> int:
    """On a pool thread: a send that makes no progress for ``left`` seconds fails (SO_SNDTIMEO)."""
    whole = 0 if left is None else int(left)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("@ll", whole, 0 if left is None else int((left - whole) * 1e6)))
    nbytes = views.nbytes if isinstance(views, Gather) else sum(v.nbytes for v in views)
    sock.sendall(HEADER.pack(tag, nbytes))
    for v in views:
        sock.sendall(v)
    return nbytes
