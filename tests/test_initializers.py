"""Initializers: the values a variable's rows start from, seeded so every shard and every rank agree."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zmqflow.state import init
from zmqflow.errors import InvalidArgument

F32, F64 = np.dtype("float32"), np.dtype("float64")


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


@pytest.mark.parametrize("shape", [(0,), (0, 0), (4, 0), (0, 3, 2)])
def test_glorot_uniform_of_an_empty_shape_is_empty(shape):
    """As TF: fans of zero give no limit to divide by (max(1, fan_in + fan_out)), and no values."""
    got = init.build(init.glorot_uniform(seed=1), shape, (0, shape[0]), F32)
    assert got.shape == shape and got.dtype == F32
