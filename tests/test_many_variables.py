"""A model of thousands of variables on one shard: its pushes, pulls and steps go in several
requests a shard (``var_info.ITEMS_PER_REQUEST`` items each), never in one of more frames than a
peer reads of a message (``wire.Limits.max_frames``), which it would refuse."""

from __future__ import annotations

from collections import namedtuple

import numpy as np

import zmqflow as zf
from zmqflow.client import push_read
from zmqflow.client.var_info import ITEMS_PER_REQUEST, VarInfo, runs_of_parts
from zmqflow.cluster import TaskId
from zmqflow.testing import local_cluster
from zmqflow.wire.message import Limits

from .conftest import arun

COUNT = 4100  # past the 4096 frames of a message


def test_thousands_of_sync_variables_on_one_shard_push_pull_and_step():
    assert COUNT > Limits().max_frames

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=60, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target, timeout=30) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                names = [f"v{i}" for i in range(COUNT)]
                for i, n in enumerate(names):
                    await sess.variable(n, np.full(2, i, np.float32), optimizer=opt)
                start = await sess.pull(names)
                assert all(start[n].tolist() == [i, i] for i, n in enumerate(names))
                ones = {n: np.ones(2, np.float32) for n in names}
                await sess.push(ones, step=0)
                got = await sess.push_pull(ones, step=1)
                assert sess.step == 2
                assert all(got[n].tolist() == [i - 2, i - 2] for i, n in enumerate(names))
                again = await sess.pull(names)
                assert all(np.array_equal(again[n], got[n]) for n in names)

    arun(main(), timeout=100)


def test_runs_of_parts_never_split_a_part():
    Item = namedtuple("Item", "name part")
    a, b0, b1, c = Item("a", 0), Item("b", 0), Item("b", 1), Item("c", 0)
    items = [a] * 3 + [b0] * 2 + [b1] + [c] * 4
    assert runs_of_parts(items, cap=2) == [[a] * 3, [b0] * 2, [b1] + [c] * 4]  # cut only where a part ends
    assert runs_of_parts(items) == [items] and runs_of_parts([]) == [[]]


def test_a_group_of_more_parts_a_shard_than_a_request_holds_does_not_read_back():
    shard = TaskId("ps", 0)

    def info(i: int) -> VarInfo:
        return VarInfo(f"v{i}", (1,), np.dtype(np.float32), ((shard, 0, 1),), None, None)

    few = {info(i): np.ones(1, np.float32) for i in range(ITEMS_PER_REQUEST)}
    many = {info(i): np.ones(1, np.float32) for i in range(ITEMS_PER_REQUEST + 1)}
    assert push_read.readable(few) and not push_read.readable(many)
