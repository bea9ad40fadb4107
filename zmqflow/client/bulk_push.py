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
from ..transport.bulk_sender import Sender
from ..wire.requests import ps as rq
from .port import SessionPort

__all__ = ["PushStream", "push_from"]


class PushStream(Sender):
    """A session's open push stream to one task."""

    def __init__(self, task: str, handle: int, sock: socket.socket):
        sock.settimeout(None)  # blocking: sent from the stream's own thread
        super().__init__(f"bulk stream to {task}", sock, ThreadPoolExecutor(1, thread_name_prefix=f"zmqflow-push-{task}"))
        self.task, self.handle = task, handle
        self._tags = itertools.count(1)

    def next_tag(self) -> int:
        return next(self._tags)

    def close(self) -> None:
        """Shut the stream; its thread ends once a send in progress has failed on it."""
        super().close()
        self._pool.shutdown(wait=False)


async def push_from(sess: SessionPort, task: TaskId, stream: PushStream, items: list[rq.PullItem],
                    views: list[memoryview], timeout: float | None) -> dict[str, Any]:
    """Gradients of ``items`` (async parts of ``task``) from ``views`` (one per item, each exactly
    its rows' bytes), by ``timeout`` (the session's by default); answered as a push over ZeroMQ."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (sess.timeout if timeout is None else timeout)
    tag = stream.next_tag()
    call = asyncio.ensure_future(sess.call_task(task, "ps", "push_bulk",
                                                rq.PushBulk(items=items, stream=stream.handle, tag=tag), timeout=timeout))
    try:
        await stream.send(tag, views, deadline)
        return await call
    except BaseException:
        stream.close()  # the task may be reading these bytes, or waiting for them: start afresh
        if not call.done():
            call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        raise
