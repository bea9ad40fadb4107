"""Every worker keeps a replica; gradients are averaged around a peer ring that re-forms.

The ring is elastic: when a rank dies mid-allreduce the survivors' call fails (``Unavailable``
naming it, within seconds), they agree on a new generation of the live members and adopt the
most advanced replica among them, then carry on; the failed step's gradient is dropped. A rank
that restarts joins through the current leader, which counts it into the next allreduce (one
extra element, in the gradients' last bucket), so every rank re-forms at the same step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..client import checkpoint as _ckpt
from ..client.elastic_ring import ElasticRing, Formation
from ..cluster import TaskId
from ..errors import ClusterNotReady, DeadlineExceeded, Unavailable
from ..observe.progress import note_error
from ..observe import timeline
from .strategy import LocalParams, Strategy

__all__ = ["RingAllReduceStrategy"]

log = logging.getLogger("zmqflow.training")

# What a dead, silent or vanished member looks like to a ring call.
_RING_GONE = (Unavailable, DeadlineExceeded, ClusterNotReady)


class RingAllReduceStrategy(Strategy):
    """Every worker keeps a replica; gradients are averaged around the peer ring and the same
    optimizer is applied locally, so replicas stay identical. At each formation of the ring (the
    first, and every re-form after a death or a rejoin) the holder's replica (the chief's, restored
    or initial, at first; then the most advanced live one) is broadcast to every member."""

    name = "ring"

    def __init__(self, bucket_bytes: int | None = None, *, join_window: float = 10.0, recovery_timeout: float = 300.0):
        self.bucket_bytes = bucket_bytes
        self.join_window = join_window
        self.recovery_timeout = recovery_timeout
        self.elastic: ElasticRing | None = None
        self.formed_at_step = 0
        self.step = 0

    # membership -------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.elastic.generation if self.elastic else 0

    @property
    def members(self) -> list[TaskId]:
        return self.elastic.members if self.elastic else []

    def needs(self) -> list[TaskId]:
        return []  # the rendezvous waits for the members itself, or joins the live ring without the dead

    # creation ---------------------------------------------------------------------------
    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        ctx = self.ctx
        self.local = LocalParams()
        self.local.create(params, optimizer)
        claim = 0 if ctx.task == ctx.chief_task else -1  # the chief's initial values win a first formation
        if restore:
            claim, saved = _ckpt.restore_store(restore)
            self.local.load(saved, restore)
        kwargs = {} if self.bucket_bytes is None else {"bucket_bytes": self.bucket_bytes}
        assert ctx.server is not None, "the ring needs this task's server"
        self.elastic = ElasticRing(ctx.server, ctx.members, join_window=self.join_window,
                                   first_join_window=ctx.wait_timeout, **kwargs)
        self._claim = claim
        formation = self._form(ctx.wait_timeout)
        if restore and formation.holder != str(ctx.task):
            log.warning("%s: the ring's replicas are live (step %d); not restoring %s over them", ctx.task_name,
                        self.step, restore)
            ctx.restored_from = None
        return self.step

    def _form(self, timeout: float) -> Formation:
        """Join the next generation and adopt the holder's replica; again if a member dies meanwhile."""
        assert self.elastic is not None
        deadline = time.monotonic() + timeout
        while True:
            formation = self.elastic.form(self._claim, max(1.0, deadline - time.monotonic()))
            self._hand_over_chief()
            try:
                self._adopt_state(self.elastic.holder_rank)
            except _RING_GONE as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s: ring generation %d failed while sharing state (%s); re-forming", self.ctx.task_name,
                            formation.generation, exc)
                continue
            self.formed_at_step = self.step
            return formation

    def _hand_over_chief(self) -> None:
        """The leader of the current generation holds the chief's duties: checkpoints move to a
        survivor when the chief dies, and back when it rejoins."""
        leader = self.elastic.leader if self.elastic else None
        self.ctx.acting_chief = leader if leader is not None else self.ctx.chief_task

    def _adopt_state(self, root: int) -> None:
        """The holder's values, optimizer slots, per-row steps and step, committed only once all arrived."""
        assert self.elastic is not None and self.elastic.ring is not None
        ring = self.elastic.ring
        if root == ring.rank and self._claim < 0:
            self._restore_latest()  # no member holds a replica: every one started afresh
        step = int(ring.broadcast(np.array([self._claim], np.int64), root=root)[0])
        mine = [a for name in self.local.names for a in _state_arrays(self.local.store.get(name))]
        # one broadcast per dtype, of every array of it end to end, not one ring call per array
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(mine):
            by_dtype.setdefault(a.dtype, []).append(i)
        received: list[tuple[list[int], np.ndarray]] = []
        for dtype, idx in by_dtype.items():
            fused = np.concatenate([mine[i].reshape(-1) for i in idx]) if idx else np.zeros(0, dtype)
            received.append((idx, ring.broadcast(fused, root=root)))
        for idx, fused in received:  # committed only once everything has arrived
            start = 0
            for i in idx:
                mine[i][...] = fused[start:start + mine[i].size].reshape(mine[i].shape)
                start += mine[i].size
        self.step = max(step, 0)
        self._claim = self.step

    def _restore_latest(self) -> None:
        """The holder of a generation where no member holds a replica (each one restarted, the
        last live holder died handing its state over): go on from the newest checkpoint, which
        every member then adopts, rather than from initial values under a step of 0."""
        directory = self.ctx.checkpoint_dir
        path = _ckpt.latest(directory) if directory else None
        if path is None:
            log.warning("%s: no member of ring generation %d holds a replica and %s holds no checkpoint: training "
                        "starts from the initial values", self.ctx.task_name, self.generation,
                        directory or "no checkpoint_dir")
            return
        step, saved = _ckpt.restore_store(path)
        self.local.load(saved, path)
        self._claim = step
        self.ctx.restored_from = path
        log.warning("%s: no member of ring generation %d holds a replica: restored step %d from %s",
                    self.ctx.task_name, self.generation, step, path)

    # training ---------------------------------------------------------------------------
    def save(self, directory: str, step: int, keep: int) -> str:
        return _ckpt.save_store(self.local.store, directory, step, keep)

    def params(self) -> dict[str, np.ndarray]:
        return self.local.params()

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        """Allreduce the mean (plus the leader's count of waiting joiners), apply it locally. A
        failed allreduce re-forms the ring and returns the adopted step, the gradient dropped."""
        assert self.elastic is not None and self.elastic.ring is not None
        names = list(grads)
        arrays = [np.asarray(grads[n]) for n in names]
        size = len(self.elastic.members)
        flag = np.array([self.elastic.joiners() * size], arrays[-1].dtype if arrays else np.float64)
        try:
            reduced = self.elastic.ring.allreduce([*arrays, flag], op="mean")
        except _RING_GONE as exc:
            self._recover(exc)
            return self.step
        self.local.apply(dict(zip(names, reduced[:-1])))
        self.step += 1
        self._claim = self.step
        waiting = int(reduced[-1].reshape(-1)[0])
        if waiting:
            self._reform(f"{waiting} rank(s) waiting to join")
        return self.step

    @timeline.traced("recovery", "re-form")
    def _recover(self, exc: Exception) -> None:
        ctx = self.ctx
        timeline.instant("recovery", "ring member lost", args={"error": str(exc)})
        log.warning("%s: ring generation %d failed (%s); re-forming with the live members", ctx.task_name,
                    self.generation, exc)
        note_error(f"ring generation {self.generation} failed, re-forming: {type(exc).__name__}: {exc}")
        ctx.recovering = True
        try:
            self._reform("recovered")
        finally:
            ctx.recovering = False

    def _reform(self, why: str) -> None:
        started, before = time.monotonic(), self.step
        formation = self._form(self.recovery_timeout)
        log.warning("%s: ring re-formed as generation %d with %s in %.2fs (%s); state of %s at step %d%s",
                    self.ctx.task_name, formation.generation, ", ".join(formation.members), time.monotonic() - started,
                    why, formation.holder, self.step, "" if self.step == before else f" (this replica was at {before})")

    def close(self) -> None:
        if self.elastic is not None:
            self.elastic.close()


def _state_arrays(p: Any) -> list[np.ndarray]:
    """A parameter's replica state in a fixed order: value, slots by name, per-row steps."""
    out = [p.value, *(p.slots[k] for k in sorted(p.slots))]
    return out + ([p.steps] if p.steps is not None else [])
