"""Optimizer slots of half-precision variables and tables are float32, and their updates are
computed in float32 and rounded once: in float16, Adam's epsilon and small squared gradients are
zero (0/0, x/0); in bfloat16, ``v * 0.999`` rounds back to ``v`` and no average decays. Checked
through real shards against a float32 reference computed with numpy, through checkpoints (new
files hold float32 slots; files with half-precision slots restore, widened), and for the byte
budgets that count the slots."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client.checkpoint import async_restore, async_save
from zmqflow.state import kernels
from zmqflow.state.catalog import Catalog
from zmqflow.state.optim import SGD, Adagrad, Adam, Momentum, Optimizer, SyncReplicas, slot_dtype
from zmqflow.state.snapshot import write_atomic
from zmqflow.state.store import ShardStore
from zmqflow.state.tables import HashTable
from zmqflow.state.tensorfile import TensorFile
from zmqflow.testing import local_cluster
from zmqflow.training.strategy import LocalParams
from zmqflow.wire.requests import ps as rq

from .conftest import arun

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALF = [F16, BF16]
EPS = {F16: 2.0**-10, BF16: 2.0**-7}  # a value's rounding error is at most half of EPS times its size
OPTIMIZERS = [Adam(0.01), Momentum(0.05, momentum=0.99), Adagrad(0.1)]
IDS = np.array([0, 2, 5])  # the table rows every push touches
PUSHES = 25


def gradients(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> list[np.ndarray]:
    """One large gradient with a column of zeros (0/0 in float16 Adam), then small ones whose
    squares float16 cannot hold and whose averages bfloat16 cannot decay; in ``dtype``."""
    rng = np.random.default_rng(seed)
    first = rng.standard_normal(shape)
    first[:, 0] = 0
    rest = [rng.standard_normal(shape) * 1e-3 for _ in range(PUSHES - 1)]
    return [g.astype(dtype) for g in [first, *rest]]


def reference(opt: Optimizer, init: np.ndarray, grads: list[np.ndarray],
              rows: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """(values, slots, the sum of every step's |values|) in float32 with numpy, no rounding to
    half precision between steps; ``rows``: the rows each gradient is for (all, when None)."""
    p = init.astype(np.float32)
    slots = {k: np.full(p.shape, opt.slot_init(k), np.float32) for k in opt.slot_names}
    at = slice(None) if rows is None else rows
    trace = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float32)
        if isinstance(opt, Adam):
            m = slots["m"][at] = opt.beta1 * slots["m"][at] + (1 - opt.beta1) * g
            v = slots["v"][at] = opt.beta2 * slots["v"][at] + (1 - opt.beta2) * g * g
            lr_t = np.float32(opt.learning_rate * np.sqrt(1 - opt.beta2**t) / (1 - opt.beta1**t))
            p[at] -= lr_t * m / (np.sqrt(v) + np.float32(opt.epsilon))
        elif isinstance(opt, Momentum):
            m = slots["momentum"][at] = opt.momentum * slots["momentum"][at] + g
            p[at] -= np.float32(opt.learning_rate) * m
        else:
            acc = slots["accumulator"][at] = slots["accumulator"][at] + g * g
            p[at] -= np.float32(opt.learning_rate) * g / np.sqrt(acc)
        trace += np.abs(p)
    return p, slots, trace


def assert_follows(got: np.ndarray, slots: dict[str, np.ndarray], want: tuple, dtype: np.dtype, what: str) -> None:
    """Values within the rounding of each step's value to ``dtype`` of the float32 reference;
    slots float32 and equal to the reference's to float32 rounding (they see only gradients)."""
    values, ref_slots, trace = want
    assert got.dtype == dtype, what
    assert np.isfinite(got.astype(np.float32)).all(), f"{what}: {got}"
    for k, s in slots.items():
        assert s.dtype == np.float32, f"{what} slot {k} is {s.dtype}"
        np.testing.assert_allclose(s, ref_slots[k], rtol=2e-5, atol=1e-12, err_msg=f"{what} slot {k}")
    tol = EPS[dtype] * trace + 1e-6 * PUSHES
    err = np.abs(got.astype(np.float32) - values)
    assert (err <= tol).all(), f"{what}: off the float32 reference by {err.max()} (allowed {tol[err > tol]})"


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.kind)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_variables_and_tables_follow_a_float32_reference_with_float32_slots(dtype, opt):
    """A dense variable, a static table and a dynamic table, pushed through a shard."""
    rng = np.random.default_rng(3)
    init = rng.standard_normal((6, 4)).astype(dtype)
    dense, sparse = gradients((6, 4), dtype, 1), gradients((len(IDS), 4), dtype, 2)

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            ps = servers["ps:0"].service("ps")
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                var = await sess.variable("w", init, optimizer=opt)
                static = await sess.embedding("s", 6, 4, dtype=dtype.name, optimizer=opt,
                                              initializer=zf.init.normal(seed=1))
                dynamic = await sess.embedding("d", None, 4, dtype=dtype.name, optimizer=opt,
                                               initializer=zf.init.normal(seed=2))
                s0 = await static.lookup(np.arange(6))
                d0 = await dynamic.lookup(IDS)
                for g, gs in zip(dense, sparse):
                    await var.push(g)
                    assert await static.push(IDS, gs) == len(IDS)
                    assert await dynamic.push(IDS, gs) == len(IDS)
                part = ps.store.get("w")
                assert_follows(await var.read(), part.slots, reference(opt, init, dense), dtype, "variable")
                part = ps.store.get("s")
                assert_follows(await static.lookup(np.arange(6)), part.slots, reference(opt, s0, sparse, IDS), dtype,
                               "static table")
                table = ps.tables[("d", 0)]
                at = table.index.find(IDS, table.ids)
                assert_follows(await dynamic.lookup(IDS), {k: s[at] for k, s in table.slots.items()},
                               reference(opt, d0, sparse), dtype, "dynamic table")

    arun(main())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_sync_replicas_half_variable_steps_in_float32(dtype):
    """SyncReplicas sums the replicas' gradients in float32 and hands their mean, still in
    float32, to the same update: float32 slots, no NaN."""
    opt = Adam(0.01)
    init = np.random.default_rng(4).standard_normal((6, 4)).astype(dtype)
    grads = gradients((6, 4), dtype, 5)[:8]

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                var = await sess.variable("w", init, optimizer=SyncReplicas(opt, replicas_to_aggregate=1))
                for g in grads:
                    await var.push(g)
                part = servers["ps:0"].service("ps").store.get("w")
                values, slots, trace = reference(opt, init, grads)
                got = (await var.read()).astype(np.float32)
                assert part.slots["m"].dtype == part.slots["v"].dtype == np.float32 and part.sync.step == len(grads)
                assert np.isfinite(got).all()
                np.testing.assert_allclose(part.slots["v"], slots["v"], rtol=2e-5, atol=1e-12)
                assert (np.abs(got - values) <= EPS[dtype] * trace + 1e-5).all()

    arun(main())


