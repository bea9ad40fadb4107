"""Every worker keeps a replica; gradients are averaged around the peer ring."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import checkpoint as _ckpt
from ..cluster import TaskId
from ..ring import Ring, default_members
from .strategy import Strategy, _LocalParams

__all__ = ["RingAllReduceStrategy"]


class RingAllReduceStrategy(Strategy):
    """Every worker keeps a replica; gradients are averaged around the peer ring and the same
    optimizer is applied locally, so replicas stay identical. The chief's initial values are
    broadcast first."""

    name = "ring"

    def __init__(self, bucket_bytes: int | None = None):
        self.bucket_bytes = bucket_bytes

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        mon = self.mon
        kwargs = {} if self.bucket_bytes is None else {"bucket_bytes": self.bucket_bytes}
        self.ring = Ring(mon.server, default_members(mon.spec), **kwargs)
        chief = self.ring.members.index(mon.chief_task)
        self.local = _LocalParams()
        self.local.create(params, optimizer)
        step, saved = _ckpt.restore_store(restore) if restore else (-1, {})
        if restore:
            self.local.load(saved)
        # the chief's replica (restored, or its initial values) becomes everyone's: values, slots, steps
        self.step = int(self.ring.broadcast(np.array([step], np.int64), root=chief)[0])
        for name in self.local.names:
            p = self.local.store.get(name)
            p.value[...] = self.ring.broadcast(p.value.copy(), root=chief)
            if self.step >= 0:
                for k in p.slots:
                    p.slots[k][...] = self.ring.broadcast(p.slots[k].copy(), root=chief)
                if p.steps is not None:
                    p.steps[...] = self.ring.broadcast(p.steps.copy(), root=chief)
        self.step = max(self.step, 0)
        return self.step

    def save(self, directory: str, step: int, keep: int) -> str:
        return _ckpt.save_store(self.local.store, directory, step, keep)

    def needs(self) -> list[TaskId]:
        return default_members(self.mon.spec)

    def params(self) -> dict[str, np.ndarray]:
        return self.local.params()

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        names = list(grads)
        mean = self.ring.allreduce([np.asarray(grads[n]) for n in names], op="mean")
        self.local.apply(dict(zip(names, mean)))
        self.step += 1
        return self.step
