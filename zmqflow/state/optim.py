"""Server-side optimizers (``zf.optim``): a spec that travels, and the numpy update a shard runs.

Updates work on a variable viewed as rows (axis 0) and act on any subset of rows in place, so a
shard applies a dense push slice by slice and a sparse push to the touched rows only, with the
slots of exactly those rows. Adam keeps its step count per row: a dense push advances every row
(plain Adam), a sparse push advances only the rows it touches (lazy Adam).

The slots of a half-precision variable (float16, bfloat16) are float32 (:func:`slot_dtype`), and
its update is computed in float32 and rounded to the variable's dtype once (:meth:`Optimizer.apply`):
in float16, Adam's epsilon (1e-8) and small squared gradients are zero, so its step is 0/0 or x/0;
in bfloat16 (8 bits of mantissa) ``v * 0.999`` rounds back to ``v``, so no average ever decays.
Float32 and float64 variables keep their slots in their own dtype and their update as it was.

A push may carry its own learning rate (:meth:`Optimizer.at`), as TF's apply ops take theirs as an
input each step: a worker's learning-rate schedule reaches the shards without redeclaring anything.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np

from ..errors import InvalidArgument
from ..wire.dtypes import half_precision
from . import kernels as _kernels
from .kernels import scaled as _scaled
from .kernels import sub_scaled as _sub_scaled

__all__ = ["Optimizer", "SGD", "Momentum", "Adagrad", "Adam", "SyncReplicas", "from_spec", "check_dtype", "slot_dtype",
           "held_itemsize", "restorable_slot", "bias_table"]

# Each hyperparameter's allowed range, as (low, low included, high): one out of range makes every
# update NaN or infinite (Adam's beta1 = 1 divides by zero, a zero Adagrad accumulator beside a
# zero gradient is 0/0), so it is refused where the optimizer is made, on the client or the shard.
_RANGES: dict[str, tuple[float, bool, float]] = {
    "learning_rate": (0.0, True, math.inf),
    "momentum": (0.0, True, math.inf),
    "initial_accumulator_value": (0.0, False, math.inf),
    "beta1": (0.0, True, 1.0),
    "beta2": (0.0, True, 1.0),
    "epsilon": (0.0, True, math.inf),
}


@dataclass(frozen=True)
class Optimizer:
    """Base: ``update`` changes ``param`` rows in place from ``grad`` rows and their slots."""

    kind: ClassVar[str] = ""
    slot_names: ClassVar[tuple[str, ...]] = ()
    # whether ``update`` reads each row's step: only then does a part keep the counts (8 bytes a
    # row: as much as the values of a 1-D float64 variable, twice a float32 one's, and a pass over
    # them on every push)
    uses_step: ClassVar[bool] = False
    learning_rate: float = 0.01

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise InvalidArgument(f"{self.kind} optimizer: {f.name} must be a bool, got {value!r}")
                continue
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidArgument(f"{self.kind} optimizer: {f.name} must be a finite number, got {value!r}")
            low, closed, high = _RANGES.get(f.name, (-math.inf, True, math.inf))
            if not ((value >= low if closed else value > low) and value < high):
                want = f"{'>=' if closed else '>'} {low:g}" + (f" and < {high:g}" if high < math.inf else "")
                raise InvalidArgument(f"{self.kind} optimizer: {f.name} must be {want}, got {value!r}")

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    def at(self, learning_rate: float | None) -> "Optimizer":
        """This optimizer with ``learning_rate`` (itself for None or its own): what one push that
        carries a rate applies. Made once per rate and kept, so a schedule costs a lookup a push."""
        if learning_rate is None or learning_rate == self.learning_rate:
            return self
        return _at(self, float(learning_rate))

    def slot_init(self, name: str) -> float:
        return 0.0

    def update(self, param: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], t: np.ndarray | None) -> np.ndarray:
        """New rows for ``param``; ``slots`` are updated in place; ``t`` is each row's step (from 1),
        None for an optimizer that does not use it."""
        raise NotImplementedError

    def apply(self, param: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray],
              t: np.ndarray | None) -> np.ndarray:
        """``update`` as a shard runs it, on slots made by :func:`slot_dtype`'s rule: a float32 or
        float64 ``param`` is updated as it is (the same call, the same bits); a half-precision one
        is widened to its slots' float32 (copies of the request's rows, which the C loops then
        take: one dtype throughout), updated there and rounded back into ``param`` once."""
        if param.dtype in _AS_IS:  # the common case first, without the rule's lookup (a push's few us)
            return self.update(param, grad, slots, t)
        wide = slot_dtype(param.dtype)
        if wide == param.dtype:
            return self.update(param, grad, slots, t)
        param[...] = self.update(param.astype(wide), grad.astype(wide), slots, t)
        return param


@functools.lru_cache(maxsize=256)
def _at(opt: Optimizer, learning_rate: float) -> Optimizer:
    return replace(opt, learning_rate=learning_rate)  # checked as any new optimizer is


@dataclass(frozen=True)
class SGD(Optimizer):
    kind: ClassVar[str] = "sgd"

    def update(self, param, grad, slots, t):
        if self.learning_rate == 1.0:
            param -= grad
        else:  # fused, or one temporary of the chunk's size at most (the request's rows), never of the part
            _sub_scaled(param, grad, self.learning_rate)
        return param


@dataclass(frozen=True)
class Momentum(Optimizer):
    kind: ClassVar[str] = "momentum"
    slot_names: ClassVar[tuple[str, ...]] = ("momentum",)
    momentum: float = 0.9
    nesterov: bool = False

    def update(self, param, grad, slots, t):
        m = slots["momentum"]
        if _kernels.momentum_step(param, grad, m, self.learning_rate, self.momentum, self.nesterov):
            return param
        m *= self.momentum
        m += grad
        if self.nesterov:
            tmp = _scaled(m, self.momentum, param.dtype)
            tmp += grad
            _sub_scaled(param, tmp, self.learning_rate)
        else:
            _sub_scaled(param, m, self.learning_rate)
        return param


@dataclass(frozen=True)
class Adagrad(Optimizer):
    kind: ClassVar[str] = "adagrad"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulator",)
    initial_accumulator_value: float = 0.1

    def slot_init(self, name: str) -> float:
        return self.initial_accumulator_value

    def update(self, param, grad, slots, t):
        acc = slots["accumulator"]
        if _kernels.adagrad_step(param, grad, acc, self.learning_rate):
            return param
        tmp = np.multiply(grad, grad, dtype=acc.dtype)
        acc += tmp
        np.sqrt(acc, out=tmp)
        np.divide(grad, tmp, out=tmp)
        tmp *= self.learning_rate
        param -= tmp
        return param


@dataclass(frozen=True)
class Adam(Optimizer):
    kind: ClassVar[str] = "adam"
    slot_names: ClassVar[tuple[str, ...]] = ("m", "v")
    uses_step: ClassVar[bool] = True
    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def update(self, param, grad, slots, t):
        m, v = slots["m"], slots["v"]
        lr_t = self.learning_rate * _bias(self.beta1, self.beta2, t).reshape((-1,) + (1,) * (param.ndim - 1))
        if _kernels.adam_step(param, grad, m, v, self.beta1, self.beta2, self.epsilon, lr_t.reshape(-1)):
            return param
        # numpy's way, in place, with one scratch array of the chunk's size: no full-size temporaries
        tmp = _scaled(grad, 1 - self.beta1, m.dtype)
        m *= self.beta1
        m += tmp
        np.multiply(grad, grad, out=tmp)
        tmp *= 1 - self.beta2
        v *= self.beta2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp += self.epsilon
        np.divide(m, tmp, out=tmp)
        tmp *= lr_t.astype(tmp.dtype)
        param -= tmp.astype(param.dtype, copy=False)
        return param


# Adam's bias correction for the first steps, looked up, not computed, on every push: the
# formula's seven numpy calls cost a small variable's push more than its update (13 us against 2).
_BIAS_STEPS = 1 << 16


@functools.lru_cache(maxsize=8)
def bias_table(beta1: float, beta2: float) -> np.ndarray:
    """``_bias`` of steps 0..``_BIAS_STEPS``-1 (step 0, never used, is NaN), computed element
    by element as the formula is: a looked-up value has the bits a computed one would."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return _bias_of(beta1, beta2, np.arange(_BIAS_STEPS, dtype=np.float64))


