"""A push through a task's push stream (:mod:`zmqflow.transport.bulk`): the gradient's bytes go
out from the caller's arrays on a thread, and the shard applies them a cache-sized chunk at a
time as they land (``ps.push_bulk``), where over ZeroMQ it would read each 4 MiB slice back from
memory after another core received it.

The request goes over ZeroMQ first, then the bytes on the stream. A push that fails in any way
closes its stream (the task may or may not have read its bytes, or may be waiting for them): the
next push opens a new one, so the two ends never stay out of step.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..cluster import TaskId
from ..transport.bulk_sender import Sender, thread_out
from ..wire.requests import ps as rq
from .bulk_pull import Piece, request
from .port import SessionPort

__all__ = ["PushStream", "push_from"]


class PushStream(Sender):
    """A session's open push stream to one task."""

    def __init__(self, task: str, handle: int, sock: socket.socket):
        sock.settimeout(None)  # blocking: sent from the stream's own thread
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"zmqflow-push-{task}")
        super().__init__(f"bulk stream to {task}", sock, pool)
        self.task, self.handle = task, handle
        self._tags = itertools.count(1)

    def next_tag(self) -> int:
        return next(self._tags)

    def close(self) -> None:
        """Shut the stream; its thread ends once a send in progress has failed on it."""
        super().close()
        self._pool.shutdown(wait=False)


async def push_from(sess: SessionPort, task: TaskId, stream: PushStream, pieces: list[Piece],
                    timeout: float | None, learning_rate: float | None = None) -> dict[str, Any]:
    """Gradients for the rows of ``pieces`` (async parts of ``task``) from their views, by
    ``timeout`` (the session's by default); answered as a push over ZeroMQ. The request goes
    first; a task that refuses it stops reading, so its answer is awaited beside the send, and a
    refusal ends the send at once (the stream is closed) with the task's own error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (sess.timeout if timeout is None else timeout)
    tag = stream.next_tag()
    body = request(rq.PushBulk, stream, tag, pieces)
    body.learning_rate = learning_rate
    call = asyncio.ensure_future(sess.call_task(task, "ps", "push_bulk", body, timeout=timeout))
    send = asyncio.ensure_future(stream.send(tag, [p.view for p in pieces], deadline))
    try:
        await asyncio.wait((call, send), return_when=asyncio.FIRST_EXCEPTION)
        if call.done() and call.exception() is not None:
            raise call.exception()  # type: ignore[misc]  # the task's own word, not the send's
        await send
        return await call
    except BaseException:
        stream.close()  # the task may be reading these bytes, or waiting for them: start afresh
        for f in (call, send):
            if not f.done():
                f.cancel()
        await thread_out(send)  # the send's thread is off the caller's arrays before this returns
        await asyncio.gather(call, return_exceptions=True)
        raise
