"""Server-side optimizers against plain numpy references of the textbook / TF1 update rules.

Each optimizer runs through ``ShardStore.apply_dense`` / ``apply_sparse`` for 10 steps, in float64,
and is compared with a reference written here from the formulas alone: closeness to 1e-12, and
every row (and slot row) that a step did not touch must come out bit-identical.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from zmqflow.optim import SGD, Adagrad, Adam, Momentum
from zmqflow.state.store import ShardStore

from .optim_cases import OPTIMIZERS, STEPS, TOL


# --- the reference -----------------------------------------------------------------------------


class Reference:
    """Full-variable numpy state: value, slots by the names a TF1 optimizer uses, per-row steps."""

    def __init__(self, opt, value: np.ndarray):
        self.opt = opt
        self.value = np.array(value, dtype=np.float64, copy=True)
        rows = value.shape[0] if value.ndim else 1
        self.t = np.zeros(rows, dtype=np.int64)
        shape = value.shape
        if isinstance(opt, SGD):
            self.slots = {}
        elif isinstance(opt, Momentum):
            self.slots = {"momentum": np.zeros(shape)}
        elif isinstance(opt, Adagrad):
            self.slots = {"accumulator": np.full(shape, opt.initial_accumulator_value)}
        elif isinstance(opt, Adam):
            self.slots = {"m": np.zeros(shape), "v": np.zeros(shape)}
        else:  # pragma: no cover
            raise AssertionError(opt)

    def _rule(self, p, g, s, t):
        """One update of rows ``p`` with gradient ``g``; ``s`` are those rows' slots, ``t`` their step."""
        o = self.opt
        if isinstance(o, SGD):
            return p - o.learning_rate * g, {}
        if isinstance(o, Momentum):
            m = o.momentum * s["momentum"] + g
            if o.nesterov:
                return p - o.learning_rate * (g + o.momentum * m), {"momentum": m}
            return p - o.learning_rate * m, {"momentum": m}
        if isinstance(o, Adagrad):
            acc = s["accumulator"] + g**2
            return p - o.learning_rate * g / np.sqrt(acc), {"accumulator": acc}
        # Adam, TF1: bias correction folded into the learning rate, epsilon outside the sqrt
        m = o.beta1 * s["m"] + (1 - o.beta1) * g
        v = o.beta2 * s["v"] + (1 - o.beta2) * g**2
        lr_t = np.array([o.learning_rate * math.sqrt(1 - o.beta2**k) / (1 - o.beta1**k) for k in np.ravel(t)])
        lr_t = lr_t.reshape((-1,) + (1,) * (p.ndim - 1)) if p.ndim else lr_t[0]
        return p - lr_t * m / (np.sqrt(v) + o.epsilon), {"m": m, "v": v}

    def dense(self, g: np.ndarray, start: int | None = None, stop: int | None = None) -> None:
        if self.value.ndim == 0:
            self.t += 1
            new, slots = self._rule(self.value, g, self.slots, self.t)
            self.value = np.asarray(new)
            self.slots.update({k: np.asarray(v) for k, v in slots.items()})
            return
        sl = slice(start, stop)
        self.t[sl] += 1
        new, slots = self._rule(self.value[sl], g, {k: v[sl] for k, v in self.slots.items()}, self.t[sl])
        self.value[sl] = new
        for k, v in slots.items():
            self.slots[k][sl] = v

    def sparse(self, indices, rows) -> list[int]:
        """Duplicates summed first (plain loop), then each touched row updated once. Returns the rows."""
        summed: dict[int, np.ndarray] = {}
        for i, r in zip(indices.tolist(), rows):
            summed[i] = summed[i] + r if i in summed else np.array(r, copy=True)
        touched = sorted(summed)
        for i in touched:
            self.t[i] += 1
            new, slots = self._rule(
                self.value[i : i + 1], summed[i][None], {k: v[i : i + 1] for k, v in self.slots.items()}, self.t[i : i + 1]
            )
            self.value[i] = new[0]
            for k, v in slots.items():
                self.slots[k][i] = v[0]
        return touched


def assert_matches(store: ShardStore, name: str, part: int, ref: Reference, rows: slice | None = None) -> None:
    p = store.get(name, part)
    sl = slice(None) if rows is None else rows
    np.testing.assert_allclose(p.value[sl] if p.value.ndim else p.value, ref.value[sl] if ref.value.ndim else ref.value, **TOL)
    assert set(p.slots) == set(ref.slots)
    for k in ref.slots:
        got = p.slots[k][sl] if p.slots[k].ndim else p.slots[k]
        want = ref.slots[k][sl] if ref.slots[k].ndim else ref.slots[k]
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"slot {k}")


