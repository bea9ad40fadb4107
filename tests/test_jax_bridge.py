"""zmqflow.jax: pytree collectives, gradient averaging in optax chains, embeddings from JAX.

Alone (one rank, a private in-process cluster) and as two real ranks under ``zmqflow launch``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import zmqflow as zf  # noqa: E402
import zmqflow.jax as zj  # noqa: E402
from zmqflow.bridge import runtime as rt  # noqa: E402
from zmqflow.errors import ConfigError, InvalidArgument, VariableConflict  # noqa: E402

from .conftest import ZMQFLOW, Proc  # noqa: E402


def _tree(r: float = 0.0):
    return {
        "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + r,
        "pair": (jnp.full((3,), 7, jnp.int32), jnp.asarray([1.5, -2.0], jnp.bfloat16)),
        "nested": [jnp.float32(3.0), 2.5, None],
    }


# alone ----------------------------------------------------------------------------------------
def test_before_init_every_call_says_to_call_init(monkeypatch):
    assert not zj.is_initialized()
    for call in (zj.rank, zj.size, lambda: zj.allreduce({"x": jnp.ones(2)}), lambda: zj.Embedding("t", 4, 2)):
        with pytest.raises(ConfigError, match="init"):
            call()


def test_alone_this_process_is_rank_0_of_1_and_init_is_idempotent(alone):
    assert (zj.rank(), zj.size(), zj.local_rank(), zj.local_size()) == (0, 1, 0, 1)
    assert zj.init() is alone and rt.current() is alone


@pytest.mark.parametrize("op", zj.OPS)
def test_allreduce_alone_keeps_the_tree_values_and_dtypes(alone, op):
    tree = _tree()
    out = zj.allreduce(tree, op)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree)):
        assert isinstance(got, jax.Array)
        assert got.dtype == jnp.asarray(want).dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_one_ring_call_per_dtype(alone):
    seq = alone.ring.async_ring.seq
    tree = {f"l{i}": jnp.asarray(np.ones(i + 1, np.float32)) for i in range(20)}
    zj.allreduce(tree | {"i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16)})
    assert alone.ring.async_ring.seq - seq == 3  # float32, int32, bfloat16: 22 leaves, 3 calls


def test_broadcast_and_allgather_alone(alone):
    tree = _tree(1.0)
    b = zj.broadcast(tree, root=0)
    g = zj.allgather(tree)
    for src, got_b, got_g in zip(*(jax.tree_util.tree_leaves(t) for t in (tree, b, g))):
        np.testing.assert_array_equal(np.asarray(got_b), np.asarray(src))
        assert got_g.shape == (1, *np.shape(src))
        np.testing.assert_array_equal(np.asarray(got_g)[0], np.asarray(src))
    assert zj.allreduce({}) == {} and zj.broadcast([]) == []


def test_bad_input_is_refused_before_anything_is_sent(alone):
    seq = alone.ring.async_ring.seq
    with pytest.raises(InvalidArgument, match="op must be one of"):
        zj.allreduce(_tree(), "avg")
    with pytest.raises(InvalidArgument, match=r"leaf \['q'\] has dtype float8_e4m3fn.*allowed are"):
        zj.allreduce({"ok": jnp.ones(2), "q": jnp.ones(2, jnp.float8_e4m3fn)})
    with pytest.raises(InvalidArgument, match=r"mean of leaf \['m'\] \(bool\)"):
        zj.allreduce({"m": jnp.ones(2, bool)})
    with pytest.raises(InvalidArgument, match="root must be a rank in"):
        zj.broadcast(_tree(), root=1)
    with pytest.raises(InvalidArgument, match="leaves must be arrays or numbers, got str"):
        zj.allgather({"s": "text"})
    with pytest.raises(InvalidArgument, match="op must be one of"):
        zj.distributed_gradients("median")
    assert alone.ring.async_ring.seq == seq  # not one call started
    np.testing.assert_array_equal(np.asarray(zj.allreduce({"m": jnp.ones(2, bool)}, "max")["m"]), [True, True])


def test_collectives_run_inside_jit_in_order_with_eager_ones(alone):
    @jax.jit
    def twice(tree):
        return jax.tree_util.tree_map(lambda x: x * 2, zj.allreduce(tree, "sum"))

    seq = alone.ring.async_ring.seq
    out = twice(_tree())
    eager = zj.allgather({"x": jnp.ones(2)})  # waits for the jitted call's effect first
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
    assert out["pair"][1].dtype == jnp.bfloat16 and eager["x"].shape == (1, 2)
    assert alone.ring.async_ring.seq - seq == 4  # three dtypes in the jitted call, then the allgather


def _mlp(seed: int, sizes=(5, 16, 1)):
    rng = np.random.default_rng(seed)  # numpy, not jax.random: eager JAX ops compile one by one
    return [{"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32), "b": jnp.zeros(b)}
            for a, b in zip(sizes, sizes[1:])]


def _loss(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h[:, 0] - y) ** 2)


def test_distributed_gradients_alone_is_exactly_plain_optax(alone):
    dist = optax.chain(zj.distributed_gradients(), optax.sgd(0.1, momentum=0.9))
    plain = optax.sgd(0.1, momentum=0.9)
    assert isinstance(zj.DistributedGradients(), optax.GradientTransformation)
    assert dist.init(_mlp(0))[0] == optax.EmptyState()
    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.normal(size=(32, 5)), jnp.float32), jnp.asarray(rng.normal(size=32), jnp.float32)
    params = _mlp(0)
    grad = jax.jit(jax.grad(_loss))

    def train(opt, jit):
        def step(params, state):
            updates, state = opt.update(grad(params, x, y), state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(step) if jit else step  # eager: the update (and its allreduce) outside jit
        p, state = params, opt.init(params)
        for _ in range(4):
            p, state = step(p, state)
        return p

    want = train(plain, True)
    for jit in (True, False):
        for a, b in zip(jax.tree_util.tree_leaves(train(dist, jit)), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert float(_loss(want, x, y)) < float(_loss(params, x, y))


def test_embedding_alone_lookup_grad_push(alone):
    table = zj.Embedding("alone_emb", 20, 4, optimizer=zf.optim.SGD(0.5), initializer=zf.init.ones())
    ids = jnp.asarray([[3, 7], [3, 3]])
    rows = table.lookup(ids)
    assert isinstance(rows, jax.Array) and rows.shape == (2, 2, 4) and rows.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(rows), np.ones((2, 2, 4)))
    g = jax.grad(lambda r: jnp.sum(r * jnp.arange(1.0, 5.0)))(rows)
    assert table.push(ids, g.astype(jnp.bfloat16)) == 2  # two distinct rows; bfloat16 is cast to the table's float32
    after = np.asarray(table.lookup(jnp.asarray([3, 7, 0])))
    np.testing.assert_allclose(after[0], 1 - 0.5 * 3 * np.arange(1.0, 5.0))  # id 3 three times: summed once
    np.testing.assert_allclose(after[1], 1 - 0.5 * np.arange(1.0, 5.0))
    np.testing.assert_array_equal(after[2], np.ones(4))
    assert zj.Embedding("alone_emb", 20, 4).lookup(jnp.asarray([7])).shape == (1, 4)  # attaches to the same table
    with pytest.raises(VariableConflict):
        zj.Embedding("alone_emb", 20, 8)
    with pytest.raises(InvalidArgument, match="cannot be traced"):
        jax.jit(table.lookup)(ids)
    with pytest.raises(InvalidArgument, match="out of range"):
        table.lookup(jnp.asarray([20]))


def test_embedding_alone_many_tables_at_once(alone):
    a = zj.Embedding("many_a", 10, 2, optimizer=zf.optim.SGD(1.0), initializer=zf.init.ones())
    b = zj.Embedding("many_b", 12, 3, optimizer=zf.optim.SGD(1.0), initializer=zf.init.zeros())
    ids = [jnp.asarray([1, 1, 4]), jnp.asarray([[2], [5]])]
    rows = zj.lookup_many([a, b], ids)
    assert [r.shape for r in rows] == [(3, 2), (2, 1, 3)] and all(isinstance(r, jax.Array) for r in rows)
    grads = [jnp.ones((3, 2), jnp.bfloat16), jnp.full((2, 1, 3), 0.5)]  # bfloat16 summed, then cast
    assert zj.push_many([a, b], ids, grads) == [2, 2]
    np.testing.assert_array_equal(np.asarray(a.lookup(jnp.asarray([1, 4]))), [[-1, -1], [0, 0]])
    np.testing.assert_array_equal(np.asarray(b.lookup(jnp.asarray([2]))), [[-0.5, -0.5, -0.5]])
    with pytest.raises(InvalidArgument, match="a sequence of zmqflow.jax.Embedding"):
        zj.lookup_many(a, ids)
    with pytest.raises(InvalidArgument, match="2 tables but 1 gradient arrays"):
        zj.push_many([a, b], ids, grads[:1])
    with pytest.raises(InvalidArgument, match="1 tables but 2 id arrays"):
        zj.lookup_many([a], ids)
    with pytest.raises(InvalidArgument, match="cannot be traced"):
        jax.jit(lambda x: zj.lookup_many([a], [x]))(ids[0])


@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="no GPU for JAX on this machine")
def test_gpu_arrays_come_back_on_their_device(alone):  # pragma: no cover - GPU only
    x = jax.device_put(jnp.arange(4.0), jax.devices("gpu")[0])
    out = zj.allreduce({"x": x}, "sum")["x"]
    assert out.devices() == x.devices()
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))


def test_core_imports_without_jax():
    code = ("import sys; sys.modules['jax'] = sys.modules['optax'] = None\n"
            "import zmqflow, zmqflow.bridge.runtime, zmqflow.cli.main\n"
            "assert 'jax' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# two ranks under zmqflow launch -----------------------------------------------------------------
TWO_RANKS = textwrap.dedent(
    """
    import os, sys, numpy as np, jax, jax.numpy as jnp, optax
    import zmqflow as zf, zmqflow.jax as zj

    out = sys.argv[1]
    zj.init(timeout=30)
    r, n = zj.rank(), zj.size()
    res = {}
    zj.barrier()
    # both ranks create it at once; zero rows, so what the pushes added is read back exactly
    table = zj.Embedding("emb", 16, 4, optimizer=zf.optim.SGD(1.0), initializer=zf.init.zeros())

    tree = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + 2 * r,
            "pair": (jnp.full((3,), 10 * r, jnp.int32), jnp.asarray([1.0 + r, -2.0 * r], jnp.bfloat16))}
    for op in ("mean", "sum", "max", "prod"):
        got = zj.allreduce(tree, op)
        res[op + "/w"], res[op + "/i"], res[op + "/h"] = got["w"], got["pair"][0], got["pair"][1].astype(jnp.float32)
    res["jit_mean/w"] = jax.jit(lambda t: zj.allreduce(t))(tree)["w"]
    got = zj.broadcast({"w": jnp.full(3, r + 1.0), "i": jnp.arange(2) + r}, root=1)
    res["bcast/w"], res["bcast/i"] = got["w"], got["i"]
    res["gather"] = zj.allgather({"x": jnp.asarray([r, 10 * r])})["x"]
    two, w = jnp.ones(2), r + 1.0  # rank r's loss weighs the collective's result by r + 1
    res["grad/sum"] = jax.grad(lambda v: jnp.sum(zj.allreduce(v, "sum") * w))(two)
    res["grad/mean"] = jax.jit(jax.grad(lambda v: jnp.sum(zj.allreduce(v, "mean") * w)))(two)
    res["grad/bcast"] = jax.grad(lambda v: jnp.sum(zj.broadcast(v, root=1) * w))(two)
    res["grad/gather"] = jax.grad(lambda v: jnp.sum(zj.allgather(v) * jnp.asarray([[1.0], [10.0]]) * w))(two)
    res["vmap/sum"] = jax.vmap(lambda v: zj.allreduce(v, "sum"))(jnp.arange(4.0).reshape(2, 2) + r)

    def mlp(seed, sizes=(5, 16, 1)):
        rng = np.random.default_rng(seed)
        return [{"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32), "b": jnp.zeros(b)}
                for a, b in zip(sizes, sizes[1:])]

    def loss(params, x, y):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            h = jnp.tanh(h) if i < len(params) - 1 else h
        return jnp.mean((h[:, 0] - y) ** 2)

    grad = jax.jit(jax.grad(loss))

    def train(opt, params, x, y, steps, jit):
        def step(params, state):
            updates, state = opt.update(grad(params, x, y), state, params)
            return optax.apply_updates(params, updates), state
        step = jax.jit(step) if jit else step  # eager: the update (and its allreduce) outside jit
        state = opt.init(params)
        for _ in range(steps):
            params, state = step(params, state)
        return params

    rng = np.random.default_rng(7)
    x, y = jnp.asarray(rng.normal(size=(64, 5)), jnp.float32), jnp.asarray(rng.normal(size=64), jnp.float32)
    half = slice(32 * r, 32 * (r + 1))
    params = zj.broadcast(mlp(r), root=0)  # each rank drew its own; rank 0's win
    dist = optax.chain(zj.distributed_gradients(), optax.sgd(0.1))
    for name, jit, steps in (("jit", True, 20), ("eager", False, 3)):
        mine = train(dist, params, x[half], y[half], steps, jit)
        whole = train(optax.sgd(0.1), params, x, y, steps, True)  # one process, the whole batch
        for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(whole))):
            res[f"{name}/{i}"], res[f"{name}_ref/{i}"] = a, b
        res[f"{name}/loss"] = loss(mine, x, y)
    res["loss_before"] = loss(params, x, y)

    ids = jnp.asarray([[0, 2], [2, 5]])
    rows = table.lookup(ids)
    grads = jax.grad(lambda rows: jnp.sum(rows * (r + 1.0)))(rows)
    res["pushed"] = np.asarray(table.push(ids, grads))
    zj.barrier()  # both pushes applied
    res["emb"] = table.lookup(jnp.arange(8))
    np.savez(os.path.join(out, f"rank{r}.npz"), **{k: np.asarray(v) for k, v in res.items()})
    try:
        zj.allreduce({"a": jnp.zeros(2 + r)})  # the ranks disagree on the shape
        print("mismatch unnoticed", flush=True)
    except zf.errors.CollectiveMismatch as exc:
        print("mismatch raised:", exc, flush=True)
    print("then sum", float(zj.allreduce({"b": jnp.ones(())}, "sum")["b"]), flush=True)
    zj.shutdown()
    print("rank", r, "of", n, "done", flush=True)
    """
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both ranks' results (one launch of the script for every two-rank test)."""
    tmp = tmp_path_factory.mktemp("jax_ranks")
    script = tmp / "ranks.py"
    script.write_text(TWO_RANKS)
    p = Proc([*ZMQFLOW, "launch", "--workers", "2", "--ps", "2", "--", sys.executable, str(script), str(tmp)],
             env={"JAX_PLATFORMS": "cpu"})
    try:
        code = p.wait(100)
    finally:
        p.kill()
    assert code == 0, p.output
    assert "[worker:0] rank 0 of 2 done" in p.output and "[worker:1] rank 1 of 2 done" in p.output, p.output
    return [dict(np.load(tmp / f"rank{r}.npz")) for r in range(2)], p.output