def test_an_adagrad_floor_below_float16s_range_stays_a_floor():
    """The torch ps backend turns Adagrad's eps into an initial accumulator of eps**2 (1e-20):
    zero in float16, so a zero gradient's step was 0/0. In float32 slots it stays."""
    store = ShardStore()
    store.create("w", 0, [4], [0, 4], "float16", optimizer=Adagrad(0.1, initial_accumulator_value=1e-20).spec())
    store.assign("w", 0, np.ones(4, np.float16))
    store.apply_dense("w", 0, np.array([0, 0, 1, -1], np.float16))
    store.apply_sparse("w", 0, np.array([0, 3]), np.zeros(2, np.float16))
    np.testing.assert_array_equal(store.read("w"), np.array([1, 1, 0.9, 1.1], np.float16))
    assert store.get("w").slots["accumulator"][0] == np.float32(1e-20)


def test_the_rule_and_the_fast_paths():
    """One rule for the slots' dtype; full precision passes through ``apply`` untouched (the same
    bits as ``update``); the C loops refuse arrays of mixed dtypes, and ``update`` on them still
    steps (numpy's way), one rounding away from ``apply``."""
    assert slot_dtype(F16) == slot_dtype(BF16) == slot_dtype("float16") == np.float32
    assert slot_dtype(np.float32) == np.float32 and slot_dtype(np.float64) == np.float64
    rng = np.random.default_rng(6)
    for opt in [SGD(0.1), Momentum(0.1, nesterov=True), *OPTIMIZERS]:
        for dt in (np.float32, np.float64):
            p, g = rng.standard_normal((5, 3)).astype(dt), rng.standard_normal((5, 3)).astype(dt)
            slots = [{k: np.full((5, 3), opt.slot_init(k), dt) for k in opt.slot_names} for _ in range(2)]
            t = np.ones(5, np.int64)
            a, b = opt.apply(p.copy(), g, slots[0], t), opt.update(p.copy(), g, slots[1], t)
            assert a.tobytes() == b.tobytes() and all(slots[0][k].tobytes() == slots[1][k].tobytes() for k in slots[0])
        for dt in HALF:
            p, g = rng.standard_normal((5, 3)).astype(dt), rng.standard_normal((5, 3)).astype(dt)
            slots = [{k: np.full((5, 3), opt.slot_init(k), np.float32) for k in opt.slot_names} for _ in range(2)]
            t = np.ones(5, np.int64)
            a = opt.apply(p.copy(), g, slots[0], t)
            b = opt.update(p.copy(), g, slots[1], t)
            assert a.dtype == b.dtype == dt
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=4 * EPS[dt], atol=1e-3)
    m, v = np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    p, g = np.ones((4, 2), F16), np.ones((4, 2), F16)
    assert not kernels.momentum_step(p, g, m, 0.1, 0.9, False)
    assert not kernels.adagrad_step(p, g, v, 0.1)
    assert not kernels.adam_step(p, g, m, v, 0.9, 0.999, 1e-8, np.ones(4))
    assert not m.any() and not v.any() and (p == 1).all()  # refused: nothing written


