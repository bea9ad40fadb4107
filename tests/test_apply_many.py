"""A push's dense updates applied together (``state.apply_many``, ``kernels_c``'s ``*_many``) leave
every part, slot and step count with the bits of the one-part way; a refused call writes nothing."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from zmqflow.state import apply_many, kernels, optim
from zmqflow.state.store import Rows, ShardStore, Sparse

OPTIMIZERS = [None, optim.SGD(0.05), optim.SGD(1.0), optim.Momentum(0.03), optim.Momentum(0.03, nesterov=True),
              optim.Adagrad(0.1), optim.Adam(0.01)]
needs_c = pytest.mark.skipif(not kernels.compiled(), reason="the C kernels were not built here")


def _store(optimizer, dtype: str, seed: int = 0) -> ShardStore:
    """Parts of every shape a push meets: 2-D, 1-D, a scalar, a part of a split variable."""
    rng = np.random.default_rng(seed)
    store = ShardStore()
    for name, shape, rows, num_parts, index in (("w", [6, 3], [0, 6], 1, 0), ("b", [5], [0, 5], 1, 0),
                                               ("s", [], [0, 1], 1, 0), ("e", [9, 2], [4, 9], 2, 1)):
        part_shape = ([rows[1] - rows[0], *shape[1:]]) if shape else []
        store.create(name, index, shape, rows, dtype, num_parts=num_parts, optimizer=optimizer,
                     value=rng.standard_normal(part_shape).astype(dtype))
    return store


def _updates(store: ShardStore, dtype: str, rate: float | None, seed: int = 1) -> list:
    """One gradient a part: whole rows, rows [1, 4) of one part, one lying off its alignment."""
    rng = np.random.default_rng(seed)
    out = []
    for (name, index), p in store.parts.items():
        a, b = (1, 4) if name == "w" else (0, p.nrows if p.full_shape else 1)
        shape = (b - a, *p.full_shape[1:]) if p.full_shape else ()
        grad = rng.standard_normal(shape).astype(dtype)
        if name == "b":  # as a frame's bytes at an odd offset leave it
            raw = np.zeros(grad.nbytes + 1, np.uint8)
            grad = np.frombuffer(raw.data, dtype, count=grad.size, offset=1).reshape(shape)
            grad[...] = rng.standard_normal(shape)
            assert not grad.flags.aligned
        out.append((p, {(a, b): grad}, None, rate))
    return out


def _one_by_one(store: ShardStore):
    def one(p, dense, sparse, rate):
        for (a, b), grad in dense.items():
            store.apply(Rows(p, a, b, grad), rate)
        if sparse is not None:
            store.apply(Sparse(p, *sparse), rate)
    return one


def _state(store: ShardStore) -> dict:
    out = {}
    for key, p in store.parts.items():
        out[key] = [p.value.copy(), *(s.copy() for s in p.slots.values())]
        if p.steps is not None:
            out[key].append(p.steps.copy())
    return out


def _same_bits(x: dict, y: dict) -> None:
    assert x.keys() == y.keys()
    for key in x:
        for a, b in zip(x[key], y[key], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes(), key


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "add" if o is None else repr(o))
@pytest.mark.parametrize("rate", [None, 0.2])
def test_together_has_the_bits_of_one_by_one(optimizer, dtype, rate, monkeypatch):
    together, alone = _store(optimizer, dtype), _store(optimizer, dtype)
    fused = []
    real = apply_many._run
    monkeypatch.setattr(apply_many, "_run", lambda key, columns: fused.append(len(columns[0])) or real(key, columns))
    for step in range(3):  # Adam's counts and rates move from step to step
        apply_many.apply_all(_updates(together, dtype, rate, seed=step), _one_by_one(together))
        one = _one_by_one(alone)
        for u in _updates(alone, dtype, rate, seed=step):
            one(*u)
    _same_bits(_state(together), _state(alone))
    assert fused == [4, 4, 4]  # every part in one call a push, the misaligned gradient copied


@needs_c
def test_fused_groups_run_one_call_each_and_the_rest_goes_one_by_one():
    store = ShardStore()
    for name, opt in (("a", optim.Adam(0.01)), ("b", optim.Adam(0.01)), ("c", optim.SGD(0.1)),
                      ("d", optim.SGD(0.2)), ("h", optim.SGD(0.1))):
        store.create(name, 0, [4], [0, 4], "float16" if name == "h" else "float32", optimizer=opt)
    store.create("sp", 0, [4, 2], [0, 4], "float32", optimizer=optim.SGD(0.1))
    g32, g16 = np.ones(4, np.float32), np.ones(4, np.float16)
    updates = [(store.get(n), {(0, 4): g16 if n == "h" else g32}, None, None) for n in "abcdh"]
    updates.append((store.get("sp"), {}, (np.array([1, 1]), np.ones((2, 2), np.float32)), None))
    alone: list[str] = []

    def one(p, dense, sparse, rate):
        alone.append(p.name)
        _one_by_one(store)(p, dense, sparse, rate)

    calls = []
    real = apply_many._run

    def counted(key, columns):
        calls.append((key[0], len(columns[0])))
        return real(key, columns)

    apply_many._run = counted
    try:
        apply_many.apply_all(updates, one)
    finally:
        apply_many._run = real
    assert sorted(calls) == [("adam", 2), ("sgd", 1), ("sgd", 1)]  # two rates: two groups
    assert alone == ["h", "sp"]  # half precision and a sparse gradient: the one-part way
    assert store.get("c").value[0] == np.float32(-0.1) and store.get("d").value[0] == np.float32(-0.2)
    assert np.array_equal(store.get("sp").value[1], np.full(2, -0.2, np.float32))  # its duplicates summed


@needs_c
def test_a_refused_call_writes_nothing_not_even_the_items_before_the_one_at_fault():
    ys = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
    xs = [np.ones(3, np.float32), np.ones(3, np.float64)]  # the second item mixes types
    assert not kernels.axpy_many(ys, xs, 1.0)
    assert not ys[0].any()
    params, grads = [np.zeros(2), np.zeros(2)], [np.ones(2), np.ones(2)]
    ms, vs = [np.zeros(2), np.zeros(2)], [np.zeros(2), np.zeros(2)]
    table = optim.bias_table(0.9, 0.999)
    steps = [np.zeros(2, np.int64), np.zeros(2, np.int64)]
    wrong = [np.zeros(2, np.int64), np.zeros(2, np.int32)]  # the second item's counts are not int64
    assert kernels.adam_many(params, grads, ms, vs, wrong, table, 0.9, 0.999, 1e-8, 0.01) is None
    assert not any(a.any() for a in params + ms + vs + wrong)
    with pytest.raises(ValueError, match="list 0 holds 2 arrays and list 1 1"):
        kernels._kernels.axpy_many(ys, xs[:1], 1.0)
    steps[1][...] = [3, len(table) - 1]  # a row at the table's end: that item is left out, untouched
    assert kernels.adam_many(params, grads, ms, vs, steps, table, 0.9, 0.999, 1e-8, 0.01) == [1]
    assert steps[1].tolist() == [3, len(table) - 1] and not (params[1].any() or ms[1].any() or vs[1].any())
    steps[1][1] = 0
    assert kernels.adam_many(params, grads, ms, vs, steps, table, 0.9, 0.999, 1e-8, 0.01) == []
    assert steps[0].tolist() == [2, 2] and steps[1].tolist() == [4, 1]
    assert params[0][0] != 0 and params[1][0] != params[1][1]  # each row at its own count's step size


def test_adam_past_its_bias_table_goes_one_by_one_with_the_same_bits():
    together, alone = _store(optim.Adam(0.01), "float32"), _store(optim.Adam(0.01), "float32")
    by_one: list[str] = []
    real_one = _one_by_one(together)
    for store in (together, alone):
        store.get("b").steps[...] = len(optim.bias_table(0.9, 0.999)) - 1  # the next step is past it
    values = {key: weakref.ref(p.value) for key, p in together.parts.items()}  # no reference held
    apply_many.apply_all(_updates(together, "float32", None),
                         lambda p, *rest: (by_one.append(p.name), real_one(p, *rest)))
    assert by_one == (["b"] if kernels.compiled() else ["w", "b", "s", "e"])  # only the part past the table
    one = _one_by_one(alone)
    for u in _updates(alone, "float32", None):
        one(*u)
    _same_bits(_state(together), _state(alone))
    # the refused group's views were let go first: no part copied its value as if a pull held it
    assert all(p.value is values[key]() for key, p in together.parts.items())


def test_without_the_c_loops_every_update_goes_one_by_one():
    before = kernels.use_compiled(False)
    try:
        together, alone = _store(optim.Adam(0.01), "float64"), _store(optim.Adam(0.01), "float64")
        apply_many.apply_all(_updates(together, "float64", None), _one_by_one(together))
        one = _one_by_one(alone)
        for u in _updates(alone, "float64", None):
            one(*u)
    finally:
        kernels.use_compiled(before)
    _same_bits(_state(together), _state(alone))