def test_two_ranks_allreduce_a_pytree_exactly(two_ranks):
    two_ranks, _ = two_ranks
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = {
        "mean/w": w + 1, "mean/i": np.full(3, 5), "mean/h": [1.5, -1.0],
        "sum/w": 2 * w + 2, "sum/i": np.full(3, 10), "sum/h": [3.0, -2.0],
        "max/w": w + 2, "max/i": np.full(3, 10), "max/h": [2.0, 0.0],
        "prod/w": w * (w + 2), "prod/i": np.zeros(3), "prod/h": [2.0, -0.0],
        "jit_mean/w": w + 1,
    }
    for res in two_ranks:
        for key, value in want.items():
            np.testing.assert_array_equal(res[key], value, err_msg=key)
        assert res["mean/w"].dtype == np.float32 and res["mean/i"].dtype == np.int32


def test_two_ranks_broadcast_and_allgather(two_ranks):
    two_ranks, _ = two_ranks
    for res in two_ranks:
        np.testing.assert_array_equal(res["bcast/w"], np.full(3, 2.0))
        np.testing.assert_array_equal(res["bcast/i"], [1, 2])
        np.testing.assert_array_equal(res["gather"], [[0, 0], [1, 10]])


def test_two_ranks_differentiate_and_vmap_through_the_collectives(two_ranks):
    two_ranks, _ = two_ranks
    for r, res in enumerate(two_ranks):  # the cotangents 1 and 2 of the two ranks' losses, combined
        np.testing.assert_array_equal(res["grad/sum"], [3.0, 3.0])
        np.testing.assert_array_equal(res["grad/mean"], [1.5, 1.5])
        np.testing.assert_array_equal(res["grad/bcast"], [3.0 * (r == 1)] * 2)  # all of it to the root
        np.testing.assert_array_equal(res["grad/gather"], [3.0 * 10**r] * 2)  # row r of the gathered cotangents
        np.testing.assert_array_equal(res["vmap/sum"], 2 * np.arange(4.0).reshape(2, 2) + 1)


