"""The bounded window a restore puts records back through: never more than its count or its byte
budget in flight (one alone may pass the budget), and a failure cancels the rest and is raised once
nothing it started still runs."""

from __future__ import annotations

import asyncio

import pytest

from zmqflow.client.window import Window

from .conftest import arun


def test_the_window_keeps_to_its_count_and_its_bytes():
    async def main() -> None:
        running: list[int] = []
        seen: list[list[int]] = []  # what ran at once, each time one started

        async def job(nbytes: int) -> None:
            running.append(nbytes)
            seen.append(list(running))
            for _ in range(3):
                await asyncio.sleep(0)
            running.remove(nbytes)

        window = Window(3, 100)
        sizes = [40, 40, 40, 10, 10, 10, 250, 10]
        for n in sizes:
            await window.add(job(n), n)
        await window.drain()
        assert running == [] and sorted(s[-1] for s in seen) == sorted(sizes)
        assert max(len(s) for s in seen) == 3  # [40, 10, 10] and the like: the count is what bounds them
        assert all(sum(s) <= 100 for s in seen if 250 not in s)
        assert [s for s in seen if 250 in s] == [[250]]  # over the budget alone: it waits for all the others

    arun(main())


def test_a_failure_cancels_the_others_and_is_raised_after_they_end():
    async def main() -> None:
        ended: list[str] = []
        failing = asyncio.Event()

        async def slow(name: str) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(name)

        async def fails() -> None:
            await failing.wait()
            raise ValueError("part 3 refused")

        window = Window(4, 1 << 30)
        await window.add(slow("a"), 1)
        await window.add(slow("b"), 1)
        await window.add(fails(), 1)
        failing.set()
        with pytest.raises(ValueError, match="part 3 refused"):
            await window.drain()
        assert sorted(ended) == ["a", "b"]
        await window.drain()  # nothing left

        # a failure seen while waiting for room is raised by add, and the coroutine it held never runs
        window = Window(1, 1 << 30)
        failing.clear()
        await window.add(fails(), 1)
        never = slow("never")
        failing.set()
        with pytest.raises(ValueError, match="part 3 refused"):
            await window.add(never, 1)
        assert "never" not in ended and never.cr_frame is None  # closed, never started

    arun(main())


def test_cancelling_the_caller_cancels_what_it_started():
    async def main() -> None:
        started: list[int] = []
        ended: list[int] = []

        async def slow(i: int) -> None:
            started.append(i)
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(i)

        window = Window(2, 1 << 30)

        async def caller() -> None:
            for i in range(5):
                await window.add(slow(i), 1)

        task = asyncio.ensure_future(caller())
        for _ in range(100):
            if len(started) == 2:
                break
            await asyncio.sleep(0)
        assert started == [0, 1] and not task.done()  # the third waits for room
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(ended) == [0, 1]

    arun(main())
