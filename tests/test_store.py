"""The sans-IO shard store: creating parts, reads and writes, and bad input that changes nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from zmqflow.state import init
from zmqflow.errors import InvalidArgument, NotFound, VariableConflict
from zmqflow.state.optim import SGD, Adam, Momentum, SyncReplicas
from zmqflow.state.store import ShardStore

from .conftest import SizeReadCalls

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


@pytest.mark.parametrize("dtype", ["int32", "int8", "uint16", "bool", "complex64"])
def test_an_optimizer_on_a_variable_that_is_not_floating_point_is_refused_when_planned(dtype):
    """As TF: an optimizer's update is fractional, so an integer or bool part would fail in the
    middle of a push, after the push's other parts were applied. Refused at creation instead."""
    store = ShardStore()
    for opt in (Adam(), SyncReplicas(Momentum(0.1), 2)):
        with pytest.raises(InvalidArgument, match=rf"variable i \(part 1\) is {dtype}: the (adam|momentum) optimizer"):
            store.create("i", 1, [4], [2, 4], dtype, num_parts=2, optimizer=opt.spec())
    assert store.parts == {} and store.held_bytes() == 0
    assert store.create("i", 0, [4], [0, 4], dtype)  # without an optimizer: a plain add
    for dt in ("float16", "bfloat16", "float32", "float64"):
        assert store.create("f" + dt, 0, [4], [0, 4], dt, optimizer=Adam().spec())


def test_a_part_declared_again_with_another_optimizer_conflicts_and_one_naming_none_attaches():
    store = ShardStore()
    sync = SyncReplicas(Momentum(0.1), 2)
    store.create("w", 0, [4], [0, 4], "float32", optimizer=sync.spec())
    for other in (Momentum(0.2), SyncReplicas(Momentum(0.1), 3), SyncReplicas(Adam(), 2), SGD(0.1)):
        with pytest.raises(VariableConflict, match="variable w exists with optimizer .*; declared with"):
            store.create("w", 0, [4], [0, 4], "float32", optimizer=other.spec())
    assert not store.create("w", 0, [4], [0, 4], "float32", optimizer=sync.spec())
    assert not store.create("w", 0, [4], [0, 4], "float32")  # none named: get-or-create attaches
    store.create("plain", 0, [4], [0, 4], "float32")
    with pytest.raises(VariableConflict, match=r"plain exists with optimizer none \(a plain add\)"):
        store.create("plain", 0, [4], [0, 4], "float32", optimizer=SGD(0.1).spec())
    p = store.get("w")
    assert p.optimizer == Momentum(0.1) and p.sync.replicas_to_aggregate == 2


def test_sizes_can_be_read_while_parts_and_slots_are_added():
    store = ShardStore()
    for name in ("a", "b"):
        store.create(name, 0, [4], [0, 4], "float32", optimizer=Momentum(0.1, 0.9))
    a = store.get("a")
    held = a.value.view(SizeReadCalls)
    slot = next(iter(a.slots.values())).view(SizeReadCalls)
    a.value, a.slots["grown"] = held, slot
    held.on_read = lambda: store.parts.setdefault((f"added{len(store.parts)}", 0), store.get("b"))
    slot.on_read = lambda: a.slots.setdefault(f"s{len(a.slots)}", np.zeros(4, np.float32))
    before = len(store.parts)
    assert store.nbytes >= 2 * 16 and a.nbytes >= 16  # no "changed size during iteration"
    assert len(store.parts) > before and len(a.slots) > 2