def snapshot(store: ShardStore, name: str, part: int = 0):
    p = store.get(name, part)
    return p.value.copy(), {k: s.copy() for k, s in p.slots.items()}


def assert_rows_unchanged(store: ShardStore, name: str, part: int, before, rows) -> None:
    """Rows ``rows`` of the value and of every slot are bit-identical to ``before``."""
    value, slots = before
    p = store.get(name, part)
    rows = np.asarray(rows, dtype=np.int64)
    assert np.array_equal(p.value[rows], value[rows]), f"untouched rows {rows.tolist()} changed"
    for k, s in slots.items():
        assert np.array_equal(p.slots[k][rows], s[rows]), f"slot {k} of untouched rows {rows.tolist()} changed"


def check_steps(part, opt, want: list[int]) -> None:
    """Adam keeps each row's step count (its t); the others keep none, since nothing of theirs reads it."""
    if opt.uses_step:
        assert part.steps.tolist() == list(want)
    else:
        assert part.steps is None


def make(store: ShardStore, name: str, opt, value: np.ndarray, *, full_shape=None, rows=None, part: int = 0, spec=True):
    full = list(value.shape) if full_shape is None else list(full_shape)
    r = rows if rows is not None else ([0, value.shape[0]] if value.ndim else [0, 1])
    created = store.create(name, part, full, list(r), "float64", optimizer=opt.spec() if spec else opt, value=value)
    assert created


# --- dense -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_dense_matches_reference(key):
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(1)
    init = rng.normal(size=(6, 4))
    store = ShardStore()
    make(store, "w", opt, init)
    ref = Reference(opt, init)
    for _ in range(STEPS):
        g = rng.normal(size=(6, 4))
        store.apply_dense("w", 0, g)
        ref.dense(g)
        assert_matches(store, "w", 0, ref)
    check_steps(store.get("w"), opt, [STEPS] * 6)
    # the update really moved the value (a no-op optimizer would fail the reference check above too)
    assert not np.allclose(store.read("w"), init)


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_dense_3d_variable(key):
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(2)
    init = rng.normal(size=(5, 2, 3))
    store = ShardStore()
    make(store, "k", opt, init)
    ref = Reference(opt, init)
    for _ in range(STEPS):
        g = rng.normal(size=(5, 2, 3))
        store.apply_dense("k", 0, g)
        ref.dense(g)
    assert_matches(store, "k", 0, ref)


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_dense_in_row_ranges_of_a_part(key):
    """A part holding rows [3, 9) of a 12-row variable gets dense pushes in part-local chunks; the
    second chunk is pushed only every other step, so its rows (value, slots, Adam's t) must wait."""
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(3)
    init = rng.normal(size=(6, 3))
    store = ShardStore()
    make(store, "emb", opt, init, full_shape=(12, 3), rows=[3, 9], part=1)
    ref = Reference(opt, init)
    for step in range(STEPS):
        g0 = rng.normal(size=(2, 3))
        before = snapshot(store, "emb", 1)
        store.apply_dense("emb", 1, g0, start=0, stop=2)
        ref.dense(g0, 0, 2)
        assert_rows_unchanged(store, "emb", 1, before, [2, 3, 4, 5])
        if step % 2 == 0:
            g1 = rng.normal(size=(4, 3))
            before = snapshot(store, "emb", 1)
            store.apply_dense("emb", 1, g1, start=2, stop=6)
            ref.dense(g1, 2, 6)
            assert_rows_unchanged(store, "emb", 1, before, [0, 1])
        assert_matches(store, "emb", 1, ref)
    check_steps(store.get("emb", 1), opt, [10, 10, 5, 5, 5, 5])


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_dense_split_pushes_equal_one_whole_push(key):
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(4)
    init = rng.normal(size=(7, 2))
    whole, split = ShardStore(), ShardStore()
    make(whole, "w", opt, init)
    make(split, "w", opt, init)
    for _ in range(STEPS):
        g = rng.normal(size=(7, 2))
        whole.apply_dense("w", 0, g)
        split.apply_dense("w", 0, g[:3], start=0, stop=3)
        split.apply_dense("w", 0, g[3:], start=3, stop=7)
    a, b = whole.get("w"), split.get("w")
    np.testing.assert_allclose(a.value, b.value, **TOL)
    for k in a.slots:
        np.testing.assert_allclose(a.slots[k], b.slots[k], **TOL)


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_dense_scalar_variable(key):
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(5)
    init = np.array(0.75)
    store = ShardStore()
    make(store, "s", opt, init)
    ref = Reference(opt, init)
    for _ in range(STEPS):
        g = np.array(rng.normal())
        store.apply_dense("s", 0, g)
        ref.dense(g)
        assert_matches(store, "s", 0, ref)
    p = store.get("s")
    assert p.value.shape == () and all(s.shape == () for s in p.slots.values())
    assert store.read("s").shape == ()
    assert p.value != 0.75