def test_byte_budgets_count_float32_slots():
    """What a shard reserves, holds and lets a table grow to, and what the catalog places,
    count a half-precision variable's slots at 4 bytes an element."""
    adam = Adam().spec()
    store = ShardStore()
    plan = store.plan("w", 0, [10, 4], [0, 10], "float16", optimizer=adam)
    store.release(plan)
    store.create("w", 0, [10, 4], [0, 10], "float16", optimizer=adam)
    want = 40 * (2 + 4 + 4) + 10 * 8  # values, m and v, each row's step
    assert plan.nbytes == store.get("w").nbytes == want
    assert HashTable.row_size(4, BF16, adam) == 4 * (2 + 4 + 4) + HashTable.ROW_OVERHEAD + HashTable.STEP_BYTES
    table = HashTable(4, BF16, optimizer=adam)
    table.lookup(np.arange(3000))  # grown past its first arrays: the slots stay float32
    assert {s.dtype for s in table.slots.values()} == {np.dtype(np.float32)}
    catalog = Catalog(["ps:0"])
    catalog.declare("w", [10, 4], "bfloat16", [[0, 10]], [80], optimizer=Momentum().spec())
    catalog.declare("f", [10, 4], "float32", [[0, 10]], [160], optimizer=Momentum().spec())
    assert catalog.held["ps:0"] == 40 * (2 + 4) + 40 * (4 + 4)


def test_replica_parameters_keep_float32_slots_and_load_half_ones():
    local = LocalParams()
    local.create({"w": np.ones((3, 2), F16)}, Momentum(0.1))
    part = local.store.get("w")
    assert part.slots["momentum"].dtype == np.float32
    local.load({"w": {"value": np.full((3, 2), 2, F16), "slot.momentum": np.full((3, 2), 0.1, F16)}})
    np.testing.assert_array_equal(part.slots["momentum"], np.float32(np.float16(0.1)))


async def _populate(sess: zf.AsyncSession, dtype: np.dtype) -> None:
    """A half-precision variable and dynamic table under Adam, pushed (small gradients)."""
    var = await sess.variable("w", np.ones((6, 4), dtype), optimizer=Adam(0.01))
    dyn = await sess.embedding("d", None, 4, dtype=dtype.name, optimizer=Adam(0.01), initializer=zf.init.ones())
    await dyn.lookup(IDS)
    for g, gs in zip(gradients((6, 4), dtype, 7)[:5], gradients((3, 4), dtype, 8)):
        await var.push(g)
        await dyn.push(IDS, gs)


