"""What a ps shard remembers of its clients between fences stays bounded by the live ones."""

from __future__ import annotations

import pytest

from zmqflow import errors
from zmqflow.rpc import CallContext
from zmqflow.server.services.fence import MAX_USED_PEERS
from zmqflow.server.services.ps import PsService
from zmqflow.wire.requests import ps as rq


def _ctx(op: str, peer: bytes) -> CallContext:
    return CallContext("ps", op, peer, "worker:0", None)


def test_gone_clients_are_dropped_and_live_ones_still_refused_after_a_fence() -> None:
    live = {b"live-%d" % i for i in range(5)}
    probed: list[bytes] = []

    def reachable(peer: bytes) -> bool:
        probed.append(peer)
        return peer in live

    ps = PsService(reachable=reachable)
    for peer in sorted(live):
        ps.check_fence("pull", peer)
    for i in range(20 * MAX_USED_PEERS):  # every new connection has a new routing id
        ps.check_fence("pull", b"gone-%d" % i)
        ps.check_fence("push", b"gone-%d" % i)
    assert ps.fence_state()["data_clients"] <= MAX_USED_PEERS + 1
    assert len(probed) < 3 * 20 * MAX_USED_PEERS  # pruned now and then, not on every op

    epoch = ps.fence(_ctx("fence", b"chief"), rq.Empty())
    assert ps.unfence(_ctx("unfence", b"chief"), rq.Unfence(epoch=epoch))
    for peer in sorted(live):  # used before the fence: the first op after it is refused, once
        with pytest.raises(errors.Recovering, match="first request since this shard was restored"):
            ps.check_fence("pull", peer)
        ps.check_fence("pull", peer)
    ps.check_fence("pull", b"gone-0")  # gone, so it cannot send; a new client is not refused
    assert ps.fence_state()["data_clients"] == len(live) + 1


def test_without_reachability_nothing_is_forgotten() -> None:
    """Dropping a client that may still be connected would let its stale request through."""
    ps = PsService()
    for i in range(MAX_USED_PEERS + 10):
        ps.check_fence("pull", b"p-%d" % i)
    assert ps.fence_state()["data_clients"] == MAX_USED_PEERS + 10
    ps.fence(_ctx("fence", b"chief"), rq.Empty())
    assert ps.fence_state()["data_clients"] == 0