def test_adam_float32_stays_float32():
    opt = Adam(learning_rate=0.01)
    rng = np.random.default_rng(6)
    init = rng.normal(size=(4, 3)).astype(np.float32)
    store = ShardStore()
    store.create("w", 0, [4, 3], [0, 4], "float32", optimizer=opt.spec(), value=init)
    ref = Reference(opt, init.astype(np.float64))
    for _ in range(STEPS):
        g = rng.normal(size=(4, 3)).astype(np.float32)
        store.apply_dense("w", 0, g)
        ref.dense(g.astype(np.float64))
    p = store.get("w")
    assert p.value.dtype == np.float32 and all(s.dtype == np.float32 for s in p.slots.values())
    np.testing.assert_allclose(p.value, ref.value, rtol=1e-5, atol=1e-6)


# --- sparse ------------------------------------------------------------------------------------


def _indices_with_duplicates(rng, low: int, high: int, n: int) -> np.ndarray:
    idx = rng.integers(low, high, size=n)
    return np.concatenate([idx, idx[:2]])  # at least two duplicates every step


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape", [(8, 3), (8,), (7, 2, 2)], ids=["2d", "1d", "3d"])
def test_sparse_matches_lazy_reference(key, shape):
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(7)
    init = rng.normal(size=shape)
    nrows = shape[0]
    store = ShardStore()
    make(store, "emb", opt, init)
    initial = snapshot(store, "emb")
    ref = Reference(opt, init)
    for _ in range(STEPS):
        idx = _indices_with_duplicates(rng, 1, nrows - 1, 4)  # first and last rows never touched
        rows = rng.normal(size=(len(idx), *shape[1:]))
        before = snapshot(store, "emb")
        store.apply_sparse("emb", 0, idx, rows)
        touched = ref.sparse(idx, rows)
        untouched = sorted(set(range(nrows)) - set(touched))
        assert untouched, "the test must leave some rows out"
        assert_rows_unchanged(store, "emb", 0, before, untouched)
        assert_matches(store, "emb", 0, ref)
    assert_rows_unchanged(store, "emb", 0, initial, [0, nrows - 1])
    check_steps(store.get("emb"), opt, ref.t.tolist())
    assert ref.t[0] == 0 and ref.t[1:-1].max() > 0


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_sparse_on_a_part_uses_local_indices(key):
    opt = OPTIMIZERS[key]
    rng = np.random.default_rng(8)
    init = rng.normal(size=(5, 2))
    store = ShardStore()
    make(store, "emb", opt, init, full_shape=(10, 2), rows=[5, 10], part=1)
    ref = Reference(opt, init)
    for _ in range(STEPS):
        idx = _indices_with_duplicates(rng, 0, 4, 3)  # local row 4 never touched
        rows = rng.normal(size=(len(idx), 2))
        store.apply_sparse("emb", 1, idx, rows)
        ref.sparse(idx, rows)
        assert_matches(store, "emb", 1, ref)
    assert not opt.uses_step or store.get("emb", 1).steps[4] == 0


