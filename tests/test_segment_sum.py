"""The sum of a sparse gradient's rows per id (zmqflow/state/kernels_rows.c): reduceat's bits, run
for run and column for column (numpy's pairwise order, zeros' signs, infinities and NaN), strict
about what it is handed, and the same through ``unique_sum`` with the C loop on or off; the ids'
grouping by a hash table (``first_seen``, ``runs``) gives ``np.unique``'s answers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqflow.state import kernels as wrappers
from zmqflow.state.sparse import unique_inverse, unique_sum

kernels = wrappers._built
needs_kernels = pytest.mark.skipif(kernels is None, reason="zmqflow/state/kernels_c.c is not built here: numpy runs")


def _reference(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """unique_sum as numpy alone does it: the sort, the gather, reduceat."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    wide = rows.astype(np.float32) if rows.dtype == np.float16 else rows
    return ordered[starts], np.add.reduceat(wide[order], starts, axis=0).astype(rows.dtype)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("run", [1, 2, 7, 8, 9, 16, 129, 130, 300, 1000, 5000])  # each branch of numpy's pairwise sum
@pytest.mark.parametrize("cols", [1, 3, 64, 65, 200])  # one chunk of columns, more, a short last one
def test_a_run_of_any_length_sums_with_reduceats_bits(dtype: str, run: int, cols: int) -> None:
    rng = np.random.default_rng(run * 1000 + cols)
    ids = np.concatenate([np.full(run, 7), rng.integers(0, 50, 200)])  # one hot id, and many short runs
    rng.shuffle(ids)
    scale = 10.0 ** rng.integers(-3, 4 if dtype != "float16" else 1, (len(ids), 1))  # float16 sums stay finite
    rows = (rng.standard_normal((len(ids), cols)) * scale).astype(dtype)
    got, want = unique_sum(ids, rows), _reference(ids, rows)
    assert np.array_equal(got[0], want[0])
    assert _same_bits(got[1], want[1])


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_signed_zeros_infinities_and_nan_come_out_as_reduceats(dtype: str) -> None:
    """A run of -0.0 rows sums to -0.0 however long (the sum starts from addition's identity,
    -0.0, as numpy 2's does), and infinities of both signs make NaN, as in numpy."""
    special = np.array([-0.0, 0.0, np.inf, -np.inf, 1e30, -1e30, 1.0], dtype)
    rng = np.random.default_rng(3)
    for n in (1, 2, 9, 140):
        ids = rng.integers(0, 3, n * 3)
        ids[0] = 0
        rows = rng.choice(special, (len(ids), 4))
        rows[ids == 0] = -0.0
        with np.errstate(invalid="ignore"):  # inf + -inf
            got, want = unique_sum(ids, rows), _reference(ids, rows)
        assert np.array_equal(got[1], want[1], equal_nan=True)
        numbers = ~np.isnan(want[1])  # a NaN's sign is unspecified (kernels_c.c)
        assert np.array_equal(np.signbit(got[1])[numbers], np.signbit(want[1])[numbers])
        assert np.signbit(got[1][0]).all() and (got[1][0] == 0).all()  # id 0: -0.0 rows only


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=400), st.integers(1, 70), st.sampled_from(["f4", "f8"]))
def test_unique_sum_is_numpys_with_the_c_loop_on_or_off(ids: list[int], cols: int, dtype: str) -> None:
    ids_a = np.array(ids, np.int64)
    rows = np.random.default_rng(len(ids) * cols).standard_normal((len(ids), cols)).astype(dtype)
    want = _reference(ids_a, rows)
    before = wrappers.use_compiled(False)
    try:
        plain = unique_sum(ids_a, rows)
    finally:
        wrappers.use_compiled(before)
    for got in (unique_sum(ids_a, rows), plain):
        assert np.array_equal(got[0], want[0])
        assert _same_bits(got[1], want[1])


