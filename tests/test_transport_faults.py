"""Each fault the injector makes, made to happen exactly once, where the test says, by rule and seed."""

from __future__ import annotations

import asyncio
import time

import pytest

from zmqflow import errors
from zmqflow.rpc import CallContext, RpcClient, RpcServer, Service, op
from zmqflow.testing import REPLY, REQUEST, FaultInjector, async_wait_until, faulty_cluster, free_port
from zmqflow.transport import DOWN, UP, ZmqTransport

from .conftest import DiagService, arun


class Journal(Service):
    """Records the order in which requests arrive."""

    name = "journal"

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[int] = []

    @op
    def note(self, ctx: CallContext, n: int) -> int:
        self.entries.append(n)
        return n


def _services(_task):
    return {"diag": DiagService(), "journal": Journal()}


def cluster(**kw):
    return faulty_cluster({"worker": 2}, timeout=10, services=_services, **kw)


def test_a_dropped_reply_is_a_deadline_exceeded_naming_the_op_and_only_that_one_is_lost():
    async def main():
        async with cluster() as (servers, faults):
            w0 = servers["worker:0"]
            rule = faults.drop(direction=REPLY, op="diag.add", server="worker:1", times=1)
            with pytest.raises(errors.DeadlineExceeded, match=r"diag\.add on worker:1 did not answer within 0.3s"):
                await w0.call("worker:1", "diag", "add", {"a": 1}, timeout=0.3)
            assert servers["worker:1"].service("diag").calls == 1  # the request arrived; its reply did not
            assert await w0.call("worker:1", "diag", "add", {"a": 2}) == 2  # the rule fired once
            assert (rule.fired, [a for a, _ in faults.log]) == (1, ["drop"])
            assert faults.log[0][1].direction == REPLY and faults.log[0][1].what == "diag.add"

    arun(main())


def test_a_dropped_request_never_reaches_the_server():
    async def main():
        async with cluster() as (servers, faults):
            faults.drop(direction=REQUEST, op="add", client="worker:0", times=1)
            with pytest.raises(errors.DeadlineExceeded, match="diag.add"):
                await servers["worker:0"].call("worker:1", "diag", "add", {"a": 1}, timeout=0.2)
            assert servers["worker:1"].service("diag").calls == 0
            assert await servers["worker:0"].call("worker:1", "diag", "add", {"a": 5}) == 5

    arun(main())


TIMER_SLACK = 0.01  # how much earlier than asked a loop timer may fire, measured by time.monotonic()


def test_a_delayed_request_arrives_late_and_other_servers_are_not_delayed():
    async def main():
        async with faulty_cluster({"worker": 3}, timeout=10, services=_services) as (servers, faults):
            w0 = servers["worker:0"]
            faults.delay(0.2, direction=REQUEST, server="worker:1")
            assert await w0.call("worker:2", "diag", "add", {"a": 1}) == 1
            # the rule touched nothing bound for worker:2 (a wall-clock bound would be timing luck)
            assert [(a, p.server) for a, p in faults.log] == []
            start = time.monotonic()
            assert await w0.call("worker:1", "diag", "add", {"a": 2}) == 2
            # the delay is a loop timer; uvloop's (libuv's) count from the loop's cached clock, which
            # may lag time.monotonic() by what this iteration has run so far: it can end a little early
            assert time.monotonic() - start >= 0.2 - TIMER_SLACK
            with pytest.raises(errors.DeadlineExceeded):  # a deadline shorter than the delay expires first
                await w0.call("worker:1", "diag", "add", {"a": 3}, timeout=0.1)
            assert [(a, p.server) for a, p in faults.log] == [("delay", "worker:1")] * 2

    arun(main())


def test_a_duplicated_reply_is_ignored_by_the_client():
    async def main():
        async with cluster() as (servers, faults):
            w0 = servers["worker:0"]
            faults.duplicate(direction=REPLY, op="diag.add", times=1)
            late = w0.counters.late_replies
            assert await w0.call("worker:1", "diag", "add", {"a": 7}) == 7
            await async_wait_until(lambda: w0.counters.late_replies == late + 1, 5, what="the duplicate to arrive")
            assert servers["worker:1"].service("diag").calls == 1
            assert await w0.call("worker:1", "diag", "add", {"a": 8}) == 8

    arun(main())


def test_a_duplicated_request_runs_once_and_its_second_reply_is_ignored():
    async def main():
        async with cluster() as (servers, faults):
            w0 = servers["worker:0"]
            faults.duplicate(direction=REQUEST, op="diag.add", times=1)
            assert await w0.call("worker:1", "diag", "add", {"a": 1}) == 1
            # the server answers the duplicate from its record of request ids instead of running it
            await async_wait_until(lambda: w0.counters.late_replies >= 1, 5, what="the second reply ignored")
            assert servers["worker:1"].service("diag").calls == 1

    arun(main())


