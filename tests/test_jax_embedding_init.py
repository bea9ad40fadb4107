"""zmqflow.jax.Embedding's default rows: as flax's ``nn.Embed``, normal with stddev
1/sqrt(embedding_dim), seeded by the table's name. All-zero rows would give a dot-product model
(DLRM) zero gradients for both sides of every interaction, so training could not start."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import zmqflow as zf  # noqa: E402
import zmqflow.jax as zj  # noqa: E402


def test_default_rows_are_normal_with_fan_in_stddev_seeded_by_the_name(alone):
    dim, n = 16, 64
    rows = np.asarray(zj.Embedding("users", n, dim).lookup(jnp.arange(n)))
    assert np.count_nonzero(rows) == rows.size
    assert abs(float(rows.mean())) < 0.05 and 0.9 < float(rows.std()) * np.sqrt(dim) < 1.1
    # exactly the rows of that initializer named outright: the seed comes from the name alone,
    # so every process (and every run) that declares the table builds the same rows
    twin = zj.Embedding("users_twin", n, dim, initializer=zf.init.normal(stddev=dim ** -0.5,
                                                                        seed=zlib.crc32(b"users")))
    np.testing.assert_array_equal(np.asarray(twin.lookup(jnp.arange(n))), rows)
    other = np.asarray(zj.Embedding("items", n, dim).lookup(jnp.arange(n)))
    assert not np.array_equal(other, rows)  # another table, other rows


def test_default_rows_let_a_dot_product_train(alone):
    users, items = zj.Embedding("dot_u", 8, 4, zf.optim.SGD(0.1)), zj.Embedding("dot_i", 8, 4, zf.optim.SGD(0.1))
    u, i = jnp.asarray([0, 1]), jnp.asarray([2, 3])
    gu, gi = jax.grad(lambda a, b: jnp.sum(a * b), argnums=(0, 1))(users.lookup(u), items.lookup(i))
    assert np.abs(np.asarray(gu)).sum() > 0 and np.abs(np.asarray(gi)).sum() > 0


def test_a_dynamic_table_creates_rows_from_the_same_default(alone):
    dyn = zj.Embedding("dyn_users", None, 9)
    rows = np.asarray(dyn.lookup(jnp.arange(200)))
    assert np.count_nonzero(rows) == rows.size and 0.85 < float(rows.std()) * 3 < 1.15
