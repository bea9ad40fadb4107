"""zmqflow.jax at JAX's edges: 64-bit values, sharded leaves, jit before init, grad and vmap
through the collectives, the cast of an embedding's gradients, and a ring given up after a wait.

One rank alone (a private in-process cluster); the multi-rank arithmetic of the gradients is in
``test_jax_bridge``'s two-rank script.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import zmqflow as zf  # noqa: E402
import zmqflow.jax as zj  # noqa: E402
import zmqflow.jax.collectives as zj_collectives  # noqa: E402
from zmqflow.errors import ConfigError, DeadlineExceeded, InvalidArgument  # noqa: E402


# 64-bit values -------------------------------------------------------------------------------
def test_int64_values_past_int32_are_refused_not_wrapped(alone):
    assert not jax.config.jax_enable_x64
    big = {"count": np.array([2**40, 5])}
    for call in (lambda t: zj.allreduce(t, "sum"), zj.broadcast, zj.allgather):
        with pytest.raises(InvalidArgument, match=r"leaf \['count'\] of dtype int64 .* int32.*jax_enable_x64"):
            call(big)
    with pytest.raises(InvalidArgument, match=r"leaf \['n'\] of dtype int64"):
        zj.allreduce({"n": np.int64(2**40)}, "sum")  # a numpy scalar keeps its dtype too
    with pytest.raises(InvalidArgument, match=r"leaf \['p'\]: Python int .* too large"):
        zj.allreduce({"p": 2**40}, "sum")
    with pytest.raises(InvalidArgument, match=r"leaf \['c'\] of dtype int64"):
        jax.jit(lambda x: zj.allreduce({"x": x, "c": np.array([2**40])}))(jnp.ones(2))  # refused when traced


def test_64_bit_values_that_fit_come_back_in_jax_dtypes(alone):
    got = zj.allreduce({"n": np.array([3, -4]), "f": np.array([0.5, 2.0]), "s": np.int64(7)}, "sum")
    assert (got["n"].dtype, got["f"].dtype, got["s"].dtype) == (jnp.int32, jnp.float32, jnp.int32)
    np.testing.assert_array_equal(np.asarray(got["n"]), [3, -4])
    with pytest.raises(InvalidArgument, match=r"leaf \['f'\] of dtype float64 .* float32"):
        zj.allreduce({"f": np.array([0.1])})  # float32 would round it
    with jax.enable_x64(True):
        wide = zj.allreduce({"count": np.array([2**40, 5])}, "sum")["count"]
        assert wide.dtype == jnp.int64 and int(wide[0]) == 2**40


def test_float64_table_rows_are_refused_unless_float32_holds_them(alone):
    table = zj.Embedding("wide64", 4, 2, dtype="float64", initializer=zf.init.zeros())
    assert table.lookup(jnp.asarray([0])).dtype == jnp.float32  # zeros: exact in float32
    table.push(np.asarray([1]), np.asarray([[0.1, 2.0**40 + 1]]))
    with pytest.raises(InvalidArgument, match=r"embedding 'wide64': the rows of dtype float64.*dtype float32"):
        table.lookup(jnp.asarray([1]))
    with jax.enable_x64(True):
        np.testing.assert_array_equal(np.asarray(table.lookup(jnp.asarray([1]))), [[0.1, 2.0**40 + 1]])


# sharded leaves --------------------------------------------------------------------------------
SHARDED = textwrap.dedent(
    """
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import zmqflow.jax as zj

    assert len(jax.devices()) == 2, jax.devices()
    zj.init(timeout=20)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("x")))
    got = zj.allgather({"x": x})["x"]
    assert got.shape == (1, 4, 2) and got.sharding.spec == P(None, "x"), got.sharding
    np.testing.assert_array_equal(np.asarray(got)[0], np.arange(8.0).reshape(4, 2))
    same = zj.allreduce({"x": x}, "sum")["x"]
    assert same.sharding == x.sharding
    zj.shutdown()
    print("sharded ok", flush=True)
    """
)


def test_allgather_of_a_leaf_sharded_over_two_devices():
    env = {k: v for k, v in os.environ.items() if k not in ("ZMQFLOW_CLUSTER", "ZMQFLOW_TASK", "TF_CONFIG")}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and "sharded ok" in out.stdout, out.stdout + out.stderr


# transformations --------------------------------------------------------------------------------
def test_jit_before_init_raises_config_error_when_traced():
    assert not zj.is_initialized()
    with pytest.raises(ConfigError, match="init"):
        jax.jit(lambda x: zj.allreduce(x))(jnp.ones(2))


def test_grad_through_the_collectives(alone):
    x = jnp.arange(3.0)
    for op in ("sum", "mean"):
        g = jax.jit(jax.grad(lambda v: jnp.sum(zj.allreduce({"v": v, "i": jnp.arange(2)}, op)["v"] ** 2)))(x)
        np.testing.assert_array_equal(np.asarray(g), 2 * np.arange(3.0))  # one rank: the plain gradient
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda v: jnp.sum(zj.broadcast(v) * 3))(x)), [3.0] * 3)
    gathered = jax.grad(lambda v: jnp.sum(zj.allgather(v) * jnp.asarray([[1.0, 2.0, 4.0]])))(x)
    np.testing.assert_array_equal(np.asarray(gathered), [1.0, 2.0, 4.0])
    for op in ("min", "max", "prod"):
        with pytest.raises(InvalidArgument, match=f"op '{op}' has no gradient.*stop_gradient"):
            jax.grad(lambda v: jnp.sum(zj.allreduce(v, op)))(x)


def test_vmap_through_the_collectives(alone):
    rows = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda v: zj.allreduce(v, "sum"))(rows)), np.asarray(rows))
    gathered = jax.jit(jax.vmap(zj.allgather))(rows)
    assert gathered.shape == (2, 1, 3)
    np.testing.assert_array_equal(np.asarray(gathered)[:, 0], np.asarray(rows))
    nested = jax.vmap(jax.vmap(lambda v: zj.broadcast(v, root=0)))(jnp.ones((4, 2, 3)))
    assert nested.shape == (4, 2, 3)
    per_row = jax.vmap(jax.grad(lambda v: jnp.sum(zj.allreduce(v, "mean") ** 2)))(rows)
    np.testing.assert_array_equal(np.asarray(per_row), 2 * np.asarray(rows))


# embedding gradients ---------------------------------------------------------------------------------
def test_float32_gradients_are_summed_before_the_cast_to_a_bfloat16_table(alone):
    table = zj.Embedding("half16", 4, 2, dtype="bfloat16", initializer=zf.init.zeros())
    g = np.float32(1 + 2**-8 + 2**-10)  # bfloat16 rounds each one up to 1.0078125
    assert table.push(jnp.zeros(1000, jnp.int32), jnp.full((1000, 2), g, jnp.float32)) == 1
    row = np.asarray(table.lookup(jnp.asarray([0]))[0])
    assert row.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(row.astype(np.float32), [1004.0, 1004.0])  # 1004.88 rounded once, not 1008
    with pytest.raises(InvalidArgument, match="gradients must have shape"):
        table.push(jnp.zeros(3, jnp.int32), jnp.ones((2, 2), jnp.float32))


# a collective that outlives its wait ---------------------------------------------------------------
def test_a_ring_whose_collective_outlived_its_wait_is_given_up(alone, monkeypatch):
    def never(coro):  # a collective stuck past its own deadline: its future never finishes
        coro.close()
        return concurrent.futures.Future()

    monkeypatch.setattr(zj_collectives, "GRACE_S", 0.05)
    with monkeypatch.context() as patch:
        patch.setattr(alone.ring, "submit", never)
        with pytest.raises(DeadlineExceeded, match="given up"):
            zj.broadcast({"w": jnp.ones(2)}, timeout=0.05)
    for call in (lambda: zj.allreduce({"w": jnp.ones(2)}), zj.barrier,
                 lambda: jax.jit(lambda x: zj.allgather(x))(jnp.ones(2))):
        with pytest.raises(DeadlineExceeded, match="unusable.*shutdown"):
            call()
    zj.shutdown()
    zj.init(timeout=20)  # a new ring
    np.testing.assert_array_equal(np.asarray(zj.broadcast({"w": jnp.ones(2)})["w"]), [1.0, 1.0])
