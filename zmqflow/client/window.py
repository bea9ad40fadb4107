"""A bounded window of coroutines in flight: the records of a restore go back several at a time,
as many as fit in a count and a byte budget, so a model of many small variables costs a few round
trips in all instead of a few each, and one of a few huge ones holds no more than it did."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["Window"]


class Window:
    """Run coroutines ``count`` at a time, while their ``nbytes`` stay within ``budget`` (one
    alone may pass it). The first failure cancels the others and is raised, by :meth:`add` or
    :meth:`drain`, after every one has ended: none is left running behind the caller."""

    def __init__(self, count: int, budget: int):
        self.count, self.budget = max(1, count), budget
        self._running: dict[asyncio.Task[Any], int] = {}

    async def add(self, coro: Coroutine[Any, Any, Any], nbytes: int) -> None:
        """Start ``coro`` once there is room for it."""
        try:
            while self._running and (len(self._running) >= self.count
                                     or sum(self._running.values()) + nbytes > self.budget):
                await self._settle()
        except BaseException:
            coro.close()  # never started: no "never awaited" warning
            raise
        self._running[asyncio.ensure_future(coro)] = nbytes

    async def drain(self) -> None:
        """Wait for every coroutine started (raising the first failure as soon as it comes)."""
        while self._running:
            await self._settle()

    async def _settle(self) -> None:
        """Wait for one to end; on a failure, cancel and wait for the rest, then raise it."""
        try:
            done, _ = await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled: so is everything it started
            await self._cancel_all()
            raise
        for task in done:
            del self._running[task]
        failed = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        if failed:
            await self._cancel_all()
            raise failed[0]

    async def _cancel_all(self) -> None:
        tasks = list(self._running)
        self._running.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
