"""Which fellow workers are down, as this task's server sees them, watched in the background.

Sync training moves the chief's duties to the lowest-index live worker. Asking on every step
would cost a round trip; instead a task on the server's loop refreshes the answer a few times a
second from what the connections already know (the socket monitor marks a dropped connection
down at once) and pings only members it has never reached. Readers take a plain attribute.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..cluster import TaskId
from ..errors import ZmqflowError

if TYPE_CHECKING:
    from ..server import AsyncServer, Server

__all__ = ["MemberWatch"]


class MemberWatch:
    def __init__(self, server: "Server", members: Sequence[TaskId], period: float = 0.25):
        self.members = list(members)
        self.down: frozenset[TaskId] = frozenset()
        self._server = server
        self._task: asyncio.Task | None = server.loop_thread.call(self._start(server.async_server, period), timeout=5)

    async def _start(self, server: "AsyncServer", period: float) -> asyncio.Task:
        return asyncio.ensure_future(self._run(server, period))

    async def _run(self, server: "AsyncServer", period: float) -> None:
        client, spec = server.client, server.spec
        while True:
            down = set()
            for task in self.members:
                endpoint = spec.address(task).endpoint
                state = client.peer_state(endpoint)
                if state == "down" or (state != "up" and not await _answers(server, task, period)):
                    down.add(task)
            self.down = frozenset(down)
            await asyncio.sleep(period)

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(Exception):
                self._server.loop_thread.call(_cancel(task), timeout=5)


async def _answers(server: "AsyncServer", task: TaskId, timeout: float) -> bool:
    try:
        await server.client.call(server.spec.address(task).endpoint, "master", "ping", timeout=timeout, name=str(task))
        return True
    except ZmqflowError:
        return False


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
