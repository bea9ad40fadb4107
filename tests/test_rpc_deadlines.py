"""The client's deadline set: exactly the live calls come due, in order, and memory stays bounded;
and a client's calls still time out one by one with a single loop timer."""

from __future__ import annotations

import asyncio
import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqflow.errors import DeadlineExceeded
from zmqflow.rpc import RpcClient, RpcServer, Service, op
from zmqflow.rpc.deadlines import Deadlines

pytestmark = pytest.mark.timeout(60)


def test_only_live_calls_come_due_earliest_first() -> None:
    d = Deadlines()
    live = {1: None, 2: None, 3: None}
    d.add(5.0, 1, live)
    d.add(3.0, 2, live)
    d.add(4.0, 3, live)
    del live[3]  # ended before its deadline
    assert d.pop_due(4.5, live) == [2]
    assert d.next_due(live) == 5.0
    assert d.pop_due(10.0, live) == [1]
    assert d.next_due(live) is None


def test_stale_entries_are_dropped_once_they_outnumber_live_calls() -> None:
    d = Deadlines()
    live: dict[int, None] = {}
    for rid in range(100_000):  # each call ends before the next starts, as in a latency loop
        live[rid] = None
        d.add(30.0 + rid * 1e-6, rid, live)
        del live[rid]
    assert len(d) <= 2 * len(live) + 257


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 100, allow_nan=False)), max_size=60))
def test_matches_a_model(ops: list[tuple[int, float]]) -> None:
    """Random adds, ends and sweeps against a dict of due times."""
    d = Deadlines()
    live: dict[int, float] = {}
    rid = 0
    now = 0.0
    for kind, value in ops:
        if kind <= 1:
            rid += 1
            live[rid] = value
            d.add(value, rid, live)
        elif kind == 2 and live:
            live.pop(next(iter(live)))
        else:
            now = max(now, value)
            expected = sorted((due, r) for r, due in live.items() if due <= now)
            assert d.pop_due(now, live) == [r for _, r in expected]
            for _, r in expected:
                del live[r]
        assert d.next_due(live) == (min(live.values()) if live else None)


class _Slow(Service):
    name = "slow"

    @op
    async def wait(self, ctx, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds


def test_calls_with_different_timeouts_each_expire_at_their_own() -> None:
    async def main() -> None:
        server = RpcServer("inproc://deadlines-1", {"slow": _Slow()}, name="t")
        await server.start()
        client = RpcClient(identity="c")
        loop = asyncio.get_running_loop()
        try:
            t0 = loop.time()
            late = client.start_call(server.endpoint, "slow", "wait", {"seconds": 5.0}, timeout=1.5)
            early = client.start_call(server.endpoint, "slow", "wait", {"seconds": 5.0}, timeout=0.3)
            quick = client.start_call(server.endpoint, "slow", "wait", {"seconds": 0.0}, timeout=10.0)
            assert await quick == 0.0
            with pytest.raises(DeadlineExceeded, match="0.3s"):
                await early
            t_early = loop.time() - t0
            with pytest.raises(DeadlineExceeded, match="1.5s"):
                await late
            t_late = loop.time() - t0
            assert 0.3 <= t_early < 1.2
            assert 1.5 <= t_late < 3.0
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


class _Deferred(Service):
    """``later`` answers with a coroutine and, before the server's task for it can start, has
    every such task cancelled (as a server that stops meanwhile does)."""

    name = "deferred"

    def __init__(self) -> None:
        super().__init__()
        self.ran = False

    @op
    def later(self, ctx) -> object:
        asyncio.get_running_loop().call_soon(self._cancel_handlers)  # runs before the new task's first step
        return self._body()

    async def _body(self) -> bool:
        self.ran = True
        return True

    @staticmethod
    def _cancel_handlers() -> None:
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__ == "RpcServer._run_async":
                task.cancel()


def test_a_handler_cancelled_before_it_starts_is_closed_not_left_unawaited(recwarn) -> None:
    async def main() -> None:
        service = _Deferred()
        server = RpcServer("inproc://deferred-1", {"deferred": service}, name="t")
        await server.start()
        client = RpcClient(identity="c")
        try:
            call = client.start_call(server.endpoint, "deferred", "later", {}, timeout=0.5)
            with pytest.raises(DeadlineExceeded):  # cancelled: no answer goes out
                await call
        finally:
            client.close()
            await server.close()
        assert not service.ran

    asyncio.run(main())
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