def _bias_of(beta1: float, beta2: float, t: np.ndarray) -> np.ndarray:
    return np.sqrt(1 - beta2**t) / (1 - beta1**t)


def _bias(beta1: float, beta2: float, t: np.ndarray) -> np.ndarray:
    """Adam's ``sqrt(1 - beta2**t) / (1 - beta1**t)`` for each row's step count ``t`` (from 1)."""
    try:
        return bias_table(beta1, beta2).take(t)
    except IndexError:  # a row past the table's steps
        return _bias_of(beta1, beta2, t.astype(np.float64))


# Replicas one synchronous step may wait for: far past any cluster's workers. A step keeps each
# replica's gradient until the last arrives, so the count bounds what a step can hold.
MAX_REPLICAS = 1 << 16


@dataclass(frozen=True)
class SyncReplicas:
    """Synchronous replicas, as TF's SyncReplicasOptimizer: the mean of ``replicas_to_aggregate``
    gradients per global step is applied with ``optimizer``; stale gradients are dropped."""

    optimizer: Optimizer = field(default_factory=SGD)
    replicas_to_aggregate: int = 1
    total_num_replicas: int | None = None
    # When a replica that pushed before is gone (its connection dropped), finish the step with the
    # gradients of the live ones instead of failing the others with DeadlineExceeded.
    drop_dead_replicas: bool = False

    def __post_init__(self) -> None:
        _count(self.replicas_to_aggregate, "replicas_to_aggregate")
        if self.total_num_replicas is not None:
            _count(self.total_num_replicas, "total_num_replicas")
        for what in ("replicas_to_aggregate", "total_num_replicas"):  # a step holds one gradient per replica
            if (n := getattr(self, what)) is not None and n > MAX_REPLICAS:
                raise InvalidArgument(f"SyncReplicas: {what} {n} is over the limit of {MAX_REPLICAS}")
        if self.replicas_to_aggregate < 1:
            raise InvalidArgument(f"replicas_to_aggregate must be >= 1, got {self.replicas_to_aggregate}")
        total = self.total_num_replicas
        if total is not None and total < self.replicas_to_aggregate:
            raise InvalidArgument(f"total_num_replicas {total} < replicas_to_aggregate {self.replicas_to_aggregate}")

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "sync_replicas",
            "optimizer": self.optimizer.spec(),
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "total_num_replicas": self.total_num_replicas,
            "drop_dead_replicas": self.drop_dead_replicas,
        }