def test_two_ranks_on_half_batches_train_as_one_on_the_whole(two_ranks):
    (a, b), _ = two_ranks
    layers = sorted(k for k in a if k.startswith(("jit/", "eager/")) and not k.endswith("loss"))
    assert len(layers) == 8
    for key in layers:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # the replicas agree bit for bit
        ref = key.replace("/", "_ref/")
        np.testing.assert_allclose(a[key], a[ref], rtol=2e-5, atol=2e-6, err_msg=key)
    assert a["jit/loss"] < 0.9 * a["loss_before"]  # it did train


def test_two_ranks_disagreeing_trees_raise_on_both_and_the_ring_goes_on(two_ranks):
    _, output = two_ranks
    for task in ("worker:0", "worker:1"):
        assert "element count" in _line(output, f"[{task}] mismatch raised:")
        assert _line(output, f"[{task}] then sum").endswith(" 2.0")


def _line(output: str, start: str) -> str:
    found = [line for line in output.splitlines() if line.startswith(start)]
    assert found, f"no line starting {start!r} in:\n{output}"
    return found[0]


def test_two_ranks_embedding_pushes_add_up(two_ranks):
    want = np.zeros((8, 4), np.float32)
    want[0] = want[5] = -(1 + 2)  # SGD(1.0): each rank pushed its own (rank + 1) per occurrence
    want[2] = -(2 * 1 + 2 * 2)  # id 2 twice per rank, coalesced into one row per push
    for res in two_ranks[0]:
        assert int(res["pushed"]) == 3
        np.testing.assert_array_equal(res["emb"], want)
