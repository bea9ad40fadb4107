"""Embedding table semantics at the edges: half-precision sums, a lookup's own rows under
eviction, repeated ids from a peer, and arguments refused before anything changes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.state.sparse import has_repeats, unique_sum
from zmqflow.state.tables import HashTable
from zmqflow.testing import local_cluster
from zmqflow.wire.requests import ps as rq

from .conftest import arun

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
def test_repeated_half_precision_rows_are_summed_in_float32(dtype):
    """bfloat16 stops counting at 256: 3000 ones must come out near 3000, not 256."""
    ids, summed = unique_sum(np.array([4, 9, 4] * 1000), np.ones((3000, 2), dtype))
    assert summed.dtype == dtype and ids.tolist() == [4, 9]
    np.testing.assert_allclose(summed.astype(np.float32), [[2000, 2000], [1000, 1000]], rtol=1e-2)


def test_repeats_are_found_without_moving_rows():
    assert not has_repeats(np.array([3, 1, 2])) and has_repeats(np.array([3, 1, 3]))
    assert not has_repeats(np.array([], np.int64)) and not has_repeats(np.array([5]))


def test_a_lookup_never_evicts_the_rows_of_its_own_batch_to_make_room():
    """Row 1 was used before row 2; a batch of [1, new] in a full table of two must evict row 2,
    not the trained row it is reading (which it would then return as zeros)."""
    t = HashTable(2, np.float32, capacity=2)
    t.lookup(np.array([1]))
    t.lookup(np.array([2]))
    t.push(np.array([1]), np.full((1, 2), 5, np.float32))  # no optimizer: the gradient is added
    t.lookup(np.array([2]))  # row 2 is now the most recently used
    out = t.lookup(np.array([1, 3]))
    np.testing.assert_array_equal(out, [[5, 5], [0, 0]])
    assert sorted(t.export()[0].tolist()) == [1, 3] and t.evicted == 1


def test_a_dynamic_push_with_repeated_ids_sums_them_as_a_static_one_does():
    t = HashTable(2, np.float32)  # no optimizer: gradients are added
    t.lookup(np.array([7, 8]))
    assert t.push(np.array([7, 8, 7, 7]), np.ones((4, 2), np.float32)) == 2
    np.testing.assert_array_equal(t.lookup(np.array([7, 8]), create=False), [[3, 3], [1, 1]])


def test_bad_table_arguments_are_refused_before_anything_changes():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                for kw in ({"min_frequency": 0}, {"capacity": 0}, {"capacity": 2.5}):
                    with pytest.raises(errors.InvalidArgument, match=f"{next(iter(kw))} must be a positive int"):
                        await sess.embedding("d", None, 2, **kw)
                dyn = await sess.embedding("d", None, 2)  # the name is free: no half-made record
                await dyn.lookup(np.arange(10))
                ages = ({"older_than_steps": -1}, {"older_than_seconds": -5.0}, {"older_than_seconds": float("nan")})
                for kw in ages:
                    with pytest.raises(errors.InvalidArgument, match="must be >= 0"):
                        await dyn.evict(**kw)
                task = dyn.info.tasks[0]
                with pytest.raises(errors.InvalidArgument, match="older_than_step"):
                    await sess.call_task(task, "ps", "emb_evict", {"name": "d", "part": 0, "older_than_step": -1})
                assert await dyn.size() == 10
                with pytest.raises(errors.InvalidArgument, match="id 18446744073709551615 is past the largest id"):
                    await dyn.lookup(np.array([2**64 - 1], np.uint64))
                with pytest.raises(errors.InvalidArgument, match="past the largest id"):  # a peer's request too
                    await sess.call_task(task, "ps", "emb_push", rq.EmbPush(
                        name="d", part=0, ids=np.array([2**64 - 1], np.uint64), grads=np.ones((1, 2), np.float32)))
                assert await dyn.size() == 10
                static = await sess.embedding("s", 10, 2)
                with pytest.raises(errors.InvalidArgument, match="row -3 out of range"):
                    await sess.call_task(task, "ps", "emb_lookup",
                                         rq.EmbLookup(name="s", part=0, ids=np.array([4, -3])))
                with pytest.raises(errors.InvalidArgument, match="num_segments 2 must be >= 0 and above every"):
                    await static.lookup_sparse([1, 2], [0, 5], num_segments=2)
                with pytest.raises(errors.InvalidArgument, match="num_segments -1"):
                    await static.lookup_sparse([1, 2], [0, 1], num_segments=-1)

    arun(main())


def test_a_bfloat16_table_sums_a_hot_ids_gradients():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                emb = await sess.embedding("bf", 10, 2, dtype="bfloat16", optimizer=zf.optim.SGD(1.0))
                assert await emb.push(np.zeros(3000, np.int64), np.ones((3000, 2), BF16)) == 1
                np.testing.assert_allclose((await emb.lookup([0])).astype(np.float32), [[-3000, -3000]], rtol=1e-2)

    arun(main())


def test_an_export_while_rows_are_made_returns_each_row_held_throughout_once():
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                dyn = await sess.embedding("d", None, 2)
                await dyn.lookup([10, 20, 30, 40])
                seen = []
                async for ids, _ in dyn.export(page=2):
                    seen += ids.tolist()
                    await dyn.lookup([5 + len(seen)])  # a row made below the cursor, as training would
                assert seen == [10, 20, 30, 40]

    arun(main())