def test_adam_step_count_is_per_row_dense_then_sparse():
    """Dense pushes advance every row (plain Adam), sparse ones only the touched rows (lazy Adam)."""
    opt = Adam(learning_rate=0.05, beta1=0.5, beta2=0.9, epsilon=1e-3)
    rng = np.random.default_rng(9)
    init = rng.normal(size=(4, 2))
    store = ShardStore()
    make(store, "w", opt, init)
    ref = Reference(opt, init)
    for _ in range(3):
        g = rng.normal(size=(4, 2))
        store.apply_dense("w", 0, g)
        ref.dense(g)
    for idx in ([1], [1, 2], [1]):
        idx = np.array(idx)
        rows = rng.normal(size=(len(idx), 2))
        store.apply_sparse("w", 0, idx, rows)
        ref.sparse(idx, rows)
    check_steps(store.get("w"), opt, [3, 6, 4, 3])
    assert_matches(store, "w", 0, ref)
    # against a single global step count (6 for every row) the untouched rows would differ
    g = rng.normal(size=(4, 2))
    store.apply_dense("w", 0, g)
    ref.dense(g)
    assert_matches(store, "w", 0, ref)


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_sparse_duplicates_equal_one_summed_row(key):
    opt = OPTIMIZERS[key]
    init = np.arange(6.0).reshape(3, 2)
    a, b = ShardStore(), ShardStore()
    make(a, "w", opt, init)
    make(b, "w", opt, init)
    r = np.array([[0.5, -1.0], [0.25, 2.0], [1.0, 1.0]])
    a.apply_sparse("w", 0, np.array([2, 0, 2]), r)
    b.apply_sparse("w", 0, np.array([0, 2]), np.array([r[1], r[0] + r[2]]))
    np.testing.assert_allclose(a.get("w").value, b.get("w").value, **TOL)
    for k in a.get("w").slots:
        np.testing.assert_allclose(a.get("w").slots[k], b.get("w").slots[k], **TOL)
    check_steps(a.get("w"), opt, [1, 0, 1])
    assert np.array_equal(a.get("w").value[1], init[1])


def test_sparse_with_no_indices_changes_nothing():
    store = ShardStore()
    make(store, "w", Adam(), np.ones((4, 3)))
    before = snapshot(store, "w")
    store.apply_sparse("w", 0, np.array([], dtype=np.int64), np.zeros((0, 3)))
    assert_rows_unchanged(store, "w", 0, before, [0, 1, 2, 3])
    assert store.get("w").steps.tolist() == [0, 0, 0, 0]


def test_dense_on_an_empty_row_range_changes_nothing():
    store = ShardStore()
    make(store, "w", Momentum(), np.ones((4, 3)))
    before = snapshot(store, "w")
    store.apply_dense("w", 0, np.zeros((0, 3)), start=2, stop=2)
    assert_rows_unchanged(store, "w", 0, before, [0, 1, 2, 3])


# --- no optimizer ------------------------------------------------------------------------------


def test_no_optimizer_is_plain_add():
    rng = np.random.default_rng(10)
    init = rng.normal(size=(5, 3))
    store = ShardStore()
    store.create("w", 0, [5, 3], [0, 5], "float64", value=init)
    p = store.get("w")
    assert p.optimizer is None and p.slots == {}
    g = rng.normal(size=(5, 3))
    store.apply_dense("w", 0, g)
    assert np.array_equal(p.value, init + g)
    g2 = rng.normal(size=(2, 3))
    store.apply_dense("w", 0, g2, start=1, stop=3)
    expected = init + g
    expected[1:3] += g2
    assert np.array_equal(p.value, expected)
    # sparse: duplicates summed, untouched rows bit-identical
    idx = np.array([4, 0, 4])
    rows = rng.normal(size=(3, 3))
    before = p.value.copy()
    store.apply_sparse("w", 0, idx, rows)
    np.testing.assert_allclose(p.value[4], before[4] + rows[0] + rows[2], **TOL)
    np.testing.assert_allclose(p.value[0], before[0] + rows[1], **TOL)
    assert np.array_equal(p.value[1:4], before[1:4])


def test_no_optimizer_scalar_plain_add():
    store = ShardStore()
    store.create("s", 0, [], [0, 1], "float64", value=np.array(2.0))
    store.apply_dense("s", 0, np.array(0.5))
    assert store.read("s") == 2.5


def test_adams_bias_correction_is_looked_up_with_the_formulas_bits_and_computed_past_the_table():
    from zmqflow.state import optim as state_optim

    rng = np.random.default_rng(12)
    for beta1, beta2 in ((0.9, 0.999), (0.5, 0.7)):
        for t in (rng.integers(1, state_optim._BIAS_STEPS, 40), np.array([state_optim._BIAS_STEPS - 1,
                                                                            state_optim._BIAS_STEPS, 10**9])):
            want = np.sqrt(1 - beta2 ** t.astype(np.float64)) / (1 - beta1 ** t.astype(np.float64))
            assert state_optim._bias(beta1, beta2, t).tobytes() == want.tobytes()
