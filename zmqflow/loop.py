"""Event loops: uvloop where installed, and a loop on a background thread for blocking facades."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from .errors import DeadlineExceeded

__all__ = ["new_event_loop", "run", "LoopThread", "uvloop_available"]

T = TypeVar("T")

try:
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is optional
    _uvloop = None


def uvloop_available() -> bool:
    return _uvloop is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return _uvloop.new_event_loop() if _uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when installed."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


class LoopThread:
    """An event loop running on a daemon thread; ``call`` runs a coroutine there and waits."""

    def __init__(self, name: str = "zmqflow-loop"):
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result; ``timeout`` bounds the wait."""
        fut = self.submit(coro)
        done, _ = concurrent.futures.wait([fut], timeout)
        if not done:  # (the coroutine's own errors may be TimeoutErrors too: tell them apart here)
            fut.cancel()
            raise DeadlineExceeded(f"call on the background loop did not finish within {timeout:g}s")
        return fut.result()

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_loop_thread:
            self._thread.join(timeout)
