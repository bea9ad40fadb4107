"""The background loop of the blocking facades: results, errors and deadlines come back to the
calling thread, each to its own caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from zmqflow.errors import DeadlineExceeded
from zmqflow.loop import LoopThread

from .conftest import run_in_threads


@pytest.fixture
def lt():
    thread = LoopThread("test-loop")
    yield thread
    thread.stop()


def test_a_call_returns_what_the_coroutine_returns(lt):
    async def double(x):
        await asyncio.sleep(0)
        return 2 * x

    assert lt.call(double(21)) == 42

    async def make_future():
        return lt.loop.create_future()

    fut = lt.call(make_future())  # a plain future of that loop: any awaitable, not only a coroutine
    lt.loop.call_soon_threadsafe(fut.set_result, "set")
    assert lt.call(fut, timeout=5) == "set"


def test_the_coroutines_own_errors_come_back_as_they_are(lt):
    async def fails(exc):
        raise exc

    with pytest.raises(ValueError, match="bad"):
        lt.call(fails(ValueError("bad")), timeout=5)
    with pytest.raises(TimeoutError, match="its own") as info:  # not taken for the call's deadline
        lt.call(fails(TimeoutError("its own")), timeout=5)
    assert not isinstance(info.value, DeadlineExceeded)


def test_a_call_past_its_deadline_raises_and_cancels_the_coroutine(lt):
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(DeadlineExceeded, match="within 0.05s"):
        lt.call(forever(), timeout=0.05)
    assert cancelled.wait(5)
    assert lt.call(asyncio.sleep(0, "still serving"), timeout=5) == "still serving"


def test_callers_on_many_threads_each_get_their_own_result(lt):
    got: dict[int, list[int]] = {}

    async def echo(i, k):
        await asyncio.sleep(0)
        return (i, k)

    def caller(i):
        got[i] = [lt.call(echo(i, k), timeout=10) for k in range(200)]

    run_in_threads(caller, 4)
    assert got == {i: [(i, k) for k in range(200)] for i in range(4)}
