"""How gradients are combined: the strategy interface, and the local one every other must agree with.

A strategy is bound to a :class:`~.context.TrainingContext` (never to the monitored session that
builds it) and answers three questions: how parameters are created (the chief initializes, the
others wait), how a worker reads them, and how a gradient is applied. The training script is the
same for every strategy; the cluster strategies live in ``parameter_server`` and
``ring_allreduce``; :class:`LocalParams` is the in-process replica they and the local one share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..client import checkpoint as _ckpt
from ..cluster import TaskId
from ..errors import ConfigError
from ..state.store import ShardStore
from ..wire.dtypes import dtype_from_name, dtype_name
from .context import TrainingContext

__all__ = ["LocalParams", "LocalStrategy", "Strategy", "refuse_other_model"]


class Strategy:
    """The interface every strategy implements. ``ctx`` is what it may read of the run, and the
    run state it reports back (the step after a restore, recovery, the chief's duties)."""

    name = "strategy"
    ctx: TrainingContext

    def bind(self, ctx: TrainingContext) -> None:
        """Called once, before ``create``, by the monitored session that owns ``ctx``."""
        self.ctx = ctx

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        """Create (chief) or find (others) the parameters, from the checkpoint ``restore`` when the
        chief has one; returns the starting global step."""
        raise NotImplementedError

    def save(self, directory: str, step: int, keep: int) -> str:
        """Write a checkpoint (called on the chief only)."""
        raise NotImplementedError

    def needs(self) -> list[TaskId]:
        """The tasks that must answer before ``create``: not the whole cluster, so a worker that
        restarts after others have finished can still rejoin."""
        return []

    def params(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        """Apply one step's gradients; returns the new global step."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalParams:
    """Parameters held in this process, updated by the same optimizer code the shards run."""

    def __init__(self) -> None:
        self.store = ShardStore()
        self.names: list[str] = []

    def create(self, params: dict[str, np.ndarray], optimizer: Any) -> None:
        spec = None if optimizer is None else optimizer.spec()
        for name, value in params.items():
            value = np.asarray(value)
            rows = value.shape[0] if value.ndim else 1
            self.store.create(name, 0, list(value.shape), [0, rows], dtype_name(value.dtype), optimizer=spec, value=value)
            self.names.append(name)

    def params(self) -> dict[str, np.ndarray]:
        return {n: self.store.read(n) for n in self.names}

    def load(self, saved: dict[str, dict[str, np.ndarray]], path: str = "checkpoint") -> None:
        """Values, optimizer slots and step counts from a replica checkpoint, all checked first
        (:func:`refuse_other_model`). The assignment casts: a half-precision parameter's float32
        slots take the half-precision slots of a checkpoint written when they were kept in the
        parameter's dtype, widened exactly."""
        held = {n: self.store.get(n) for n in self.names}
        found = {n: (got["value"].shape, got["value"].dtype) for n, got in saved.items() if "value" in got}
        refuse_other_model({n: (p.full_shape, p.dtype) for n, p in held.items()}, found, path)
        for name, p in held.items():
            got = saved[name]
            for k, s in p.slots.items():
                if f"slot.{k}" in got and got[f"slot.{k}"].shape != s.shape:
                    raise ConfigError(f"checkpoint {path!r}: slot {k!r} of {name!r} has shape "
                                      f"{list(got[f'slot.{k}'].shape)}, expected {list(s.shape)}")
            if p.steps is not None and "steps" in got and got["steps"].shape != p.steps.shape:
                raise ConfigError(f"checkpoint {path!r}: the step counts of {name!r} have shape "
                                  f"{list(got['steps'].shape)}, expected {list(p.steps.shape)}")
        for name, p in held.items():
            got = saved[name]
            p.value[...] = got["value"]
            for k in p.slots:
                if f"slot.{k}" in got:
                    p.slots[k][...] = got[f"slot.{k}"]
            if p.steps is not None and "steps" in got:
                p.steps[...] = got["steps"]

    def apply(self, grads: dict[str, np.ndarray]) -> None:
        """Every gradient is checked before any is applied: a bad one leaves no half-applied step."""
        checked = [self.store.rows(name, 0, None, None, np.asarray(g, dtype=self.store.get(name).dtype), "gradient")
                   for name, g in grads.items()]
        for rows in checked:
            self.store.apply(rows)


def refuse_other_model(model: dict[str, tuple[Any, Any]], saved: dict[str, tuple[Any, Any]], path: str) -> None:
    """Refuse, before anything is restored, a checkpoint written for another model: one that lacks
    a parameter of ``model``, or holds it in another shape or dtype (numpy would broadcast or cast
    it in silence). ``model`` and ``saved`` map names to (shape, dtype). Names the checkpoint holds
    beyond the model's are left alone, as TF's Saver leaves them."""
    for name, (shape, dtype) in model.items():
        if name not in saved:
            held = ", ".join(repr(n) for n in sorted(saved)[:8]) + (", ..." if len(saved) > 8 else "")
            raise ConfigError(f"checkpoint {path!r} holds no parameter {name!r} (it holds {held}): it was written "
                              "for another model; train into another checkpoint_dir, or restore it by hand")
        then_shape, then_dtype = saved[name]
        now, then = (list(shape), _named(dtype)), (list(then_shape), _named(then_dtype))
        if now != then:
            raise ConfigError(f"parameter {name!r} is {now[1]} {now[0]} in the model but {then[1]} {then[0]} in "
                              f"checkpoint {path!r}: it was written for another model")


def _named(dtype: Any) -> str:
    return dtype_name(dtype_from_name(dtype) if isinstance(dtype, str) else np.dtype(dtype))


class LocalStrategy(Strategy):
    """One process, no cluster: the reference every other strategy must agree with."""

    name = "local"

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        self.local = LocalParams()
        self.local.create(params, optimizer)
        self.step = 0
        if restore:
            self.step, saved = _ckpt.restore_store(restore)
            self.local.load(saved, restore)
        return self.step

    def save(self, directory: str, step: int, keep: int) -> str:
        return _ckpt.save_store(self.local.store, directory, step, keep)

    def params(self) -> dict[str, np.ndarray]:
        return self.local.params()

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        self.local.apply(grads)
        self.step += 1
        return self.step
