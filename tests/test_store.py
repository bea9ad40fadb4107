"""The sans-IO parameter-server pieces: shard store, initializers, partitioners, sync state, catalog."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from zmqflow.state import init
from zmqflow.errors import InvalidArgument, NotFound, VariableConflict
from zmqflow.state.optim import Adam, Momentum
from zmqflow.state.catalog import Catalog
from zmqflow.state.partition import (
    Partitioner,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    num_partitions,
    row_splits,
)
from zmqflow.state.store import ShardStore
from zmqflow.state.sync import PENDING, READY, STALE, SyncState

F32, F64 = np.dtype("float32"), np.dtype("float64")


def filled_store(optimizer=None) -> ShardStore:
    """A store holding ``w``: a (6, 3) float64 variable with distinct values."""
    store = ShardStore()
    value = np.arange(18, dtype=np.float64).reshape(6, 3) / 7.0
    store.create("w", 0, [6, 3], [0, 6], "float64", value=value, optimizer=optimizer)
    return store


def state(store: ShardStore, name: str = "w", part: int = 0):
    p = store.get(name, part)
    steps = None if p.steps is None else p.steps.copy()
    return p.value.copy(), {k: s.copy() for k, s in p.slots.items()}, steps


def assert_same_state(store: ShardStore, before, name: str = "w", part: int = 0) -> None:
    value, slots, steps = before
    p = store.get(name, part)
    assert np.array_equal(p.value, value)
    assert p.value.dtype == value.dtype
    assert set(p.slots) == set(slots)
    for k in slots:
        assert np.array_equal(p.slots[k], slots[k])
    if steps is not None:
        assert np.array_equal(p.steps, steps)


# === ShardStore: create ===========================================================================


def test_create_from_initializer_object_and_spec():
    store = ShardStore()
    assert store.create("a", 0, [4, 3], [0, 4], "float32", initializer=init.constant(2.5)) is True
    assert store.create("b", 0, [4, 3], [0, 4], "float32", initializer=init.constant(2.5).spec()) is True
    for name in ("a", "b"):
        v = store.read(name)
        assert v.shape == (4, 3) and v.dtype == F32
        assert np.all(v == np.float32(2.5))


def test_create_defaults_to_zeros_and_builds_only_its_rows():
    store = ShardStore()
    store.create("z", 0, [10, 2], [0, 10], "float64")
    assert np.array_equal(store.read("z"), np.zeros((10, 2)))
    store.create("n", 2, [10, 2], [7, 10], "float64", num_parts=3, initializer=init.normal(seed=3))
    p = store.get("n", 2)
    assert p.value.shape == (3, 2) and p.rows == (7, 10) and p.full_shape == (10, 2) and p.num_parts == 3
    # the part's values are the initializer's for rows [7, 10) of the whole shape
    assert np.array_equal(p.value, init.build(init.normal(seed=3), (10, 2), (7, 10), F64))


def test_create_from_value_copies_it():
    store = ShardStore()
    src = np.arange(6, dtype=np.float64).reshape(3, 2)
    store.create("v", 0, [3, 2], [0, 3], "float64", value=src)
    src[...] = -1
    assert np.array_equal(store.read("v"), np.arange(6, dtype=np.float64).reshape(3, 2))


def test_create_scalar():
    store = ShardStore()
    assert store.create("s", 0, [], [0, 1], "float64", value=np.array(3.0))
    assert store.read("s").shape == () and store.read("s") == 3.0
    store.create("t", 0, [], [0, 1], "float32", initializer=init.ones())
    assert store.read("t").dtype == F32 and store.read("t") == 1.0


def test_identical_recreate_returns_false_and_keeps_the_value():
    store = ShardStore()
    assert store.create("w", 0, [4, 2], [0, 4], "float64", initializer=init.ones())
    store.assign("w", 0, np.full((4, 2), 7.0))
    assert store.create("w", 0, [4, 2], [0, 4], "float64", initializer=init.zeros()) is False
    assert np.array_equal(store.read("w"), np.full((4, 2), 7.0))


@pytest.mark.parametrize(
    "shape, rows, dtype, num_parts, needles",
    [
        ([5, 2], [0, 4], "float64", 1, ["[4, 2]", "[5, 2]"]),
        ([4, 2], [0, 4], "float32", 1, ["float64", "float32"]),
        ([4, 3], [0, 4], "float32", 1, ["[4, 2] float64", "[4, 3] float32"]),
        ([4, 2], [0, 2], "float64", 1, ["[0, 4]", "[0, 2]"]),
        ([4, 2], [0, 4], "float64", 2, ["1 parts", "2 parts"]),
    ],
)
def test_conflicting_recreate_names_both(shape, rows, dtype, num_parts, needles):
    store = ShardStore()
    store.create("w", 0, [4, 2], [0, 4], "float64", initializer=init.ones())
    with pytest.raises(VariableConflict) as info:
        store.create("w", 0, shape, rows, dtype, num_parts=num_parts)
    msg = str(info.value)
    assert "'w'" in msg or "variable w" in msg
    for needle in needles:
        assert needle in msg, msg
    assert np.array_equal(store.read("w"), np.ones((4, 2)))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(shape=[3, 2], rows=[0, 3], dtype="float128"), "float128"),
        (dict(shape=[3, -2], rows=[0, 3], dtype="float64"), "shape"),
        (dict(shape=[3, 2], rows=[0, 4], dtype="float64"), "rows"),
        (dict(shape=[3, 2], rows=[2, 1], dtype="float64"), "rows"),
        (dict(shape=[3, 2], rows=[0, 3], dtype="float64", value=np.zeros((3, 2), np.float32)), "float32"),
        (dict(shape=[3, 2], rows=[0, 3], dtype="float64", value=np.zeros((2, 3))), "[2, 3]"),
        (dict(shape=[3, 2], rows=[0, 3], dtype="float64", initializer={"kind": "xavier"}), "xavier"),
    ],
)
def test_bad_create_raises_and_stores_nothing(kwargs, needle):
    store = ShardStore()
    with pytest.raises(InvalidArgument) as info:
        store.create("w", 0, kwargs.pop("shape"), kwargs.pop("rows"), kwargs.pop("dtype"), **kwargs)
    assert needle in str(info.value)
    assert store.parts == {}
    with pytest.raises(NotFound):
        store.get("w")


def test_optimizer_updates_a_value_given_in_fortran_order():
    store = ShardStore()
    value = np.asfortranarray(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    store.create("w", 0, [2, 3, 4], [0, 2], "float64", value=value, optimizer={"kind": "sgd", "learning_rate": 1.0})
    store.apply_dense("w", 0, np.ones((2, 3, 4)))
    assert np.array_equal(store.read("w"), value - 1.0)


def test_get_unknown_names_it():
    store = filled_store()
    with pytest.raises(NotFound, match="'nope'"):
        store.get("nope")
    with pytest.raises(NotFound, match=r"w \(part 3\)"):
        store.get("w", 3)


def test_nbytes_counts_value_slots_and_step_counts():
    store = ShardStore()
    store.create("a", 0, [4, 2], [0, 4], "float32")
    store.create("b", 0, [4, 2], [0, 4], "float64", optimizer=Adam().spec())
    assert store.get("a").nbytes == 32
    assert store.get("b").nbytes == 64 * 3 + 4 * 8  # value, m, v, and Adam's step count per row
    assert store.nbytes == 32 + 224


# === ShardStore: reads and writes ==================================================================


def test_read_returns_a_copy():
    store = filled_store()
    before = state(store)
    r = store.read("w")
    r[...] = 99.0
    rows = store.read("w", 0, 1, 3)
    assert np.array_equal(rows, before[0][1:3])
    rows[...] = -5.0
    assert_same_state(store, before)
    s = ShardStore()
    s.create("s", 0, [], [0, 1], "float64", value=np.array(1.5))
    x = s.read("s")
    x[...] = 0.0
    assert s.read("s") == 1.5


@pytest.mark.parametrize("mode", ["set", "add", "sub"])
def test_assign_row_range(mode):
    store = filled_store()
    before = store.read("w")
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    store.assign("w", 0, x, mode, 2, 4)
    after = store.read("w")
    want = {"set": x, "add": before[2:4] + x, "sub": before[2:4] - x}[mode]
    assert np.array_equal(after[2:4], want)
    assert np.array_equal(after[:2], before[:2]) and np.array_equal(after[4:], before[4:])


def test_assign_whole_and_scalar():
    store = filled_store()
    store.assign("w", 0, np.ones((6, 3)))
    assert np.array_equal(store.read("w"), np.ones((6, 3)))
    store.create("s", 0, [], [0, 1], "float64", value=np.array(1.0))
    store.assign("s", 0, np.array(2.0), "add")
    store.assign("s", 0, np.array(0.5), "sub")
    assert store.read("s") == 2.5


def test_scatter_add_sums_duplicates_and_update_writes():
    store = filled_store()
    before = store.read("w")
    rows = np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [4.0, 4.0, 4.0]])
    store.scatter("w", 0, np.array([1, 4, 1]), rows, "add")
    after = store.read("w")
    assert np.array_equal(after[1], before[1] + 5.0)
    assert np.array_equal(after[4], before[4] + 2.0)
    untouched = [0, 2, 3, 5]
    assert np.array_equal(after[untouched], before[untouched])
    store.scatter("w", 0, np.array([0, 5]), np.array([[9.0] * 3, [8.0] * 3]), "update")
    after2 = store.read("w")
    assert np.array_equal(after2[0], [9.0] * 3) and np.array_equal(after2[5], [8.0] * 3)
    assert np.array_equal(after2[1:5], after[1:5])


def test_scatter_on_a_part_uses_local_indices():
    store = ShardStore()
    store.create("e", 1, [10, 2], [4, 7], "float64", num_parts=2)
    store.scatter("e", 1, np.array([0, 2]), np.array([[1.0, 1.0], [3.0, 3.0]]), "add")
    assert np.array_equal(store.read("e", 1), [[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]])


# --- bad input changes nothing -----------------------------------------------------------------


def _ops_with_bad_input():
    good_rows = np.ones((2, 3))
    return [
        # (call, error type, needles that must appear in the message)
        ("assign dtype", lambda s: s.assign("w", 0, np.ones((6, 3), np.float32)), InvalidArgument, ["float64", "float32"]),
        ("assign shape", lambda s: s.assign("w", 0, np.ones((5, 3))), InvalidArgument, ["[6, 3]", "[5, 3]"]),
        ("assign range shape", lambda s: s.assign("w", 0, np.ones((3, 3)), "add", 1, 3), InvalidArgument, ["[2, 3]", "[3, 3]"]),
        ("assign rows", lambda s: s.assign("w", 0, good_rows, "set", 5, 7), InvalidArgument, ["[5, 7)", "6 rows"]),
        ("assign mode", lambda s: s.assign("w", 0, np.ones((6, 3)), "mul"), InvalidArgument, ["'mul'"]),
        ("assign list", lambda s: s.assign("w", 0, [[1.0] * 3] * 6), InvalidArgument, ["list"]),
        ("scatter dtype", lambda s: s.scatter("w", 0, np.array([0, 1]), np.ones((2, 3), np.int64)), InvalidArgument, ["float64", "int64"]),
        ("scatter shape", lambda s: s.scatter("w", 0, np.array([0, 1]), np.ones((2, 4))), InvalidArgument, ["[2, 3]", "[2, 4]"]),
        ("scatter count", lambda s: s.scatter("w", 0, np.array([0, 1, 2]), good_rows), InvalidArgument, ["[3, 3]", "[2, 3]"]),
        ("scatter index", lambda s: s.scatter("w", 0, np.array([0, 6]), good_rows), InvalidArgument, ["index 6", "[0, 6)"]),
        ("scatter negative", lambda s: s.scatter("w", 0, np.array([-1, 2]), good_rows), InvalidArgument, ["index -1", "[0, 6)"]),
        ("scatter float idx", lambda s: s.scatter("w", 0, np.array([0.0, 1.0]), good_rows), InvalidArgument, ["integer", "float64"]),
        ("scatter 2d idx", lambda s: s.scatter("w", 0, np.array([[0, 1]]), good_rows), InvalidArgument, ["1-D"]),
        ("scatter mode", lambda s: s.scatter("w", 0, np.array([0, 1]), good_rows, "max"), InvalidArgument, ["'max'"]),
        ("dense dtype", lambda s: s.apply_dense("w", 0, np.ones((6, 3), np.float32)), InvalidArgument, ["float64", "float32"]),
        ("dense shape", lambda s: s.apply_dense("w", 0, np.ones((6, 2))), InvalidArgument, ["[6, 3]", "[6, 2]"]),
        ("dense range", lambda s: s.apply_dense("w", 0, good_rows, 4, 8), InvalidArgument, ["[4, 8)"]),
        ("dense range shape", lambda s: s.apply_dense("w", 0, good_rows, 0, 3), InvalidArgument, ["[3, 3]", "[2, 3]"]),
        ("sparse dtype", lambda s: s.apply_sparse("w", 0, np.array([0, 1]), np.ones((2, 3), np.float32)), InvalidArgument, ["float64", "float32"]),
        ("sparse shape", lambda s: s.apply_sparse("w", 0, np.array([0, 1]), np.ones((2, 1))), InvalidArgument, ["[2, 3]", "[2, 1]"]),
        ("sparse index", lambda s: s.apply_sparse("w", 0, np.array([1, 9, 1]), np.ones((3, 3))), InvalidArgument, ["index 9", "[0, 6)"]),
        ("read range", lambda s: s.read("w", 0, 2, 9), InvalidArgument, ["[2, 9)"]),
        ("unknown assign", lambda s: s.assign("ghost", 0, np.ones((6, 3))), NotFound, ["ghost"]),
        ("unknown scatter", lambda s: s.scatter("ghost", 0, np.array([0, 1]), good_rows), NotFound, ["ghost"]),
        ("unknown dense", lambda s: s.apply_dense("ghost", 0, np.ones((6, 3))), NotFound, ["ghost"]),
        ("unknown sparse", lambda s: s.apply_sparse("ghost", 0, np.array([0, 1]), good_rows), NotFound, ["ghost"]),
        ("unknown part", lambda s: s.apply_dense("w", 1, np.ones((6, 3))), NotFound, ["w (part 1)"]),
        ("unknown read", lambda s: s.read("ghost"), NotFound, ["ghost"]),
    ]


@pytest.mark.parametrize("optimizer", [None, Adam().spec(), Momentum(nesterov=True).spec()], ids=["plain", "adam", "nesterov"])
@pytest.mark.parametrize("what, call, error, needles", _ops_with_bad_input(), ids=[o[0] for o in _ops_with_bad_input()])
def test_bad_input_raises_and_changes_nothing(optimizer, what, call, error, needles):
    store = filled_store(optimizer)
    # some history first, so slots and steps are not trivially zero
    store.apply_dense("w", 0, np.full((6, 3), 0.25))
    store.apply_sparse("w", 0, np.array([2]), np.full((1, 3), -0.5))
    before = state(store)
    with pytest.raises(error) as info:
        call(store)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert_same_state(store, before)


def test_scalar_variable_refuses_sparse_ops():
    store = ShardStore()
    store.create("s", 0, [], [0, 1], "float64", value=np.array(1.0), optimizer=Adam().spec())
    before = state(store, "s")
    for call in (
        lambda: store.scatter("s", 0, np.array([0]), np.ones(1)),
        lambda: store.apply_sparse("s", 0, np.array([0]), np.ones(1)),
    ):
        with pytest.raises(InvalidArgument, match="scalar"):
            call()
    with pytest.raises(InvalidArgument, match=r"\[\]"):
        store.apply_dense("s", 0, np.ones(1))
    assert_same_state(store, before, "s")


def _index_and_range(msg: str) -> tuple[int, int, int]:
    m = re.search(r"index (-?\d+) out of range \[(-?\d+), (-?\d+)\)", msg)
    assert m, msg
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.parametrize(
    "part, rows, bad",
    [(0, (0, 4), 4), (1, (4, 7), 3), (1, (4, 7), 5), (1, (4, 7), -1)],
    ids=["first-part-past-end", "later-part-past-end", "later-part-far", "later-part-negative"],
)
def test_out_of_range_index_on_a_part_is_named_consistently(part, rows, bad):
    """A part-local index that falls outside the part must not be reported as lying outside a
    range that contains it: either local (index, [0, nrows)) or global (index + r0, [r0, r1))."""
    store = ShardStore()
    store.create("e", part, [10, 2], list(rows), "float64", num_parts=2)
    with pytest.raises(InvalidArgument) as info:
        store.scatter("e", part, np.array([bad]), np.ones((1, 2)))
    index, lo, hi = _index_and_range(str(info.value))
    assert not lo <= index < hi, str(info.value)
    r0, r1 = rows
    assert (index, lo, hi) in {(bad, 0, r1 - r0), (bad + r0, r0, r1)}


def test_partially_bad_sparse_push_applies_nothing():
    store = filled_store(Adam().spec())
    before = state(store)
    with pytest.raises(InvalidArgument):
        store.apply_sparse("w", 0, np.array([0, 1, 2, 6]), np.ones((4, 3)))
    with pytest.raises(InvalidArgument):
        store.scatter("w", 0, np.array([0, -3]), np.ones((2, 3)), "update")
    assert_same_state(store, before)


# === initializers ================================================================================

ALL_INITS = {
    "zeros": init.zeros(),
    "ones": init.ones(),
    "constant": init.constant(-3),
    "normal": init.normal(2.0, 1.0, seed=1),
    "truncated_normal": init.truncated_normal(0.5, seed=1),
    "uniform": init.uniform(-1, 2, seed=1),
    "glorot_uniform": init.glorot_uniform(seed=1),
}


@pytest.mark.parametrize("name", sorted(ALL_INITS))
@pytest.mark.parametrize("dtype", [F32, F64])
def test_initializer_shape_and_dtype(name, dtype):
    spec = ALL_INITS[name]
    out = init.build(spec, (10, 4, 2), (3, 7), dtype)
    assert out.shape == (4, 4, 2) and out.dtype == dtype
    assert init.build(spec, (), (0, 1), dtype).shape == ()
    assert init.build(spec, (5,), (0, 5), dtype).shape == (5,)
    assert init.from_spec(spec.spec()) == spec


def test_constant_values():
    assert np.array_equal(init.build(init.zeros(), (3, 2), (0, 3), F64), np.zeros((3, 2)))
    assert np.array_equal(init.build(init.ones(), (3, 2), (1, 3), F32), np.ones((2, 2), F32))
    assert np.all(init.build(init.constant(-3), (3, 2), (0, 3), F64) == -3.0)
    assert init.constant(2).value == 2.0


def test_normal_statistics():
    x = init.build(init.normal(stddev=2.0, mean=3.0, seed=7), (1000, 200), (0, 1000), F64)
    assert abs(x.mean() - 3.0) < 0.05
    assert abs(x.std() - 2.0) < 0.05
    assert np.abs(x - 3.0).max() > 4.0  # not truncated


def test_uniform_statistics():
    x = init.build(init.uniform(-1.0, 3.0, seed=7), (1000, 200), (0, 1000), F64)
    assert x.min() >= -1.0 and x.max() < 3.0
    assert x.min() < -0.99 and x.max() > 2.99
    assert abs(x.mean() - 1.0) < 0.05
    assert abs(x.std() - 4.0 / math.sqrt(12)) < 0.05


def test_truncated_normal_within_two_stddev():
    x = init.build(init.truncated_normal(stddev=0.5, mean=1.0, seed=7), (1000, 200), (0, 1000), F64)
    assert np.all(np.abs(x - 1.0) <= 2 * 0.5)
    assert np.abs(x - 1.0).max() > 0.95  # reaches close to the cut, not clipped tighter
    assert abs(x.mean() - 1.0) < 0.01
    # a standard normal cut at ±2 has stddev ~0.880
    assert abs(x.std() / 0.5 - 0.880) < 0.02
    # scalars work too, for many seeds (a single draw beyond 2 stddev must be redrawn)
    for seed in range(200):
        v = init.build(init.truncated_normal(seed=seed), (), (0, 1), F64)
        assert abs(float(v)) <= 2.0


@pytest.mark.parametrize(
    "full, rows, fan_in, fan_out",
    [
        ((200, 300), (0, 200), 200, 300),
        ((200, 300), (50, 120), 200, 300),  # a part: fans from the whole variable
        ((3, 3, 16, 32), (0, 3), 144, 288),  # conv kernel: receptive field 9
        ((5000,), (0, 5000), 5000, 5000),
    ],
)
def test_glorot_uniform_within_limit(full, rows, fan_in, fan_out):
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    x = init.build(init.glorot_uniform(seed=2), full, rows, F64)
    assert np.all(np.abs(x) <= limit)
    assert np.abs(x).max() > 0.95 * limit
    assert x.min() < 0 < x.max()


def test_initializers_are_seeded_by_seed_and_first_row():
    for make in (init.normal, init.truncated_normal, init.glorot_uniform):
        a = init.build(make(seed=5), (100, 8), (10, 60), F64)
        b = init.build(make(seed=5), (100, 8), (10, 60), F64)
        c = init.build(make(seed=6), (100, 8), (10, 60), F64)
        d = init.build(make(seed=5), (100, 8), (11, 61), F64)
        assert np.array_equal(a, b)
        assert not np.array_equal(a, c)
        assert not np.array_equal(a, d)
    u = init.build(init.uniform(seed=5), (100, 8), (0, 100), F32)
    assert np.array_equal(u, init.build(init.uniform(seed=5), (100, 8), (0, 100), F32))
    assert not np.array_equal(u, init.build(init.uniform(seed=4), (100, 8), (0, 100), F32))


@pytest.mark.parametrize("name", sorted(ALL_INITS))
def test_initializers_fill_a_given_array_with_the_same_values(name):
    spec = ALL_INITS[name]
    want = init.build(spec, (3000, 40), (5, 2505), F32)
    out = np.full((2500, 40), np.nan, F32)
    assert init.build(spec, (3000, 40), (5, 2505), F32, out=out) is out
    assert np.array_equal(out, want)
    with pytest.raises(ValueError):
        init.build(spec, (3000, 40), (5, 2505), F32, out=np.empty((2500, 40), F64))


def test_normal_and_uniform_values_do_not_depend_on_how_they_are_drawn():
    """They are drawn in small chunks (little scratch memory) but equal one draw of them all:
    tables initialized before keep their values."""
    n = 3 * init._DRAW + 5
    x = init.build(init.normal(stddev=2.0, mean=3.0, seed=7), (n,), (0, n), F32)
    assert np.array_equal(x, np.random.default_rng([7, 0]).normal(3.0, 2.0, n).astype(F32))
    u = init.build(init.uniform(-1.0, 3.0, seed=7), (n, 1), (4, n), F64)
    assert np.array_equal(u.ravel(), np.random.default_rng([7, 4]).uniform(-1.0, 3.0, n - 4))


@pytest.mark.parametrize("spec", ["normal", {"kind": "he"}, {}, None, 3])
def test_unknown_initializer_spec(spec):
    with pytest.raises(InvalidArgument):
        init.from_spec(spec)


# === partitioners =================================================================================


def test_fixed_size_partitioner_tf_splits():
    p = fixed_size_partitioner(3)
    assert p.count((10, 4), F32) == 3
    assert p((10, 4), F32) == [3, 1]
    assert row_splits(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_splits(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert row_splits(5, 1) == [(0, 5)]


def test_never_more_parts_than_rows():
    assert fixed_size_partitioner(5).count((2, 8), F32) == 2
    assert fixed_size_partitioner(5)((2, 8), F32) == [2, 1]
    assert fixed_size_partitioner(4).count((), F32) == 1
    assert fixed_size_partitioner(4)((), F32) == []
    # 1 byte minimum slices want one row per part: capped by the rows, then by max_partitions
    assert min_max_variable_partitioner(1000, min_slice_size=1).count((100, 1), F32) == 100
    assert min_max_variable_partitioner(7, min_slice_size=1).count((100, 1), F32) == 7
    assert num_partitions(50, (3, 2), F32) == 3


@pytest.mark.parametrize(
    "shape, dtype, max_partitions, min_slice_size, expected",
    [
        # 256 bytes a row; 64 KiB slices hold 256 rows; ceil(1000 / 256) = 4
        ((1000, 64), F32, 8, 64 << 10, 4),
        ((1000, 64), F32, 2, 64 << 10, 2),
        ((1024, 64), F32, 8, 64 << 10, 4),
        ((1025, 64), F32, 8, 64 << 10, 5),
        # 512 bytes a row: 128 rows a slice, ceil(1000 / 128) = 8
        ((1000, 64), F64, 16, 64 << 10, 8),
        ((1000, 64), F64, 8, 64 << 10, 8),
        ((1000, 64), F64, 3, 64 << 10, 3),
        # tiny: one part whatever the cap
        ((10, 4), F32, 8, 256 << 10, 1),
        # a row bigger than the slice: one row per part
        ((6, 100_000), F32, 10, 256 << 10, 6),
        # 1-D: 4 bytes a row, 256 KiB = 65536 rows a slice
        ((200_000,), F32, 8, 256 << 10, 4),
    ],
)
def test_min_max_variable_partitioner(shape, dtype, max_partitions, min_slice_size, expected):
    p = min_max_variable_partitioner(max_partitions=max_partitions, min_slice_size=min_slice_size)
    assert p.count(shape, dtype) == expected
    assert num_partitions(p, shape, dtype) == expected
    assert p(shape, dtype) == [expected] + [1] * (len(shape) - 1)


def test_min_max_default_is_one_part():
    assert min_max_variable_partitioner().count((100_000, 100), F32) == 1


@pytest.mark.parametrize("dim, n", [(10, 3), (7, 7), (1, 1), (100, 8), (13, 5), (0, 1)])
def test_row_splits_cover_contiguously(dim, n):
    splits = row_splits(dim, n)
    assert len(splits) == n
    assert splits[0][0] == 0 and splits[-1][1] == dim
    assert all(a[1] == b[0] for a, b in zip(splits, splits[1:]))
    sizes = [b - a for a, b in splits]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert sum(1 for s in sizes if s > dim // n) == dim % n


def test_num_partitions_inputs():
    assert num_partitions(None, (10, 2), F32) == 1
    assert num_partitions(4, (10, 2), F32) == 4
    assert num_partitions(4, (), F32) == 1
    assert num_partitions(0, (10, 2), F32) == 1
    assert num_partitions(lambda shape, dtype: [5, 1], (10, 2), F32) == 5
    assert num_partitions(fixed_size_partitioner(3), (10, 2), F32) == 3
    with pytest.raises(InvalidArgument, match="axis 0"):
        num_partitions(lambda shape, dtype: [1, 2], (10, 2), F32)
    with pytest.raises(InvalidArgument):
        num_partitions(lambda shape, dtype: [2], (10, 2), F32)
    with pytest.raises(InvalidArgument, match="str"):
        num_partitions("3", (10, 2), F32)
    with pytest.raises(InvalidArgument):
        num_partitions(True, (10, 2), F32)


def test_bad_partitioner_arguments():
    for bad in (
        lambda: fixed_size_partitioner(0),
        lambda: fixed_size_partitioner(2, axis=1),
        lambda: min_max_variable_partitioner(0),
        lambda: min_max_variable_partitioner(2, min_slice_size=0),
        lambda: min_max_variable_partitioner(2, axis=1),
    ):
        with pytest.raises(InvalidArgument):
            bad()
    assert isinstance(fixed_size_partitioner(2), Partitioner)


# === SyncState ==================================================================================


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


# === Catalog ====================================================================================


def _declare(cat: Catalog, name: str, parts: int = 1, nbytes: int = 100, **kw):
    rows = row_splits(parts * 2, parts)
    return cat.declare(name, [parts * 2, 4], "float32", [list(r) for r in rows], [nbytes] * parts, **kw)


def _tasks(record) -> list[str]:
    return [p["task"] for p in record["parts"]]


def test_catalog_round_robin_in_declaration_order_with_partitioned_variables():
    cat = Catalog(["ps:0", "ps:1", "ps:2"])
    assert _tasks(_declare(cat, "a")) == ["ps:0"]
    assert _tasks(_declare(cat, "b", parts=2)) == ["ps:1", "ps:2"]
    assert _tasks(_declare(cat, "c")) == ["ps:0"]
    assert _tasks(_declare(cat, "d", parts=4)) == ["ps:1", "ps:2", "ps:0", "ps:1"]
    assert _tasks(_declare(cat, "e")) == ["ps:2"]
    rec = cat.lookup("d")
    assert [p["rows"] for p in rec["parts"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]


def test_catalog_greedy_picks_fewest_bytes():
    cat = Catalog(["ps:0", "ps:1", "ps:2"])
    assert _tasks(_declare(cat, "big", nbytes=1000, policy="greedy")) == ["ps:0"]
    assert _tasks(_declare(cat, "mid", nbytes=500, policy="greedy")) == ["ps:1"]
    assert _tasks(_declare(cat, "small", nbytes=10, policy="greedy")) == ["ps:2"]
    assert _tasks(_declare(cat, "next", nbytes=600, policy="greedy")) == ["ps:2"]  # 10 < 500 < 1000
    # each part is placed in turn: ps:1 (500 -> 800), then ps:2 (610 < 800)
    assert _tasks(_declare(cat, "parts", parts=2, nbytes=300, policy="greedy")) == ["ps:1", "ps:2"]
    assert cat.bytes == {"ps:0": 1000, "ps:1": 800, "ps:2": 910}


def test_catalog_greedy_ties_go_to_the_first_shard():
    cat = Catalog(["ps:0", "ps:1"])
    assert _tasks(_declare(cat, "a", nbytes=0, policy="greedy")) == ["ps:0"]
    assert _tasks(_declare(cat, "b", nbytes=5, policy="greedy")) == ["ps:0"]
    assert _tasks(_declare(cat, "c", nbytes=5, policy="greedy")) == ["ps:1"]


def test_catalog_device_pin():
    cat = Catalog(["ps:0", "ps:1"])
    assert _tasks(_declare(cat, "pinned", parts=2, device="ps:1", nbytes=400)) == ["ps:1", "ps:1"]
    assert cat.bytes["ps:1"] == 800
    # pinned bytes count for greedy placement
    assert _tasks(_declare(cat, "g", nbytes=10, policy="greedy")) == ["ps:0"]


def test_catalog_redeclaration():
    cat = Catalog(["ps:0", "ps:1"])
    first = _declare(cat, "w", parts=2, optimizer={"kind": "sgd"})
    again = _declare(cat, "w", parts=2)
    assert again is first
    assert first["optimizer"] == {"kind": "sgd"}
    # an identical redeclaration does not consume a round-robin turn
    assert _tasks(_declare(cat, "x")) == ["ps:0"]
    # tuples and lists describe the same rows
    assert cat.declare("w", (4, 4), "float32", [(0, 2), (2, 4)], [1, 1]) is first


@pytest.mark.parametrize(
    "shape, dtype, rows, needles",
    [
        ([5, 4], "float32", [[0, 5]], ["[4, 4]", "[5, 4]"]),
        ([4, 4], "float64", [[0, 4]], ["float32", "float64"]),
        ([4, 4], "float32", [[0, 2], [2, 4]], ["1 part(s)", "2 part(s)", "[[0, 4]]", "[[0, 2], [2, 4]]"]),
    ],
)
def test_catalog_conflicting_redeclaration_names_both(shape, dtype, rows, needles):
    cat = Catalog(["ps:0"])
    rec = cat.declare("w", [4, 4], "float32", [[0, 4]], [64])
    with pytest.raises(VariableConflict) as info:
        cat.declare("w", shape, dtype, rows, [1] * len(rows))
    msg = str(info.value)
    assert "'w'" in msg
    for needle in needles:
        assert needle in msg, msg
    assert cat.lookup("w") is rec and rec["shape"] == [4, 4] and cat.bytes == {"ps:0": 64}


def test_catalog_ready_lookup_uninitialized():
    cat = Catalog(["ps:0"])
    _declare(cat, "a")
    _declare(cat, "b")
    assert cat.uninitialized(["a", "b", "ghost"]) == ["a", "b", "ghost"]
    rec = cat.mark_ready("a")
    assert rec["ready"] is True and cat.ready("a") and not cat.ready("b")
    assert cat.uninitialized(["a", "b", "ghost"]) == ["b", "ghost"]
    with pytest.raises(NotFound, match="'ghost'"):
        cat.lookup("ghost")
    with pytest.raises(NotFound, match="'ghost'"):
        cat.mark_ready("ghost")


def test_catalog_bad_arguments():
    with pytest.raises(InvalidArgument):
        Catalog([])
    cat = Catalog(["ps:0"])
    with pytest.raises(InvalidArgument):
        cat.declare("", [2], "float32", [[0, 2]], [8])
    with pytest.raises(InvalidArgument, match="2 part row ranges but 1"):
        cat.declare("w", [2], "float32", [[0, 1], [1, 2]], [8])
    with pytest.raises(InvalidArgument):
        cat.declare("w", [2], "float32", [], [])
    with pytest.raises(InvalidArgument, match="'random'"):
        cat.declare("w", [2], "float32", [[0, 2]], [8], policy="random")
    assert cat.records == {} and cat.bytes == {"ps:0": 0}


def test_a_write_while_a_view_is_out_goes_to_a_copy_and_only_then():
    """Pulls send views zero-copy; bytes still on the wire must not change under them."""
    store = ShardStore()
    store.create("w", 0, [4, 2], [0, 4], "float64", value=np.zeros((4, 2)))
    p = store.get("w", 0)
    first = id(p.value)
    store.apply_dense("w", 0, np.ones((4, 2)))
    assert id(p.value) == first  # nothing out: written in place, no copy
    out = store.view("w", 0, 1, 3).reshape(-1).view(np.uint8)  # what the codec hands ZeroMQ
    with pytest.raises(ValueError):
        store.view("w", 0)[0, 0] = 5.0  # views are read-only
    for write in (lambda: store.apply_dense("w", 0, np.ones((4, 2))), lambda: store.assign("w", 0, np.ones((4, 2)), "add"),
                  lambda: store.scatter("w", 0, np.array([1]), np.ones((1, 2))),
                  lambda: store.apply_sparse("w", 0, np.array([2]), np.ones((1, 2)))):
        write()
        np.testing.assert_array_equal(out.view(np.float64), np.ones(4))  # the bytes on the wire stay put
    np.testing.assert_array_equal(p.value, [[3, 3], [4, 4], [4, 4], [3, 3]])
    del out
    second = id(p.value)
    store.apply_dense("w", 0, np.ones((4, 2)))
    assert id(p.value) == second  # the view is gone: in place again
