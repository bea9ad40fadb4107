"""``lookup_sparse(create=False)``: as ``lookup``'s, an unseen id of a dynamic table reads zeros
and is neither created nor counted towards admission; the default (True) creates it."""

from __future__ import annotations

import numpy as np

import zmqflow as zf
from zmqflow.bridge import runtime
from zmqflow.testing import local_cluster

from .conftest import arun

IDS = np.array([2**62 + 5, -(2**40), 7, 7])
SEGMENTS = np.array([0, 0, 1, 1])


def test_async_lookup_sparse_create_false_reads_zeros_and_adds_nothing():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                dyn = await sess.embedding("d", None, 3, initializer=zf.init.ones())
                got = await dyn.lookup_sparse(IDS, SEGMENTS, combiner="sum", create=False)
                np.testing.assert_array_equal(got, np.zeros((2, 3), np.float32))
                assert await dyn.size() == 0
                adm = await sess.embedding("adm", None, 2, min_frequency=2, initializer=zf.init.ones())
                for _ in range(3):  # never a sighting: the id stays unadmitted
                    await adm.lookup_sparse([11], [0], create=False)
                assert not (await adm.lookup([11])).any()  # the first sighting
                assert (await adm.lookup([11]) == 1.0).all()  # the second admits it
                got = await dyn.lookup_sparse(IDS, SEGMENTS, combiner="sum")  # the default creates
                np.testing.assert_array_equal(got, [[2.0] * 3, [2.0] * 3])
                assert await dyn.size() == 3

    arun(main())


def test_blocking_lookup_sparse_passes_create_through(local):
    sess = runtime.current().session
    dyn = sess.embedding("blocking_d", None, 2, initializer=zf.init.ones())
    got = dyn.lookup_sparse(IDS, SEGMENTS, combiner="mean", create=False)
    np.testing.assert_array_equal(got, np.zeros((2, 2), np.float32))
    assert dyn.size() == 0
    np.testing.assert_array_equal(dyn.lookup_sparse(IDS, SEGMENTS, combiner="mean"), np.ones((2, 2), np.float32))
    assert dyn.size() == 3