def test_a_reordered_request_arrives_after_the_next_one():
    async def main():
        async with cluster() as (servers, faults):
            w0 = servers["worker:0"]
            endpoint = w0.spec.address("worker:1").endpoint
            faults.reorder(op="journal.note", when=lambda p: p.direction == REQUEST, times=1)
            calls = [w0.client.start_call(endpoint, "journal", "note", {"n": i}, name="worker:1") for i in range(4)]
            assert await asyncio.gather(*calls) == [0, 1, 2, 3]  # replies are matched by id, whatever the order
            assert servers["worker:1"].service("journal").entries == [1, 0, 2, 3]

    arun(main())


def test_a_held_request_stays_in_flight_until_released():
    async def main():
        async with cluster() as (servers, faults):
            w0, journal = servers["worker:0"], servers["worker:1"].service("journal")
            rule = faults.hold(op="journal.note", direction=REQUEST)
            call = asyncio.ensure_future(w0.call("worker:1", "journal", "note", {"n": 1}))
            await async_wait_until(lambda: rule.held, 5, what="the request to be held")
            assert journal.entries == [] and not call.done()
            assert rule.release() == 1
            assert await call == 1 and journal.entries == [1]
            assert await w0.call("worker:1", "journal", "note", {"n": 2}) == 2  # released rules hold no more

    arun(main())


def test_a_disconnect_fails_calls_in_flight_and_the_peer_is_reachable_when_it_returns():
    async def main():
        async with cluster() as (servers, faults):
            w0 = servers["worker:0"]
            endpoint = w0.spec.address("worker:1").endpoint
            assert await w0.call("worker:1", "diag", "add", {"a": 1}) == 1
            seen = servers["worker:1"].counters.msgs_in
            hanging = asyncio.ensure_future(w0.call("worker:1", "diag", "hang", timeout=30))
            await async_wait_until(lambda: servers["worker:1"].counters.msgs_in > seen, 5, what="the call in flight")
            assert faults.disconnect("worker:1", client="worker:0") == 1
            with pytest.raises(errors.Unavailable, match="connection to worker:1 dropped during diag.hang"):
                await hanging
            assert w0.client.peer_state(endpoint) == DOWN and w0.client.down_since(endpoint) is not None
            # the server cannot reach the cut client either (what a shard's liveness check asks)
            assert not servers["worker:1"].client_reachable(b"worker:0")
            waiting = asyncio.ensure_future(w0.call("worker:1", "diag", "add", {"a": 2}, timeout=5))
            await asyncio.sleep(0)
            assert not waiting.done()  # within the reconnect grace, a call waits for the peer to return
            assert faults.reconnect("worker:1", client="worker:0") == 1
            assert await waiting == 2
            assert w0.client.peer_state(endpoint) == UP and servers["worker:1"].client_reachable(b"worker:0")

    arun(main())


def test_a_timed_disconnect_comes_back_by_itself():
    async def main():
        async with cluster() as (servers, faults):
            w0 = servers["worker:0"]
            endpoint = w0.spec.address("worker:1").endpoint
            assert await w0.call("worker:1", "diag", "add", {"a": 1}) == 1
            faults.disconnect("worker:1", for_s=0.2)
            assert w0.client.peer_state(endpoint) == DOWN
            await async_wait_until(lambda: w0.client.peer_state(endpoint) == UP, 5, what="the connection back")
            assert await w0.call("worker:1", "diag", "add", {"a": 3}) == 3

    arun(main())


def test_random_drops_are_the_same_for_the_same_seed():
    async def run(seed: int) -> list[int]:
        async with cluster(seed=seed) as (servers, faults):
            faults.drop(direction=REQUEST, op="journal.note", probability=0.3)
            endpoint = servers["worker:0"].spec.address("worker:1").endpoint
            calls = [servers["worker:0"].client.start_call(endpoint, "journal", "note", {"n": i}, timeout=0.5, name="worker:1")
                     for i in range(40)]
            await asyncio.gather(*calls, return_exceptions=True)
            return list(servers["worker:1"].service("journal").entries)

    async def main():
        first, again, other = await run(7), await run(7), await run(8)
        assert first == again and 0 < len(first) < 40
        assert other != first

    arun(main())


def test_the_injector_wraps_a_real_zeromq_transport():
    async def main():
        faults = FaultInjector(ZmqTransport(), seed=1)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        server = RpcServer(endpoint, {"diag": DiagService()}, name="srv", transport=faults)
        await server.start()
        client = RpcClient(identity="c", transport=faults)
        try:
            faults.drop(direction=REPLY, op="diag.add", times=1)
            with pytest.raises(errors.DeadlineExceeded, match="diag.add on srv"):
                await client.call(endpoint, "diag", "add", {"a": 1}, timeout=0.3, name="srv")
            assert await client.call(endpoint, "diag", "add", {"a": 2}, timeout=5, name="srv") == 2
            faults.disconnect("srv")
            with pytest.raises(errors.Unavailable):
                await client.call(endpoint, "diag", "add", {"a": 3}, timeout=0.3, name="srv")
            faults.reconnect("srv")
            assert await client.call(endpoint, "diag", "add", {"a": 4}, timeout=5, name="srv") == 4
        finally:
            client.close()
            await server.close()
        assert faults.open_count() == (0, 0)

    arun(main())


def test_rules_check_what_they_are_given():
    faults = FaultInjector()
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        faults.add("explode")
    with pytest.raises(ValueError, match="direction must be"):
        faults.drop(direction="sideways")
