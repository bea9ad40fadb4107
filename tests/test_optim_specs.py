"""Optimizer specs: what travels to the shards, checked there, and how a bad one is refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from zmqflow import optim
from zmqflow.errors import InvalidArgument
from zmqflow.optim import SGD, Adagrad, Adam, Momentum, SyncReplicas
from zmqflow.state.store import ShardStore
from zmqflow.state.sync import SyncState

from .optim_cases import OPTIMIZERS


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_spec_round_trip(key):
    opt = OPTIMIZERS[key]
    spec = opt.spec()
    assert spec["kind"] == opt.kind
    assert json.loads(json.dumps(spec)) == spec  # plain data, fit to travel
    back = optim.from_spec(json.loads(json.dumps(spec)))
    assert type(back) is type(opt) and back == opt


def test_spec_defaults_and_passthrough():
    assert optim.from_spec({"kind": "adam"}) == Adam()
    assert Adam().learning_rate == 0.001 and SGD().learning_rate == 0.01
    assert optim.from_spec({"kind": "adagrad", "learning_rate": 0.5}) == Adagrad(learning_rate=0.5, initial_accumulator_value=0.1)
    assert optim.from_spec(None) is None
    m = Momentum(nesterov=True)
    assert optim.from_spec(m) is m
    # unknown keys are ignored rather than refused
    assert optim.from_spec({"kind": "sgd", "learning_rate": 0.2, "name": "x"}) == SGD(0.2)


def test_sync_replicas_spec_round_trip():
    sr = SyncReplicas(Adam(learning_rate=0.02), replicas_to_aggregate=2, total_num_replicas=3)
    spec = json.loads(json.dumps(sr.spec()))
    assert spec["kind"] == "sync_replicas" and spec["optimizer"]["kind"] == "adam"
    back = optim.from_spec(spec)
    assert back == sr
    assert optim.from_spec(SyncReplicas().spec()) == SyncReplicas(SGD(), 1, None)


def test_store_takes_sync_replicas_apart():
    store = ShardStore()
    sr = SyncReplicas(Momentum(learning_rate=0.1), replicas_to_aggregate=2, total_num_replicas=3)
    store.create("w", 0, [3], [0, 3], "float64", optimizer=sr.spec())
    p = store.get("w")
    assert p.optimizer == Momentum(learning_rate=0.1)
    assert isinstance(p.sync, SyncState)
    assert (p.sync.replicas_to_aggregate, p.sync.total_num_replicas, p.sync.step) == (2, 3, 0)
    assert set(p.slots) == {"momentum"}


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("adam", "must be a map"),
        (["adam"], "must be a map"),
        ({}, "unknown optimizer"),
        ({"kind": "rmsprop"}, "rmsprop"),
        ({"kind": "ADAM"}, "unknown optimizer"),
        ({"kind": "sync_replicas"}, "needs an optimizer"),
        ({"kind": "sync_replicas", "optimizer": None}, "needs an optimizer"),
        ({"kind": "sync_replicas", "optimizer": {"kind": "sync_replicas", "optimizer": {"kind": "sgd"}}}, "needs an optimizer"),
        ({"kind": "sync_replicas", "optimizer": {"kind": "nope"}}, "nope"),
        ({"kind": "sync_replicas", "optimizer": {"kind": "sgd"}, "replicas_to_aggregate": 0}, "replicas_to_aggregate"),
        ({"kind": "sync_replicas", "optimizer": {"kind": "sgd"}, "replicas_to_aggregate": 2**60},
         "replicas_to_aggregate 1152921504606846976 is over the limit of 65536"),
        ({"kind": "sync_replicas", "optimizer": {"kind": "sgd"}, "total_num_replicas": 65537},
         "total_num_replicas 65537 is over the limit of 65536"),
        ({"kind": "sync_replicas", "optimizer": {"kind": "sgd"}, "replicas_to_aggregate": 3, "total_num_replicas": 2}, "total_num_replicas 2"),
    ],
)
def test_bad_specs_raise_invalid_argument(spec, needle):
    with pytest.raises(InvalidArgument, match=needle):
        optim.from_spec(spec)


def test_unknown_kind_lists_known_ones():
    with pytest.raises(InvalidArgument) as info:
        optim.from_spec({"kind": "lamb"})
    for known in ("adagrad", "adam", "momentum", "sgd", "sync_replicas"):
        assert known in str(info.value)


def test_bad_field_type_raises_invalid_argument():
    with pytest.raises(InvalidArgument):
        optim.from_spec({"kind": "sgd", "learning_rate": "fast"})


def test_sync_replicas_non_int_aggregate_raises_invalid_argument():
    with pytest.raises(InvalidArgument):
        optim.from_spec({"kind": "sync_replicas", "optimizer": {"kind": "sgd"}, "replicas_to_aggregate": "two"})


def test_sync_replicas_non_int_total_raises_invalid_argument():
    with pytest.raises(InvalidArgument):
        optim.from_spec({"kind": "sync_replicas", "optimizer": {"kind": "sgd"}, "total_num_replicas": "3"})


def test_store_refuses_a_bad_optimizer_and_creates_nothing():
    store = ShardStore()
    with pytest.raises(InvalidArgument):
        store.create("w", 0, [2], [0, 2], "float64", optimizer={"kind": "rmsprop"})
    assert store.parts == {}


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_sgd_scales_in_the_parts_own_precision(dtype):
    """The scaled gradient is computed in the part's dtype, as ``np.multiply(..., dtype=)`` would:
    the same bits as before bfloat16 needed another way to make it."""
    rng = np.random.default_rng(1)
    param = rng.standard_normal(1000).astype(dtype)
    grad = rng.standard_normal(1000).astype(dtype)
    want = param - np.multiply(grad, 0.037, dtype=dtype)
    got = SGD(0.037).update(param.copy(), grad, {}, None)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("opt", [SGD(0.1), Momentum(0.1), Momentum(0.1, nesterov=True), Adagrad(0.1), Adam(0.01)],
                         ids=["sgd", "momentum", "nesterov", "adagrad", "adam"])
def test_bfloat16_variables_take_every_optimizer_dense_and_sparse(opt):
    """A bfloat16 part steps like its float32 twin, to bfloat16's precision: the optimizers' scaled
    temporaries are made in the part's dtype without asking numpy to cast a Python float to it
    (ml_dtypes refuses that cast, and a push used to fail with a TypeError)."""
    rng = np.random.default_rng(5)
    init = rng.standard_normal((6, 4)).astype(np.float32)
    grads = [rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3)]
    stores = {}
    for dt in ("bfloat16", "float32"):
        s = ShardStore()
        s.create("w", 0, [6, 4], [0, 6], dt, optimizer=opt.spec())
        s.assign("w", 0, init.astype(dt))
        for g in grads:
            s.apply_dense("w", 0, g.astype(dt))
            s.apply_sparse("w", 0, np.array([1, 4, 1]), g[:3].astype(dt))
        stores[dt] = s.read("w").astype(np.float32)
    assert np.isfinite(stores["bfloat16"]).all()
    np.testing.assert_allclose(stores["bfloat16"], stores["float32"], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("make, needle", [
    (lambda: SGD(-0.1), "sgd optimizer: learning_rate must be >= 0, got -0.1"),
    (lambda: SGD(float("inf")), "sgd optimizer: learning_rate must be a finite number"),
    (lambda: Momentum(0.1, momentum=-0.5), "momentum optimizer: momentum must be >= 0"),
    (lambda: Adagrad(0.1, initial_accumulator_value=0.0), "adagrad optimizer: initial_accumulator_value must be > 0"),
    (lambda: Adagrad(0.1, initial_accumulator_value=-1.0), "initial_accumulator_value must be > 0"),
    (lambda: Adam(beta1=1.0), "adam optimizer: beta1 must be >= 0 and < 1, got 1.0"),
    (lambda: Adam(beta2=-0.1), "adam optimizer: beta2 must be >= 0 and < 1"),
    (lambda: Adam(epsilon=-1e-8), "adam optimizer: epsilon must be >= 0"),
    (lambda: Momentum(nesterov=1), "momentum optimizer: nesterov must be a bool"),
    (lambda: optim.from_spec({"kind": "adagrad", "initial_accumulator_value": 0}), "initial_accumulator_value must"),
    (lambda: optim.from_spec({"kind": "sync_replicas", "optimizer": {"kind": "adam", "beta1": 1}}), "beta1 must be"),
], ids=["sgd_lr", "sgd_inf", "momentum", "adagrad_zero", "adagrad_negative", "adam_beta1", "adam_beta2", "adam_eps",
        "nesterov", "spec_adagrad", "spec_sync_adam"])
def test_hyperparameters_out_of_range_are_refused_where_the_optimizer_is_made(make, needle):
    """Each would make every update NaN or infinite (0/0 for a zero Adagrad accumulator beside a
    zero gradient; Adam's bias correction divides by 1 - beta1**t): refused on the client, and on
    the shard for a peer's spec."""
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        make()


def test_the_accumulator_floor_the_torch_backend_gives_adagrad_is_accepted():
    """torch's Adagrad(initial_accumulator_value=0, eps) maps to a floor of eps**2: still > 0."""
    floor = 1e-10 ** 2
    store = ShardStore()
    store.create("w", 0, [3], [0, 3], "float32", optimizer=Adagrad(0.1, initial_accumulator_value=floor).spec(),
                 value=np.ones(3, np.float32))
    store.apply_dense("w", 0, np.array([1.0, 0.0, 1.0], np.float32))
    assert np.isfinite(store.read("w")).all()