@needs_kernels
def test_rows_of_any_shape_and_layout_are_summed() -> None:
    """Rows of more than one dimension, and rows not contiguous (a column slice), are summed as numpy
    sums them; the caller's arrays are left as they were."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 9, 300)
    block = rng.standard_normal((300, 4, 6)).astype(np.float32)
    wide = rng.standard_normal((300, 40)).astype(np.float64)[:, ::3]
    for rows in (block, wide):
        copy = rows.copy()
        got, want = unique_sum(ids, rows), _reference(ids, rows)
        assert _same_bits(got[1], want[1])
        assert np.array_equal(rows, copy)


@needs_kernels
def test_the_c_loop_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    order = np.array([1, 0, 3, 2], np.int64)
    starts = np.array([0, 2], np.int64)
    out = np.full((2, 3), 9.0, np.float32)
    bad = {
        "order out of range": (out, rows, np.array([1, 0, 4, 2], np.int64), starts, 3),
        "negative order": (out, rows, np.array([1, 0, -1, 2], np.int64), starts, 3),
        "starts not from 0": (out, rows, order, np.array([1, 2], np.int64), 3),
        "starts not increasing": (out, rows, order, np.array([0, 0], np.int64), 3),
        "a start past the rows": (out, rows, order, np.array([0, 4], np.int64), 3),
        "rows of another length": (out, rows, order, starts, 2),
        "out too small": (np.full((1, 3), 9.0, np.float32), rows, order, starts, 3),
        "mixed float types": (out.astype(np.float64), rows, order, starts, 3),
        "int32 order": (out, rows, order.astype(np.int32), starts, 3),
        "integer rows": (out.astype(np.int32), rows.astype(np.int32), order, starts, 3),
        "out overlapping rows": (rows[:2], rows, order, starts, 3),
        "no columns": (out, rows, order, starts, 0),
    }
    for case, args in bad.items():
        before = args[0].copy()
        with pytest.raises((ValueError, TypeError, BufferError)):
            kernels.segment_sum(*args)
        assert np.array_equal(args[0], before), case
    with pytest.raises((ValueError, TypeError, BufferError)):
        kernels.segment_sum(np.zeros((2, 3), np.float32)[:, ::2], rows, order, starts, 3)  # out not contiguous
    kernels.segment_sum(out, rows, order, starts, 3)
    assert np.array_equal(out, [[3.0 + 0.0, 1.0 + 4.0, 2.0 + 5.0], [9.0 + 6.0, 10.0 + 7.0, 11.0 + 8.0]])


def test_no_ids_sum_to_no_rows() -> None:
    ids, rows = unique_sum(np.zeros(0, np.int64), np.zeros((0, 5), np.float32))
    assert ids.shape == (0,) and rows.shape == (0, 5) and rows.dtype == np.float32


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1)), max_size=300))
def test_unique_inverse_is_numpys_with_the_c_loop_on_or_off(ids: list[int]) -> None:
    """Any int64 ids, the extremes and negatives included: the sorted distinct ids, and each id's
    index among them, as np.unique gives them."""
    a = np.array(ids, np.int64)
    want = np.unique(a, return_inverse=True)
    before = wrappers.use_compiled(False)
    try:
        plain = unique_inverse(a)
    finally:
        wrappers.use_compiled(before)
    for got in (unique_inverse(a), plain):
        assert got[0].dtype == np.int64 and np.array_equal(got[0], want[0])
        assert np.array_equal(got[1], want[1].reshape(-1))


@needs_kernels
def test_ids_that_share_a_hash_slot_are_told_apart() -> None:
    """Ids a multiple of a large power of two apart, which a plain table would pile into one run of
    slots, and many copies of a few ids: grouped exactly, whatever the process's hash key."""
    ids = np.concatenate([np.arange(2000, dtype=np.int64) << 40, np.full(3000, 5, np.int64), np.arange(-50, 50)])
    np.random.default_rng(1).shuffle(ids)
    got, want = unique_inverse(ids), np.unique(ids, return_inverse=True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    first, inverse = wrappers.first_seen(ids)
    assert np.array_equal(first[inverse], ids)  # each id's index points at its own value
    assert len(np.unique(first)) == len(first)


@needs_kernels
def test_runs_are_a_stable_counting_sort() -> None:
    inverse = np.array([2, 0, 2, 1, 0, 2], np.int64)
    order, starts = wrappers.runs(inverse, 3)
    assert order.tolist() == [1, 4, 3, 0, 2, 5] and starts.tolist() == [0, 2, 3]
    before = wrappers.use_compiled(False)
    try:
        plain = wrappers.runs(inverse, 3)
    finally:
        wrappers.use_compiled(before)
    assert plain[0].tolist() == order.tolist() and plain[1].tolist() == starts.tolist()


@needs_kernels
def test_the_grouping_refuses_what_it_cannot_do() -> None:
    ids = np.arange(4, dtype=np.int64)
    room = np.empty(4, np.int64)
    for args in [(ids.astype(np.int32), 1, room, room.copy()),  # not int64
                 (ids, 1, np.empty(3, np.int64), room),  # too little room
                 (ids, 1, room, np.empty(4, np.int64)[::-1])]:  # not contiguous
        with pytest.raises((ValueError, TypeError, BufferError)):
            kernels.first_seen(*args)
    order, starts = np.full(4, 7, np.int64), np.full(2, 7, np.int64)
    for inv, u in [(np.array([0, 1, 2, 0], np.int64), 2), (np.array([0, -1, 1, 0], np.int64), 2)]:
        with pytest.raises(ValueError):
            kernels.runs(inv, u, order, starts)
        assert order.tolist() == [7] * 4 and starts.tolist() == [7, 7]  # nothing written
    with pytest.raises(ValueError):
        kernels.runs(np.zeros(4, np.int64), 3, order, starts)  # starts not u long


def _off_alignment(a: np.ndarray) -> np.ndarray:
    """``a``'s values in a view one byte off its type's alignment, as an array may lie in a frame."""
    raw = np.zeros(a.nbytes + 1, np.uint8)
    view = raw[1:].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert not view.flags.aligned
    return view


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_ids_and_rows_off_their_alignment_are_summed_alike(dtype: str) -> None:
    """A shard's ids and rows are views of a received frame, which need not be aligned: the sums,
    the grouping and lookup's uniques take them as they take aligned ones."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 40, 500).astype(np.int64)
    rows = rng.standard_normal((500, 6)).astype(dtype)
    want = _reference(ids, rows)
    got = unique_sum(_off_alignment(ids), _off_alignment(rows))
    assert np.array_equal(got[0], want[0]) and _same_bits(got[1], want[1])
    uniq, inverse = unique_inverse(_off_alignment(ids))
    assert np.array_equal(uniq, want[0]) and np.array_equal(uniq[inverse], ids)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_runs_may_read_a_row_more_than_once_and_weigh_it(dtype: str) -> None:
    """``order`` naming rows of a smaller array, some many times (a bag's rows read from the unique
    ones), each weighted or not: the sums are reduceat's over the (scaled) rows it names, with the
    C loop on or off."""
    rng = np.random.default_rng(12)
    rows = rng.standard_normal((30, 5)).astype(dtype)
    order = rng.integers(0, 30, 400).astype(np.int64)
    starts = np.flatnonzero(np.concatenate(([True], rng.random(399) < 0.05))).astype(np.int64)
    weights = rng.standard_normal(400).astype(dtype)
    for w in (None, weights):
        want = np.add.reduceat(rows[order] if w is None else rows[order] * w[:, None], starts, axis=0)
        before = wrappers.use_compiled(False)
        try:
            plain = wrappers.segment_sum(rows, order, starts, w)
        finally:
            wrappers.use_compiled(before)
        assert _same_bits(wrappers.segment_sum(rows, order, starts, w), want) and _same_bits(plain, want)
    if kernels is not None:
        out = np.empty((len(starts), 5), dtype)
        with pytest.raises(ValueError):  # a row past the array
            kernels.segment_sum(out, rows, np.full(400, 30, np.int64), starts, 5)
        for bad in (weights[:-1], weights.astype(np.float16), weights[::-1][::-1].reshape(20, 20)[:, ::2]):
            with pytest.raises((ValueError, TypeError, BufferError)):  # short, of another type, not contiguous
                kernels.segment_sum(out, rows, order, starts, 5, bad)
