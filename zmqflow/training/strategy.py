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
from ..state.store import ShardStore
from ..wire.dtypes import dtype_name
from .context import TrainingContext

__all__ = ["LocalParams", "LocalStrategy", "Strategy"]


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

    def load(self, saved: dict[str, dict[str, np.ndarray]]) -> None:
        """Values, optimizer slots and step counts from a replica checkpoint. The assignment casts:
        a half-precision parameter's float32 slots take the half-precision slots of a checkpoint
        written when they were kept in the parameter's dtype, widened exactly."""
        for name in self.names:
            got = saved.get(name)
            if got is None:
                continue
            p = self.store.get(name)
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


class LocalStrategy(Strategy):
    """One process, no cluster: the reference every other strategy must agree with."""

    name = "local"

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        self.local = LocalParams()
        self.local.create(params, optimizer)
        self.step = 0
        if restore:
            self.step, saved = _ckpt.restore_store(restore)
            self.local.load(saved)
        return self.step

    def save(self, directory: str, step: int, keep: int) -> str:
        return _ckpt.save_store(self.local.store, directory, step, keep)

    def params(self) -> dict[str, np.ndarray]:
        return self.local.params()

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        self.local.apply(grads)
        self.step += 1
        return self.step
