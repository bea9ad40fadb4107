"""Retries with the same request id, and the server's record that runs each id once per peer.

A lost request or reply is retried by the client under the same id; a duplicate (a retry, or the
network delivering twice) is answered from the server's record instead of running again. Faults
come from the seeded injector, so each run loses and duplicates the same messages.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.rpc import RpcClient
from zmqflow.rpc.dedup import DONE, IN_FLIGHT, Dedup
from zmqflow.testing import REPLY, REQUEST, faulty_cluster
from zmqflow.wire.requests import ps as rq

from .conftest import DiagService, arun

CLIENTS, ADDS = 8, 50


def _diag(_task):
    return {"diag": DiagService()}


def test_eight_retrying_clients_under_drops_duplicates_and_delays_add_exactly_once_each():
    async def main():
        async with faulty_cluster({"ps": 1, "worker": 1}, timeout=10, seed=7) as (servers, faults):
            ps = servers["ps:0"]
            endpoint = ps.spec.address(zf.TaskId("ps", 0)).endpoint
            async with zf.AsyncSession(servers["worker:0"].target, name="user") as user:
                v = await user.variable("total", np.zeros((), np.float64))
                await v.read()
                faults.drop(direction=REQUEST, op="ps.assign", probability=0.2)
                faults.drop(direction=REPLY, op="ps.assign", probability=0.2)
                faults.duplicate(direction=REQUEST, op="ps.assign", probability=0.1)
                faults.duplicate(direction=REPLY, op="ps.assign", probability=0.1)
                faults.delay(0.03, direction=REQUEST, op="ps.assign", probability=0.1)
                faults.delay(0.03, direction=REPLY, op="ps.assign", probability=0.1)
                clients = [RpcClient(identity=f"adder-{i}", source=f"adder-{i}", retry_interval=0.02,
                                     default_timeout=10) for i in range(CLIENTS)]
                try:
                    async def adder(client: RpcClient) -> None:
                        for _ in range(ADDS):
                            req = rq.Assign(items=[rq.RowsItem("total", 0, None, None, np.ones((), np.float64))], mode="add")
                            assert await client.call(endpoint, "ps", "assign", req, name="ps:0") == 1

                    await asyncio.gather(*(adder(c) for c in clients))
                    faults.clear()
                    assert float(await v.read()) == CLIENTS * ADDS
                    actions = {a for a, _ in faults.log}
                    assert {"drop", "duplicate", "delay"} <= actions  # every fault happened
                    assert sum(c.retries for c in clients) > 0
                finally:
                    for c in clients:
                        c.close()

    arun(main(), timeout=60)


def test_a_request_delivered_twice_runs_once_and_the_duplicate_reply_is_ignored():
    async def main():
        async with faulty_cluster({"worker": 2}, timeout=10, services=_diag) as (servers, faults):
            w0, diag = servers["worker:0"], servers["worker:1"].service("diag")
            rule = faults.duplicate(direction=REQUEST, op="diag.add", times=1)
            assert await w0.call("worker:1", "diag", "add", {"a": 3}) == 3
            assert await w0.call("worker:1", "diag", "add", {"a": 4}) == 4  # after the duplicate was handled
            assert rule.fired == 1
            assert diag.calls == 2  # the duplicated request ran once

    arun(main())


def test_a_retried_call_whose_reply_was_dropped_gets_the_original_reply():
    async def main():
        async with faulty_cluster({"worker": 2}, timeout=10, services=_diag) as (servers, faults):
            diag = servers["worker:1"].service("diag")
            endpoint = servers["worker:1"].target
            rule = faults.drop(direction=REPLY, op="diag.add", times=1)
            client = RpcClient(identity="retrier", retry_interval=0.05, default_timeout=5)
            try:
                assert await client.call(endpoint, "diag", "add", {"a": 2, "b": 3}) == 5
                assert (rule.fired, client.retries, diag.calls) == (1, 1, 1)  # ran once, answered from the record
            finally:
                client.close()

    arun(main())


def test_without_retries_a_dropped_reply_still_times_out():
    async def main():
        async with faulty_cluster({"worker": 2}, timeout=10, services=_diag) as (servers, faults):
            faults.drop(direction=REPLY, op="diag.add", times=1)
            with pytest.raises(errors.DeadlineExceeded):
                await servers["worker:0"].call("worker:1", "diag", "add", {"a": 1}, timeout=0.2)
            assert servers["worker:1"].service("diag").calls == 1

    arun(main())


def test_a_client_that_starts_over_under_the_same_identity_gets_its_calls_run_anew():
    """A restarted task reuses its routing identity. Its first calls, the same op and body as its
    predecessor's first calls, must run again, not be answered from the record of the old ones."""
    async def main():
        async with faulty_cluster({"worker": 2}, timeout=10, services=_diag) as (servers, faults):
            diag, endpoint = servers["worker:1"].service("diag"), servers["worker:1"].target
            for incarnation in range(3):
                client = RpcClient(identity="worker:0", default_timeout=5)  # as a restarted task's own client
                try:
                    assert await client.call(endpoint, "diag", "add", {"a": 2, "b": 3}, timeout=1.0) == 5
                finally:
                    client.close()
                assert diag.calls == incarnation + 1

    arun(main())


def test_the_record_is_bounded_per_peer_and_tells_a_new_incarnation_from_a_retry():
    d = Dedup(per_peer=3, max_kept_reply=4)
    for rid in range(1, 6):
        assert d.begin(b"p", rid, b"h%d" % rid, 0.0) is None
    assert d.size(b"p") == 3  # ids 3, 4, 5
    assert d.begin(b"p", 5, b"h5", 0.0) is IN_FLIGHT
    d.finish(b"p", 5, [b"ok"], 2)
    assert d.begin(b"p", 5, b"h5", 0.0) == (b"ok",)
    d.finish(b"p", 4, [b"too big"], 7)
    assert d.begin(b"p", 4, b"h4", 0.0) is DONE
    assert d.begin(b"p", 5, b"other", 0.0) is None  # same id, other request: a restarted client
    assert d.size(b"p") == 1
    d.begin(b"q", 1, b"x", 0.0)
    assert d.sweep(10.0, lambda peer: peer != b"q") == 1 and d.peers() == 1
    assert d.sweep(10.0 + d.idle_s + 1, lambda peer: True) == 1 and d.peers() == 0


def test_retry_interval_must_be_positive():
    async def main():
        with pytest.raises(ValueError, match="retry_interval"):
            RpcClient(identity="x", retry_interval=0)

    arun(main())
