"""How gradients are combined: locally, through parameter-server shards, or around a peer ring.

A strategy is bound to a :class:`MonitoredTrainingSession` and answers three questions: how
parameters are created (the chief initializes, the others wait), how a worker reads them, and
how a gradient is applied. The training script is the same for every strategy.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checkpoint as _ckpt
from .. import optim as _optim
from ..cluster import TaskId
from ..ps.store import ShardStore
from ..errors import DeadlineExceeded, NotFound, Unavailable
from ..services.catalog import shard_tasks
from ..services.health import wait_for_tasks
from ..ring import Ring, default_members
from ..wire.dtypes import dtype_name

if TYPE_CHECKING:
    from .monitored import MonitoredTrainingSession

__all__ = ["Strategy", "LocalStrategy", "ParameterServerStrategy", "RingAllReduceStrategy"]

_STEP = "global_step"
# What a dead or restarted-empty shard looks like to a worker.
_SHARD_GONE = (Unavailable, NotFound, DeadlineExceeded)

log = logging.getLogger("zmqflow.training")


class Strategy:
    name = "strategy"

    def bind(self, mon: "MonitoredTrainingSession") -> None:
        self.mon = mon

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


class _LocalParams:
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
        """Values, optimizer slots and step counts from a replica checkpoint."""
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
        for name, g in grads.items():
            self.store.apply_dense(name, 0, np.asarray(g, dtype=self.store.get(name).dtype))


class LocalStrategy(Strategy):
    """One process, no cluster: the reference every other strategy must agree with."""

    name = "local"

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        self.local = _LocalParams()
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


class ParameterServerStrategy(Strategy):
    """Parameters on the ps shards. ``sync=False``: each push applies on arrival (the global step
    counts every worker's updates). ``sync=True``: SyncReplicas over every worker, one step per
    round of gradients, stale ones dropped."""

    def __init__(self, sync: bool = False, partitioner: Any = None, recovery_timeout: float = 300.0):
        self.sync = sync
        self.recovery_timeout = recovery_timeout
        self.partitioner = partitioner
        self.name = "sync-ps" if sync else "ps"

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        mon = self.mon
        sess = mon.session
        opt = optimizer
        if self.sync and optimizer is not None:
            opt = _optim.SyncReplicas(optimizer, replicas_to_aggregate=mon.num_workers, total_num_replicas=mon.num_workers,
                                      drop_dead_replicas=True)
        self.names = list(params)
        if mon.is_chief:
            live = {v["name"] for v in sess.variables()}
            restored = set(live)
            if restore and not (set(self.names) & live):
                _ckpt.restore(sess, restore)
                restored = {v["name"] for v in sess.variables()}
            elif restore:  # a chief that comes back finds live state: it takes its role, restores nothing
                log.warning("%s: parameters are live on the shards; not restoring %s over them", mon.task_name, restore)
                mon.restored_from = None
            for name, value in params.items():
                if name not in restored:
                    sess.variable(name, np.asarray(value), optimizer=opt, partitioner=self.partitioner)
            if _STEP not in restored:
                sess.variable(_STEP, np.zeros((), np.int64))
        self.vars = {n: sess.get(n, timeout=mon.wait_timeout) for n in self.names}
        self.step_var = sess.get(_STEP, timeout=mon.wait_timeout)
        return int(sess.global_step()) if self.sync else int(self.step_var.read())

    def save(self, directory: str, step: int, keep: int) -> str:
        return _ckpt.save(self.mon.session, directory, step=step, keep=keep)

    def needs(self) -> list[TaskId]:
        return shard_tasks(self.mon.spec)

    def params(self) -> dict[str, np.ndarray]:
        return self._surviving(lambda: self.mon.session.pull(self.names))

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        return self._surviving(lambda: self._apply(grads))

    def _apply(self, grads: dict[str, np.ndarray]) -> int:
        sess = self.mon.session
        if self.sync:
            step = sess.push(grads)
            return int(step if step is not None else sess.step)
        sess.push(grads)
        self.step_var.assign_add(np.ones((), np.int64))
        return int(self.step_var.read())

    def _surviving(self, fn: Any) -> Any:
        """Run ``fn``; when a shard is gone (or came back empty), recover and run it again. The chief
        waits for every shard, restores them all from the latest checkpoint so they agree on one
        step, and logs the steps lost; the other workers wait (``mon.recovering``) until the
        variables are back, then carry on from the restored step."""
        deadline = time.monotonic() + self.recovery_timeout
        delay = 0.05
        while True:
            try:
                out = fn()
            except _SHARD_GONE as exc:
                mon = self.mon
                if time.monotonic() > deadline or (mon.is_chief and not mon.checkpoint_dir):
                    raise
                if not mon.recovering:
                    log.warning("%s: a ps shard failed (%s); recovering", mon.task_name, exc)
                    mon.recovering = True
                try:
                    if mon.is_chief:
                        self._restore_shards(deadline)
                    self._reattach(deadline)
                except _SHARD_GONE:
                    time.sleep(delay)  # the shard is not back yet: try again shortly
                    delay = min(2 * delay, 1.0)
                continue
            if self.mon.recovering:
                self.mon.recovering = False
                log.warning("%s: recovered; training resumes at step %d", self.mon.task_name, self.mon.step)
            return out

    def _restore_shards(self, deadline: float) -> None:
        mon = self.mon
        path = _ckpt.latest(mon.checkpoint_dir)
        if path is None:
            raise Unavailable("a ps shard failed and there is no checkpoint to recover from")
        mon.server.loop_thread.call(
            wait_for_tasks(mon.server.async_server.client, mon.spec, max(1.0, deadline - time.monotonic()),
                           shard_tasks(mon.spec)),
            timeout=max(1.0, deadline - time.monotonic()) + 5,
        )
        before = mon.step
        step = _ckpt.restore(mon.session, path)
        log.warning("%s: restored every shard from %s at step %d; %d step(s) lost", mon.task_name, path, step,
                    max(0, before - step))
        mon.step = step

    def _reattach(self, deadline: float) -> None:
        """Fresh handles (placements may have changed) and the global step, once the chief has restored."""
        mon, sess = self.mon, self.mon.session
        limit = max(1.0, deadline - time.monotonic())
        self.vars = {n: sess.get(n, timeout=limit) for n in self.names}
        self.step_var = sess.get(_STEP, timeout=limit)
        mon.step = int(sess.global_step()) if self.sync else int(self.step_var.read())


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
