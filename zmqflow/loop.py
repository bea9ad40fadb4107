"""Event loops: uvloop where installed, and a loop on a background thread for blocking facades."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
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


CANCEL_WAIT_S = 1.0  # how long a caller that gave up waits for its task to end once cancelled


def _cancel(box: list[Any]) -> None:
    """Cancel the call's task; its error, if it ends with one anyway, is seen (no "never retrieved" log)."""
    if box and isinstance(box[0], asyncio.Future):
        box[0].cancel()
        box[0].add_done_callback(lambda task: task.cancelled() or task.exception())


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
        """Run ``coro`` on the loop and return its result; ``timeout`` bounds the wait.

        The caller waits on a bare lock that the task's done callback releases: 21-27 us a call
        of a coroutine that returns at once on a 2-core VM, against 42-55 us for
        ``run_coroutine_threadsafe`` and a wait on its future (which chains a second future
        across the threads, each with a condition).

        A caller that stops waiting (the deadline, or KeyboardInterrupt and any other exception
        raised in its thread) cancels the task and waits up to ``CANCEL_WAIT_S`` for it to end, so
        that it no longer touches the caller's arrays once the call has raised. A request already
        sent may still be applied by its peer: cancelling stops the waiting, not the other side.

        On the loop's own thread (a done callback of a future from ``submit``, say) the call would
        wait on itself until its deadline, stalling every other caller: it raises RuntimeError."""
        if self.in_loop_thread:
            getattr(coro, "close", lambda: None)()  # never to run: no "never awaited" warning
            raise RuntimeError(
                f"a blocking call on the thread of its own loop ({self._thread.name}) would wait on itself: "
                "there, start it with submit() or await it in a coroutine "
                "(for a zf.Session, through sess.async_session)")
        done = threading.Lock()
        done.acquire()
        box: list[Any] = []  # the task once started, or what starting it raised

        def start() -> None:
            try:
                task = asyncio.ensure_future(coro, loop=self.loop)
            except BaseException as exc:  # handed to the caller below
                box.append(exc)
                done.release()
                return
            box.append(task)
            task.add_done_callback(lambda _: done.release())

        self.loop.call_soon_threadsafe(start)
        try:
            finished = done.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        except BaseException:
            self._give_up(box, done)
            raise
        if not finished:
            self._give_up(box, done)
            raise DeadlineExceeded(f"call on the background loop did not finish within {timeout:g}s")
        got = box[0]
        if isinstance(got, BaseException):
            raise got
        return got.result()

    def _give_up(self, box: list[Any], done: threading.Lock) -> None:
        """Cancel a call nobody waits for any more, and wait (briefly) until its task has ended."""
        try:
            self.loop.call_soon_threadsafe(_cancel, box)  # runs after ``start``: callbacks keep their order
        except RuntimeError:  # the loop is closed: nothing of it runs any more
            return
        done.acquire(timeout=CANCEL_WAIT_S)

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 5.0, *, after: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Stop the loop (once ``after()`` has ended, where given) and wait up to ``timeout`` for its
        thread to end. The wait is skipped on the loop's own thread, or with ``timeout`` 0: then
        nothing blocks, as a finalizer needs (the garbage collector runs on any thread)."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self._stop_after, after)
        except RuntimeError:  # closed meanwhile
            return
        self.join(timeout)

    def _stop_after(self, after: Callable[[], Awaitable[Any]] | None) -> None:
        if after is None:
            self.loop.stop()
            return
        try:
            task = asyncio.ensure_future(after(), loop=self.loop)
        except BaseException:
            self.loop.stop()
            raise
        task.add_done_callback(self._stop_when_done)

    def _stop_when_done(self, task: asyncio.Future[Any]) -> None:
        """Stop the loop; what ``after`` raised goes to the loop's handler (nobody waits to be told)."""
        if not task.cancelled() and task.exception() is not None:
            self.loop.call_exception_handler(
                {"message": "closing before the loop stopped failed", "exception": task.exception(), "future": task})
        self.loop.stop()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the loop's thread to end (at once on that thread itself)."""
        if timeout > 0 and not self.in_loop_thread:
            self._thread.join(timeout)
