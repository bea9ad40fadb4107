"""The receiving end of a task's push streams (:mod:`zmqflow.server.bulk_listener`).

A pushed transfer's bytes are read on the loop a chunk at a time into one reused buffer (by the
transport, straight into it) and handed, chunk by chunk, to the :class:`Sink` its request
registered under its tag: a shard adds each chunk into its rows while the chunk is still in this
core's cache, instead of reading a whole gradient back from memory after ZeroMQ's thread wrote
it there on another core.

The bytes and their request travel apart (the request over ZeroMQ, sent first), so the reader
may meet a transfer before its request: it waits for the request ``request_wait`` seconds (5),
then closes the stream. A request refused before its bytes were read registers no sink; its
client closes the stream on the error, which ends the reader too. A sink that fails midway (its part restored, a
fence) has the rest of its bytes read and dropped, so the stream stays in step.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import DeadlineExceeded, InvalidArgument, ProtocolError, ResourceExhausted, Unavailable
from ..transport.bulk import HEADER

__all__ = ["Sink", "PushConn", "MAX_SINKS", "EXPECTED_CHUNKS"]

MAX_SINKS = 64  # transfers one stream's requests may register ahead of their bytes (a client sends a few)
EXPECTED_CHUNKS = 1 << 18  # their chunks in all: a transfer alone may have more


@dataclass(eq=False)
class Sink:
    """Where one pushed transfer goes: ``chunks`` (byte sizes, in order; an ``array`` keeps a
    long plan small) each handed to ``consume(index, bytes)`` as it lands; the bytes are valid
    only during the call."""

    chunks: Sequence[int]
    consume: Callable[[int, memoryview], None]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(self.chunks)

    def settle(self, error: BaseException | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(self.nbytes)
            else:
                self.done.set_exception(error)
                self.done.exception()  # retrieved here: its waiter may be gone


class PushConn(asyncio.BufferedProtocol):
    """An open push stream: whose it is, and the protocol that reads it. The loop's transport
    reads straight into the chunk being filled (``get_buffer``), one callback per read and no
    task or future per chunk; the stream is paused while a transfer waits for its request."""

    def __init__(self, handle: int, owner: str, sock: socket.socket, request_wait: float = 5.0):
        self.handle, self.owner, self.request_wait = handle, owner, request_wait
        self._sock: socket.socket | None = sock  # until the transport takes it (``open``)
        self.closed = False
        self.received = 0  # bytes landed, for tests and metrics
        self._sinks: dict[int, Sink] = {}
        self._chunks = 0  # of the sinks registered
        self._transport: asyncio.Transport | None = None
        self._head = bytearray(HEADER.size)
        self._scratch = bytearray(1)
        self._tag = -1  # the transfer being read; -1: a header is
        self._filled = 0  # bytes of the header or of the current chunk
        self._sink: Sink | None = None
        self._pending_bytes = 0  # the byte count of the transfer waiting for its request
        self._chunk = 0
        self._error: BaseException | None = None
        self._waiting: asyncio.TimerHandle | None = None  # paused for a request, until then
        self.ended = asyncio.get_running_loop().create_future()  # the stream is closed

    async def open(self) -> "PushConn":
        """Hand the socket to the loop's transport, which reads it from now on."""
        sock, self._sock = self._sock, None
        if sock is not None and not self.closed:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: self, sock)
        elif sock is not None:
            sock.close()
        return self

    def expect(self, tag: int, sink: Sink) -> None:
        """Register where transfer ``tag`` goes (its request, checked)."""
        if self.closed:
            raise Unavailable(f"bulk stream {self.handle} is closed")
        if tag in self._sinks:
            raise InvalidArgument(f"bulk stream {self.handle}: transfer {tag} is already expected")
        if len(self._sinks) >= MAX_SINKS:
            raise ResourceExhausted(f"bulk stream {self.handle}: {len(self._sinks)} transfers expected, the cap")
        if self._sinks and self._chunks + len(sink.chunks) > EXPECTED_CHUNKS:
            raise ResourceExhausted(f"bulk stream {self.handle}: {len(self._sinks)} transfers of {self._chunks} "
                                    f"chunks expected, this one's {len(sink.chunks)} would pass the cap of "
                                    f"{EXPECTED_CHUNKS}")
        self._sinks[tag] = sink
        self._chunks += len(sink.chunks)
        if self._waiting is not None and tag == self._tag:
            self._waiting.cancel()
            self._waiting = None
            try:
                self._begin(sink)
            except ProtocolError as exc:
                self._end(exc)
                return
            if self._transport is not None:
                self._transport.resume_reading()

    async def landed(self, sink: Sink, deadline: float | None) -> int:
        """Wait for ``sink``'s bytes by ``deadline`` (loop time). Past it, or cancelled, the stream
        is closed: it is out of step with its client, and no more of the push may be applied after
        its caller was told it failed."""
        left = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            return await asyncio.wait_for(asyncio.shield(sink.done), left)
        except TimeoutError:
            self.close()
            raise DeadlineExceeded(f"bulk stream {self.handle}: the pushed bytes did not all come in time") from None
        except asyncio.CancelledError:  # its request given up: none of the rest is applied
            self.close()
            raise

    # the protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is None:
            return memoryview(self._head)[self._filled:]
        return memoryview(self._scratch)[self._filled:self._sink.chunks[self._chunk]]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        try:
            if self._sink is None:
                if self._filled == HEADER.size:
                    self._header()
            elif self._filled == self._sink.chunks[self._chunk]:
                self._consumed()
        except ProtocolError as exc:
            self._end(exc)

    def _header(self) -> None:
        tag, n = HEADER.unpack(self._head)
        self._tag, self._filled = tag, 0
        sink = self._sinks.get(tag)
        if sink is None:  # its request is not here yet: wait for it, reading nothing meanwhile
            assert self._transport is not None
            self._transport.pause_reading()
            self._waiting = asyncio.get_running_loop().call_later(self.request_wait, self._end, ProtocolError(
                f"bulk stream {self.handle}: transfer {tag} came, its request did not"))
            self._pending_bytes = n
            return
        self._pending_bytes = n
        self._begin(sink)

    def _begin(self, sink: Sink) -> None:
        if self._pending_bytes != sink.nbytes:
            raise ProtocolError(f"bulk stream {self.handle}: transfer {self._tag} is {self._pending_bytes} bytes, "
                                f"its request {sink.nbytes}")
        if max(sink.chunks, default=0) > len(self._scratch):
            self._scratch = bytearray(max(sink.chunks))
        self._sink, self._chunk, self._error = sink, 0, None
        self._skip_empty()

    def _consumed(self) -> None:
        sink = self._sink
        assert sink is not None
        if self._error is None:
            try:
                sink.consume(self._chunk, memoryview(self._scratch)[:self._filled])
            except Exception as exc:  # the rest is read and dropped: the stream stays in step
                self._error = exc
        self._chunk += 1
        self._filled = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        """Past chunks of no bytes (rows of nothing); the transfer settles once all are in."""
        sink = self._sink
        assert sink is not None
        while self._chunk < len(sink.chunks) and not sink.chunks[self._chunk]:
            self._chunk += 1
        if self._chunk == len(sink.chunks):
            del self._sinks[self._tag]
            self._chunks -= len(sink.chunks)
            self.received += sink.nbytes
            self._sink, self._tag = None, -1
            sink.settle(self._error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(Unavailable(f"bulk stream {self.handle} " + (f"failed: {exc}" if exc else "closed by its client")))

    def _end(self, why: Exception) -> None:
        self.closed = True
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        if self._transport is not None:
            self._transport.abort()
        elif self._sock is not None:
            self._sock.close()
            self._sock = None
        for sink in self._sinks.values():
            sink.settle(type(why)(str(why)))
        self._sinks.clear()
        self._chunks = 0
        if not self.ended.done():
            self.ended.set_result(None)

    @property
    def paused_for(self) -> int | None:
        """The tag of a transfer whose bytes came before its request, while the stream waits for it."""
        return self._tag if self._waiting is not None else None

    @property
    def expected(self) -> int:
        """Transfers whose requests are in and whose bytes are not all."""
        return len(self._sinks)

    def gone(self) -> bool:
        return self.closed

    def close(self) -> None:
        """Stop reading; every sink still registered fails."""
        if not self.closed:
            self._end(Unavailable(f"bulk stream {self.handle} closed by this task"))
