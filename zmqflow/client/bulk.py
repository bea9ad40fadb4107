"""A session's pull stream to one task (:mod:`zmqflow.transport.bulk`; opened by :mod:`.bulk_streams`).

A pull that uses one registers where each transfer's bytes go (:meth:`BulkStream.expect`), asks
the shard over ZeroMQ to send them (naming the stream and the transfer's tag), and waits for both
the reply and the bytes. One reader per stream lands each transfer in its destinations as it
comes. A waiter that gave up (its deadline, a cancel, a refusal) leaves its destinations alone
from then on, and the stream lets go of them: only its byte count stays, so bytes still on their
way are read and dropped. A header the reader does not expect, or a count
other than the one expected, means the two ends are out of step: the stream is closed, every
waiter on it fails with Unavailable, and the next pull opens a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError, Unavailable
from ..transport.bulk import HEADER
from ..transport.bulk_sender import thread_out

__all__ = ["BulkStream", "Transfer", "MAX_WAITING"]

MAX_WAITING = 4096  # transfers one stream keeps track of, given up on or not
_SCRATCH = 1 << 20


@dataclass(eq=False)
class Transfer:
    """Where one transfer's bytes go, and who waits for them."""

    tag: int
    dests: list[memoryview]  # emptied once its waiter gave up: the caller's arrays are its own again
    nbytes: int
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    live: bool = True  # False once its waiter gave up: the bytes are dropped
    started: bool = False  # the reader is landing it
    finished: bool = False


class BulkStream:
    """One open stream to one task. Its reader is a thread blocked in ``recv_into`` for a whole
    destination at a time (few calls, each sleeping in the kernel until its bytes are in); what
    it hands back to the loop is only each transfer's end."""

    def __init__(self, task: str, handle: int, sock: socket.socket):
        self.task, self.handle, self._sock = task, handle, sock
        self._loop = asyncio.get_running_loop()
        self._tags = itertools.count(1)
        self._guard = threading.Lock()  # live/started of transfers, between the loop and the reader
        self._waiting: dict[int, Transfer] = {}
        self.closed = False
        self.received = 0  # bytes landed, for tests and metrics
        self.stopped = self._loop.create_future()  # the reader is out
        sock.settimeout(None)  # blocking: the reader's alone from here
        threading.Thread(target=self._read, name=f"zmqflow-bulk-{task}", daemon=True).start()

    def expect(self, dests: list[memoryview]) -> Transfer:
        """Register a transfer into ``dests`` (filled in order) under a new tag."""
        if self.closed:
            raise Unavailable(f"bulk stream to {self.task} is closed")
        with self._guard:
            if len(self._waiting) >= MAX_WAITING:
                for tag in [tag for tag, t in self._waiting.items() if not t.live and not t.started]:
                    del self._waiting[tag]  # given up, their bytes never came: one coming now closes the stream
            if len(self._waiting) >= MAX_WAITING:
                raise Unavailable(f"bulk stream to {self.task} has {len(self._waiting)} transfers outstanding")
            t = Transfer(next(self._tags), dests, sum(d.nbytes for d in dests))
            self._waiting[t.tag] = t
        return t

    async def abandon(self, t: Transfer, sent: bool) -> None:
        """Its waiter gives up; ``sent``: whether the task may still send it (else it is forgotten).
        Either way the stream drops its views of the caller's arrays (a refused read must not pin
        them): bytes still to come are drained by count. A transfer being landed right now is
        stopped by closing the stream, and this returns once the reader is out: nothing lands in
        the caller's arrays after the caller has given up."""
        with self._guard:
            t.live = False
            t.dests = []  # a transfer landing now holds its own reference until the reader is out
            landing = t.started and not t.finished
            if not sent and not t.started:
                self._waiting.pop(t.tag, None)
        if not t.done.done():
            t.done.cancel()
        if landing:
            await self.close()

    def _read(self) -> None:
        scratch = memoryview(bytearray(_SCRATCH))
        why: Exception = Unavailable(f"bulk stream to {self.task} closed")
        try:
            while True:
                head = self._sock.recv(HEADER.size, socket.MSG_WAITALL)
                if len(head) < HEADER.size:
                    raise ConnectionError("closed by the task" if not head else "cut short in a header")
                tag, n = HEADER.unpack(head)
                bad = self._land(tag, n, scratch)
                if bad is not None:
                    why = bad
                    return
        except OSError as exc:  # ConnectionError included; a shut socket too
            why = Unavailable(f"bulk stream to {self.task} failed: {exc}")
        finally:
            self._to_loop(self._shut, why)

    def _land(self, tag: int, n: int, scratch: memoryview) -> ProtocolError | None:
        """Transfer ``tag`` of ``n`` bytes into its destinations (on the reader's thread), or why
        the stream is out of step. Its own frame: nothing of the caller's stays referenced by the
        reader while it waits for the next header."""
        dests: list[memoryview] = []
        with self._guard:
            t = self._waiting.get(tag)
            if t is not None and n == t.nbytes:
                t.started, dests = True, t.dests
        if t is None or n != t.nbytes:
            what = "an unknown transfer" if t is None else f"{n} bytes where {t.nbytes} were asked for"
            return ProtocolError(f"bulk stream to {self.task}: {what} (tag {tag})")
        if not dests:  # given up before it began: its views are gone, its bytes are dropped
            self._drain(n, scratch)
        for dest in dests:
            while dest.nbytes:
                into = dest if t.live else scratch[:min(dest.nbytes, scratch.nbytes)]
                k = self._sock.recv_into(into, into.nbytes, socket.MSG_WAITALL)
                if not k:
                    raise ConnectionError("closed by the task mid-transfer")
                dest = dest[k:]
        with self._guard:
            t.finished, t.dests = True, []
            del self._waiting[tag]
        self._to_loop(self._landed, t, n)
        return None

    def _drain(self, n: int, scratch: memoryview) -> None:
        """Read and drop ``n`` bytes (on the reader's thread)."""
        while n:
            k = self._sock.recv_into(scratch, min(n, scratch.nbytes), socket.MSG_WAITALL)
            if not k:
                raise ConnectionError("closed by the task mid-transfer")
            n -= k

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody waits any more
            if fn == self._shut:
                self._sock.close()

    def _landed(self, t: Transfer, n: int) -> None:
        self.received += n
        if not t.done.done():
            t.done.set_result(n)

    def _shut(self, why: Exception) -> None:
        """On the loop, once the reader is out: every transfer still waited for fails with ``why``."""
        self.closed = True
        self._sock.close()
        with self._guard:
            waiting, self._waiting = list(self._waiting.values()), {}
        for t in waiting:
            if not t.done.done():
                t.done.set_exception(type(why)(str(why)))
                t.done.exception()  # retrieved here: its waiter may be gone
        if not self.stopped.done():
            self.stopped.set_result(None)

    async def close(self) -> None:
        """Shut the socket (the reader wakes and ends) and wait until the reader is out, however
        often this is cancelled meanwhile: nothing lands in a caller's arrays after it returns."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        await thread_out(self.stopped)
