"""Parameters on the ps shards, pushed and pulled by every worker, recovered when a shard dies."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..client import checkpoint as _ckpt
from ..client.blocking import Session
from ..client.checkpoint_files import load_manifest
from ..cluster import TaskId, shard_tasks
from ..errors import ConfigError, DeadlineExceeded, NotFound, Recovering, Unavailable
from ..observe.progress import note_error
from ..observe import timeline
from ..state import optim as _optim
from .context import TrainingContext
from .strategy import Strategy, refuse_other_model

__all__ = ["ParameterServerStrategy"]

_STEP = "global_step"
_ONE = np.ones((), np.int64)  # an asynchronous push's count, pushed to the global step beside its gradients
# How long a fence may stay up before the chief takes the restore over (its restorer died).
FENCE_GRACE_S = 15.0
# What a dead or restarted-empty shard looks like to a worker.
_SHARD_GONE = (Unavailable, NotFound, DeadlineExceeded)

log = logging.getLogger("zmqflow.training")


class ParameterServerStrategy(Strategy):
    """Parameters on the ps shards. ``sync=False``: each push applies on arrival (the global step
    counts every worker's updates). ``sync=True``: SyncReplicas over every worker, one step per
    round of gradients, stale ones dropped."""

    def __init__(self, sync: bool = False, partitioner: Any = None, recovery_timeout: float = 300.0):
        self.sync = sync
        self.recovery_timeout = recovery_timeout
        self.partitioner = partitioner
        self.name = "sync-ps" if sync else "ps"

    def bind(self, ctx: TrainingContext) -> None:
        super().bind(ctx)
        self._acting = ctx.chief_task  # who the log last named as holding the chief's duties
        self._joined_live = False  # the chief came back to live parameters: it waits to be counted in a step
        self._ahead: dict[str, np.ndarray] | None = None  # what the last apply read back, for the next params

    @property
    def _sess(self) -> Session:
        assert self.ctx.session is not None, "the ps strategy needs a cluster"
        return self.ctx.session

    def create(self, params: dict[str, np.ndarray], optimizer: Any, restore: str | None = None) -> int:
        if _STEP in params:
            raise ConfigError(f"a parameter may not be named {_STEP!r}: the ps strategy counts its steps in a "
                              "variable of that name", name=_STEP)
        ctx = self.ctx
        sess = self._sess
        opt = optimizer
        if self.sync and optimizer is not None:
            opt = _optim.SyncReplicas(optimizer, replicas_to_aggregate=ctx.num_workers, total_num_replicas=ctx.num_workers,
                                      drop_dead_replicas=True)
        self.names = list(params)
        if ctx.is_chief:
            self._lift_orphaned_fence()
            live = {v["name"] for v in sess.variables()}
            restored = set(live)
            if restore and not (set(self.names) & live):
                records = load_manifest(restore, "checkpoint").get("records", [])
                saved = {r["name"]: (r["shape"], r["dtype"]) for r in records if not r.get("table")}
                refuse_other_model({n: (np.shape(v), np.asarray(v).dtype) for n, v in params.items()}, saved, restore)
                # under a fence, as a recovery restores: a part is made before its sync step and slots
                # are put back, and another worker that found it then read step 0 and pushed on it
                # (the step went ahead without the chief, still restoring); fenced, it waits for all
                _ckpt.recover(sess, restore)
                restored = {v["name"] for v in sess.variables()}
            elif restore:  # a chief that comes back finds live state: it takes its role, restores nothing
                log.warning("%s: parameters are live on the shards; not restoring %s over them", ctx.task_name, restore)
                ctx.restored_from = None
            self._joined_live = bool(set(self.names) & live)
            self._elect_chief()
            for name, value in params.items():
                if name not in restored:
                    sess.variable(name, np.asarray(value), optimizer=opt, partitioner=self.partitioner)
            if _STEP not in restored:
                sess.variable(_STEP, np.zeros((), np.int64))
        self.vars = {n: sess.get(n, timeout=ctx.wait_timeout) for n in self.names}
        self._rate = _same_but_rate(optimizer, {n: v.optimizer for n, v in self.vars.items()}, restore)
        self.step_var = sess.get(_STEP, timeout=ctx.wait_timeout)
        return self._surviving(self._read_step, retry=True)

    def _lift_orphaned_fence(self) -> None:
        """A chief that died mid-recovery left shards fenced: this one restores them again."""
        fenced = _ckpt.fenced(self._sess)
        if fenced:
            self._recover(Recovering(f"{', '.join(fenced)} still fenced by a recovery that did not finish", fenced=True),
                          restore=True)

    def save(self, directory: str, step: int, keep: int) -> str | None:
        """Checkpoint the shards; a shard lost meanwhile is recovered and this checkpoint skipped."""
        try:
            return _ckpt.save(self._sess, directory, step=step, keep=keep)
        except _SHARD_GONE as exc:
            log.warning("%s: checkpoint at step %d not written: %s", self.ctx.task_name, step, exc)
            if not exc.details.get("directory"):  # not the directory's lock held by another writer: a shard
                self._recover(exc)
            return None

    def needs(self) -> list[TaskId]:
        assert self.ctx.spec is not None, "the ps strategy needs a cluster"
        return shard_tasks(self.ctx.spec)

    def params(self) -> dict[str, np.ndarray]:
        """The parameters: those the last synchronous ``apply`` read back with its push, once; else a pull."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return ahead
        return self._surviving(lambda: self._sess.pull(self.names), retry=True)

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        self._ahead = None
        return self._surviving(lambda: self._apply(grads) if self.sync else self._apply_async(grads), retry=False)

    def _apply(self, grads: dict[str, np.ndarray]) -> int:
        """Push ``grads`` and read the parameters back in the same call (``Session.push_pull``: each
        link carries both ways at once where a link binds), kept for the next ``params``: the step
        is the shards' (every replica's push is in), so no other update comes before the next push.
        A read-back that fails after every push was answered leaves the step taken and counted, as a
        push then a failed pull did."""
        sess = self._sess
        try:
            values = sess.push_pull(grads, learning_rate=self._rate)
        except _SHARD_GONE as exc:
            if not exc.details.get("pushed"):
                raise  # the step was not taken: dropped, after a recovery
            values = {}  # taken, and counted below; the read-back failed: ``params`` pulls (or recovers)
        if set(self.names) <= set(values):  # a step that left a parameter out reads it at ``params``
            self._ahead = {n: values[n] for n in self.names}
        self._elect_chief()  # the push heard which replicas this step averaged
        return int(sess.step)

    def _apply_async(self, grads: dict[str, np.ndarray]) -> int:
        """Push ``grads`` and count the step in the same requests (the global step is a plain-add
        variable: its shard adds the push's 1); the push's answer carries the step after its add
        (``Session.push``): one round trip where adding and reading it back took two more.
        ``params`` pulls at the next step's start. Other workers update the shards meanwhile: a
        gradient is as stale as the time from the read it was computed on to its push, and a
        read-back here would be older at the next push, by the hooks, than that pull (under load
        the demo's held-out accuracy fell from at least 0.944 to as low as 0.894 over 14 runs,
        read-back against pull)."""
        counted = self._sess.push({**grads, _STEP: _ONE}, learning_rate=self._rate)
        return int(counted) if counted is not None else int(self.step_var.read())

    # recovery from a lost ps shard -------------------------------------------------------
    def _surviving(self, fn: Any, *, retry: bool) -> Any:
        """Run ``fn``; when a shard is gone (or came back empty, or is being restored), recover.
        A read (``retry``) runs again on the recovered state; a push does not: its gradients were
        computed on a state the restore replaced, so the step is dropped and the restored step
        returned (the loop's next ``params`` reads the restored values)."""
        while True:
            try:
                out = fn()
            except _SHARD_GONE as exc:
                self._recover(exc)
                if not retry:
                    return self.ctx.step
                continue
            return out

    @timeline.traced("recovery", "recover")
    def _recover(self, exc: Exception, restore: bool | None = None) -> None:
        """The chief waits for every shard, restores them all from the latest checkpoint under a
        fence (so they agree on one step and no one trains on half-restored state) and logs the
        steps lost; the other workers wait, visibly (``ctx.recovering``), until the shards answer
        again, then carry on from the restored step. ``Recovering`` means someone else restores
        (or has restored): the chief waits too, unless the fence outlives ``FENCE_GRACE_S``."""
        ctx = self.ctx
        self._ahead = None  # read before the restore
        if restore is None:
            restore = not isinstance(exc, Recovering)
        if ctx.is_chief and restore and not (ctx.checkpoint_dir and _ckpt.latest(ctx.checkpoint_dir)):
            raise Unavailable(f"{ctx.task_name}: a ps shard failed ({exc}) and there is no checkpoint to recover "
                              f"from{'' if ctx.checkpoint_dir else ' (no checkpoint_dir)'}") from exc
        deadline = time.monotonic() + self.recovery_timeout
        if not ctx.recovering:
            if isinstance(exc, Recovering) and not restore:  # someone else restores: no shard failed here
                log.warning("%s: the ps shards are being restored (%s); waiting", ctx.task_name, exc)
            else:
                log.warning("%s: a ps shard failed (%s); recovering", ctx.task_name, exc)
                note_error(f"a ps shard failed, recovering: {type(exc).__name__}: {exc}")
                timeline.instant("recovery", "shard failed", args={"error": str(exc)})
            ctx.recovering = True
        delay = 0.05
        fenced_since = time.monotonic()
        while True:
            try:
                if ctx.is_chief and restore:
                    self._restore_shards(deadline)
                    restore = False
                step = self._reattach(deadline)
                if step == self._reattach(deadline):  # twice the same: no restore ran in between
                    break
            except _SHARD_GONE as again:
                if time.monotonic() > deadline:
                    raise
                if not isinstance(again, Recovering) or not again.details.get("fenced"):
                    fenced_since = time.monotonic()
                    restore = restore or not isinstance(again, Recovering)
                elif time.monotonic() - fenced_since > FENCE_GRACE_S:
                    restore = True  # its restorer is gone: take the restore over
                time.sleep(delay)  # not back yet, or being restored: try again shortly
                delay = min(2 * delay, 1.0)
        ctx.recovering = False
        log.warning("%s: recovered; training resumes at step %d", ctx.task_name, ctx.step)

    def _restore_shards(self, deadline: float) -> None:
        """Restore every shard from the latest checkpoint; the global step goes back to its step,
        which is on disk already (the monitored session must not write it again)."""
        ctx = self.ctx
        assert ctx.checkpoint_dir is not None
        path = _ckpt.latest(ctx.checkpoint_dir)
        assert path is not None, "recover checks for a checkpoint first"
        ctx.wait_for(self.needs(), max(1.0, deadline - time.monotonic()))
        before = ctx.step
        step = _ckpt.recover(self._sess, path)
        log.warning("%s: restored every shard from %s at step %d; %d step(s) lost", ctx.task_name, path, step,
                    max(0, before - step))
        ctx.step = ctx.saved_step = step

    def _reattach(self, deadline: float) -> int:
        """Fresh handles (placements may have changed) and the global step, once the chief has restored."""
        sess = self._sess
        limit = max(1.0, deadline - time.monotonic())
        self.vars = {n: sess.get(n, timeout=limit) for n in self.names}
        self.step_var = sess.get(_STEP, timeout=limit)
        self.ctx.step = self._read_step()
        return self.ctx.step

    def _read_step(self) -> int:
        """The global step: the shards' sync step, or the ``global_step`` variable in async mode."""
        return int(self._sess.global_step()) if self.sync else int(self.step_var.read())

    # who is chief -------------------------------------------------------------------------
    def _elect_chief(self) -> None:
        """Sync training needs a chief to checkpoint and recover. Every push of a step hears which
        replicas that step averaged, so all workers agree on the lowest-index one of them: the
        configured chief while it contributes, the next live worker when it is gone, and the chief
        again from the first step it contributes to after coming back. The choice goes to
        ``ctx.acting_chief``."""
        ctx = self.ctx
        replicas = set(ctx.session.replicas) if self.sync and ctx.session is not None else set()
        if replicas:
            acting = next((t for t in ctx.members if str(t) in replicas), ctx.chief_task)
        else:  # no step heard yet: the chief, unless it came back to live parameters (a survivor acts)
            acting = None if self.sync and self._joined_live else ctx.chief_task
        if acting != self._acting and acting is not None:
            log.warning("%s: %s holds the chief's duties (the last step averaged %s)", ctx.task_name, acting,
                        ", ".join(sorted(replicas)))
            self._acting = acting
        ctx.acting_chief = acting


def _same_but_rate(optimizer: Any, live: dict[str, Any], restore: str | None) -> float | None:
    """The learning rate each push carries: ``optimizer``'s, so a run resumed with a new rate
    trains at it, as the local strategy does, though the variables keep the optimizer they were
    created (or restored) with. Any other difference from theirs (another kind, other momentum)
    is a ConfigError naming the variable: their slots were made for that one."""
    if not isinstance(optimizer, _optim.Optimizer):  # none: a plain add
        return None
    rate = float(optimizer.learning_rate)
    for name, have in live.items():
        if isinstance(have, _optim.SyncReplicas):
            have = have.optimizer
        if have is None or have.at(rate) != optimizer:
            was = "none (a plain add)" if have is None else have.spec()
            where = f"the checkpoint {restore}" if restore else "the shards"
            raise ConfigError(f"variable {name!r} holds optimizer {was} from {where}; this run gives "
                              f"{optimizer.spec()}: only its learning rate may differ", name=name)
    return rate
