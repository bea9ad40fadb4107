"""SyncState: a sync variable's gradients gathered per step, means taken, stale ones dropped."""

from __future__ import annotations


import numpy as np

from zmqflow.state.sync import PENDING, READY, STALE, SyncState


def test_sync_ready_after_aggregate_and_take_means():
    s = SyncState(3)
    g = [np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([5.0, 9.0])]
    assert s.offer(0, "w0", {(0, 2): g[0]}) == PENDING
    assert s.offer(0, "w1", {(0, 2): g[1]}) == PENDING
    assert s.missing(["w0", "w1", "w2"]) == ["w2"]
    assert s.offer(0, "w2", {(0, 2): g[2]}) == READY
    dense, sparse = s.take()
    assert sparse is None
    assert list(dense) == [(0, 2)]
    np.testing.assert_allclose(dense[(0, 2)], [3.0, 5.0])
    assert s.step == 1 and s.contributors == [] and s.missing(["w0", "w1", "w2"]) == ["w0", "w1", "w2"]
    assert s.describe()["step"] == 1 and s.describe()["pending"] == 0


def test_sync_offer_does_not_alias_the_gradient():
    s = SyncState(2)
    g = np.array([1.0, 1.0])
    s.offer(0, "w0", {(0, 2): g})
    s.offer(0, "w1", {(0, 2): g})
    assert np.array_equal(g, [1.0, 1.0])  # the sum is kept apart from the first gradient
    dense, _ = s.take()
    assert np.array_equal(dense[(0, 2)], [1.0, 1.0])


def test_sync_row_ranges_kept_apart_and_sparse_concatenated():
    s = SyncState(2)
    s.offer(0, "w0", {(0, 2): np.array([2.0, 2.0]), (2, 3): np.array([4.0])}, (np.array([1]), np.array([[2.0]])))
    assert s.offer(0, "w1", {(0, 2): np.array([4.0, 0.0])}, (np.array([1, 3]), np.array([[4.0], [6.0]]))) == READY
    dense, sparse = s.take()
    np.testing.assert_allclose(dense[(0, 2)], [3.0, 1.0])
    np.testing.assert_allclose(dense[(2, 3)], [2.0])
    idx, vals = sparse
    assert idx.tolist() == [1, 1, 3]
    np.testing.assert_allclose(vals, [[1.0], [2.0], [3.0]])


def test_sync_stale_gradients_dropped_and_counted():
    s = SyncState(2)
    s.offer(0, "w0", {(0, 1): np.array([1.0])})
    s.offer(0, "w1", {(0, 1): np.array([1.0])})
    s.take()
    assert s.offer(0, "w0", {(0, 1): np.array([100.0])}) == STALE
    assert s.dropped == 1 and s.contributors == []
    assert s.offer(1, "w0", {(0, 1): np.array([1.0])}) == PENDING
    assert s.offer(0, "w1", {(0, 1): np.array([100.0])}) == STALE
    assert s.dropped == 2 and s.describe()["dropped"] == 2
    assert s.missing(["w0", "w1"]) == ["w1"]
    assert s.offer(1, "w1", {(0, 1): np.array([3.0])}) == READY
    dense, _ = s.take()
    np.testing.assert_allclose(dense[(0, 1)], [2.0])  # the stale 100s are not in the mean
    assert s.step == 2


def test_sync_backup_replicas_arrive_late_and_are_stale():
    s = SyncState(2, total_num_replicas=3)
    assert s.offer(0, "w0", {(0, 1): np.array([1.0])}) == PENDING
    assert s.offer(0, "w2", {(0, 1): np.array([3.0])}) == READY
    dense, _ = s.take()
    np.testing.assert_allclose(dense[(0, 1)], [2.0])
    assert s.offer(0, "w1", {(0, 1): np.array([50.0])}) == STALE  # the straggler
    assert s.dropped == 1 and s.step == 1
    assert s.describe()["total_num_replicas"] == 3


def test_sync_a_replica_ahead_counts_for_the_current_step():
    s = SyncState(2)
    assert s.offer(5, "w0", {(0, 1): np.array([1.0])}) == PENDING
    assert s.offer(0, "w1", {(0, 1): np.array([1.0])}) == READY
    s.take()
    assert s.step == 1


def test_sync_half_precision_gradients_are_summed_in_float32_and_averaged_back():
    """Summed in their own dtype, 300 bfloat16 ones stop at 256 and eight float16 10000s
    overflow; summed in float32, the means are exact and come back in float32 (rounded once, by
    the update)."""
    import ml_dtypes

    for dtype, n, value in ((ml_dtypes.bfloat16, 300, 1.0), (np.float16, 8, 10000.0), (np.float16, 3000, 1.0)):
        s = SyncState(n)
        for i in range(n):
            s.offer(0, f"w{i}", {(0, 4): np.full(4, value, dtype)})
        dense, _ = s.take()
        assert dense[(0, 4)].dtype == np.float32
        np.testing.assert_array_equal(dense[(0, 4)], np.full(4, value, np.float32))


def test_sync_a_replica_counts_once_per_step_and_its_repeat_is_dropped():
    """A replica pushing again in a step that already counts it (a retry after its deadline)
    adds nothing: it cannot complete the step in another replica's place."""
    s = SyncState(2, total_num_replicas=3)
    assert s.offer(0, "w0", {(0, 1): np.array([1.0])}) == PENDING
    assert s.offer(0, "w0", {(0, 1): np.array([100.0])}) == PENDING
    assert s.contributors == ["w0"] and s.dropped == 1 and s.missing(["w0", "w1", "w2"]) == ["w1", "w2"]
    assert s.offer(0, "w2", {(0, 1): np.array([3.0])}) == READY
    dense, _ = s.take()
    np.testing.assert_allclose(dense[(0, 1)], [2.0])  # the repeat is not in the mean
    assert s.offer(1, "w0", {(0, 1): np.array([1.0])}) == PENDING  # counted again in the next step
    assert s.contributors == ["w0"]