def check_dtype(opt: "Optimizer | SyncReplicas | None", dtype: Any, label: str) -> None:
    """Refuse an optimizer on a variable that is not floating point, as TF does: its update makes
    fractional values an integer or bool variable cannot hold, so a push would fail halfway. Checked
    on metadata when a variable or part is declared, never on a push."""
    if opt is None:
        return
    dt = np.dtype(dtype)
    if dt.kind == "f" or half_precision(dt):
        return
    inner = opt.optimizer if isinstance(opt, SyncReplicas) else opt
    raise InvalidArgument(f"variable {label} is {dt}: the {inner.kind} optimizer updates floating-point variables "
                          "only (float16, bfloat16, float32, float64)")


_WIDE = np.dtype(np.float32)
_AS_IS = frozenset((_WIDE, np.dtype(np.float64)))  # dtypes whose slots are their own (the rule's answer, known)


def slot_dtype(dtype: Any) -> np.dtype:
    """The dtype of the optimizer slots of a variable or table of ``dtype``: float32 for float16
    and bfloat16 (optimizer state kept in float32, as mixed-precision training does: see the module
    docstring for what half-precision slots do), the variable's own dtype otherwise."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    return _WIDE if half_precision(dt) else dt  # answered from half_precision's cache: it runs on every push


def held_itemsize(opt: "Optimizer | SyncReplicas | None", dtype: Any) -> int:
    """Bytes a shard holds per element of a variable of ``dtype`` under ``opt``: its value and
    each optimizer slot, in :func:`slot_dtype` (step counts are per row, counted apart)."""
    inner = opt.optimizer if isinstance(opt, SyncReplicas) else opt
    dt = np.dtype(dtype)
    return dt.itemsize + (len(inner.slot_names) * slot_dtype(dt).itemsize if inner is not None else 0)


def restorable_slot(dtype: Any, saved: Any) -> bool:
    """Whether a saved slot of dtype ``saved`` restores into a variable of ``dtype``: the slot
    dtype of today, or the variable's own dtype (checkpoints written when half-precision slots
    were kept in the variable's dtype: widened to float32 on restore, exactly)."""
    dt, got = np.dtype(dtype), np.dtype(saved)
    return got == slot_dtype(dt) or got == dt


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"SyncReplicas: {name} must be an integer, got {value!r}")
    return value


_CLASSES: dict[str, type[Optimizer]] = {c.kind: c for c in (SGD, Momentum, Adagrad, Adam)}


def from_spec(spec: Any) -> Optimizer | SyncReplicas | None:
    """Rebuild an optimizer from its spec (None stays None: plain assign_add of the gradient)."""
    if spec is None or isinstance(spec, (Optimizer, SyncReplicas)):
        return spec
    if not isinstance(spec, dict):
        raise InvalidArgument(f"optimizer spec must be a map, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind == "sync_replicas":
        inner = from_spec(spec.get("optimizer"))
        if not isinstance(inner, Optimizer):
            raise InvalidArgument("SyncReplicas needs an optimizer to wrap")
        return SyncReplicas(inner, _count(spec.get("replicas_to_aggregate", 1), "replicas_to_aggregate"),
                            None if spec.get("total_num_replicas") is None else _count(spec["total_num_replicas"], "total_num_replicas"),
                            bool(spec.get("drop_dead_replicas", False)))
    cls = _CLASSES.get(kind) if isinstance(kind, str) else None  # a map or list as kind is no name (unhashable)
    if cls is None:
        raise InvalidArgument(f"unknown optimizer {kind!r}; known: {', '.join(sorted(_CLASSES))}, sync_replicas")
    values = {}
    for f in fields(cls):
        if f.name not in spec:
            continue
        value = spec[f.name]
        if isinstance(f.default, bool):
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise InvalidArgument(f"{kind} optimizer: {f.name} must be a {type(f.default).__name__}, got {value!r}")
        values[f.name] = value
    return cls(**values)