def _state(ps) -> dict[str, np.ndarray]:
    part, table = ps.store.get("w"), ps.tables[("d", 0)]
    at = table.index.find(IDS, table.ids)
    return {"w": part.value.copy(), **{f"w.{k}": s.copy() for k, s in part.slots.items()}, "w.steps": part.steps.copy(),
            "d": table.values[at], **{f"d.{k}": s[at] for k, s in table.slots.items()}, "d.steps": table.steps[at]}


@contextlib.asynccontextmanager
async def _saved(tmp_path: Any, dtype: np.dtype) -> AsyncIterator[tuple[zf.AsyncSession, Any, dict, str]]:
    """A cluster whose half-precision variable and table were trained, then saved at step 5:
    (the session, the shard's ps service, the shard's state when saved, the checkpoint's path)."""
    async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
        ps = servers["ps:0"].service("ps")
        async with zf.AsyncSession(servers["worker:0"].target) as sess:
            await _populate(sess, dtype)
            saved = _state(ps)
            yield sess, ps, saved, await async_save(sess, str(tmp_path), step=5)


def _shard_file(manifest_path: str) -> str:
    with open(manifest_path) as fh:
        (shard,) = json.load(fh)["shards"]
    return os.path.join(os.path.dirname(manifest_path), shard["file"])


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_checkpoint_holds_float32_slots_and_the_shards_take_them_back(tmp_path, dtype):
    """The shard file holds the slots as they are held; the restore ops put them back bit for bit."""
    async def main() -> None:
        async with _saved(tmp_path, dtype) as (sess, ps, saved, path):
            with TensorFile(_shard_file(path)) as f:
                for name in ("w/slot/m", "w/slot/v", "d/part_0/slot/m", "d/part_0/slot/v"):
                    assert f.dtype(name) == "float32", name
                assert f.dtype("w") == f.dtype("d/part_0/values") == dtype.name
                tensors = {k: np.array(f.read(k)) for k in f.keys()}
            await _populate(sess, dtype)  # moved on: the restore must undo it
            await sess.call_task("ps:0", "ps", "restore_part", rq.RestorePart(
                name="w", part=0, value=tensors["w"], steps=tensors["w/steps"],
                slots={k: tensors[f"w/slot/{k}"] for k in ("m", "v")}))
            await sess.call_task("ps:0", "ps", "emb_restore", rq.EmbRestore(
                name="d", part=0, ids=tensors["d/part_0/ids"], values=tensors["d/part_0/values"],
                slots={k: tensors[f"d/part_0/slot/{k}"] for k in ("m", "v")}, steps=tensors["d/part_0/steps"]))
            _assert_same(_state(ps), saved)

    arun(main())


def test_a_checkpoint_with_float32_slots_restores_through_the_client(tmp_path):
    async def main() -> None:
        async with _saved(tmp_path, F16) as (sess, ps, saved, path):
            await _populate(sess, F16)
            assert await async_restore(sess, path) == 5
            _assert_same(_state(ps), saved)

    arun(main())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_checkpoint_with_half_precision_slots_restores_widened(tmp_path, dtype):
    """A checkpoint written when a half-precision variable's slots were kept in its own dtype:
    the client's checks take it as they did, and the shards widen its slots to float32."""
    async def main() -> None:
        async with _saved(tmp_path, dtype) as (sess, ps, saved, path):
            file = _shard_file(path)
            with TensorFile(file) as f:  # rewritten as such a checkpoint is
                tensors = {k: np.array(f.read(k)) for k in f.keys()}
                metadata = dict(f.metadata)
            old = {k: (a.astype(dtype) if "/slot/" in k else a) for k, a in tensors.items()}
            write_atomic(file, old, metadata=metadata)
            await _populate(sess, dtype)
            assert await async_restore(sess, path) == 5
            now = _state(ps)
            for k, a in saved.items():
                want = a.astype(dtype).astype(np.float32) if k.endswith((".m", ".v")) else a
                assert now[k].dtype == a.dtype and now[k].tobytes() == want.tobytes(), k
            await _populate(sess, dtype)  # and training goes on from them
            assert np.isfinite(ps.store.get("w").value.astype(np.float32)).all()

    arun(main())
