"""``MonitoredTrainingSession``: one training loop for one process, a local cluster or a real one.

It finds its cluster and task the way ``zmqflow launch`` sets them (``ZMQFLOW_CLUSTER`` and
``ZMQFLOW_TASK``, then ``TF_CONFIG``), hosts this task's server in-process, lets the chief create
the parameters while the others wait for them, and runs the hooks around every step. Without a
cluster it trains locally with the same script.

A chief or worker says hello to the ps tasks when it opens and goodbye when it closes (finished
unless the ``with`` block ended on an exception), so a ps under ``--exit-when-done`` exits once
training is over. A stop request on its own server (``zmqflow stop``) makes ``should_stop()``
true: the loop ends at its next check. As TF's ``MonitoredSession``, only a clean exit writes the
last checkpoint and runs the hooks' ``end``: after a failure the state may hold half a step.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..client import checkpoint, checkpoint_watch
from ..client.blocking import Session
from ..client.presence import Presence
from ..client.ring import default_members
from ..cluster import ClusterSpec, TaskId, resolve
from ..errors import ConfigError, InvalidArgument
from ..observe import progress
from ..server.task import Server
from ..slurm import is_slurm
from .context import TrainingContext
from .hooks import Hook, ProgressHook, StopAtStep
from .parameter_server import ParameterServerStrategy
from .ring_allreduce import RingAllReduceStrategy
from .strategy import LocalStrategy, Strategy

__all__ = ["MonitoredTrainingSession", "scalar_metrics"]


class MonitoredTrainingSession:
    """Runs one training loop: builds the :class:`TrainingContext` its strategy works on, and
    runs the hooks and the checkpoints around each step."""

    def __init__(
        self,
        strategy: Strategy | None = None,
        cluster: ClusterSpec | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        task: TaskId | str | None = None,
        checkpoint_dir: str | None = None,
        hooks: Iterable[Hook] = (),
        *,
        server: Server | None = None,
        wait_timeout: float = 120.0,
        progress: bool = True,
        save_checkpoint_steps: int | None = None,
        save_checkpoint_secs: float | None = None,
        keep_checkpoints: int = 5,
    ):
        if checkpoint_dir and save_checkpoint_steps is None and save_checkpoint_secs is None:
            save_checkpoint_secs = 600.0  # TF's default cadence
        self.save_checkpoint_steps = save_checkpoint_steps
        self.save_checkpoint_secs = save_checkpoint_secs
        self.keep_checkpoints = keep_checkpoints
        self._saved_at = time.monotonic()
        self._save_anchor = 0  # the step ``create`` started from: step-based saving counts from it until a save
        self._own_server = server is None
        spec, me = _placement(cluster, task, server)
        if spec is None:
            self.strategy = strategy or LocalStrategy()
            if not isinstance(self.strategy, LocalStrategy):
                raise ConfigError(f"strategy {self.strategy.name!r} needs a cluster: pass cluster= and task=, or run under zmqflow launch")
            self.ctx = TrainingContext(wait_timeout=wait_timeout, checkpoint_dir=checkpoint_dir)
        else:
            assert me is not None, "resolve() requires a task"
            if strategy is None:
                strategy = ParameterServerStrategy() if spec.num_tasks("ps") else RingAllReduceStrategy()
            self.strategy = strategy
            server = server or Server(spec, me)
            members = default_members(spec)
            self.ctx = TrainingContext(spec=spec, task=me, server=server, session=Session(server.target, name=str(me)),
                                       chief_task=members[0] if members else None, members=members,
                                       wait_timeout=wait_timeout, checkpoint_dir=checkpoint_dir)
        self._presence: Presence | None = None
        if spec is not None and me is not None and self.ctx.session is not None:
            self._presence = Presence(self.ctx.session, spec, me)
            self._presence.hello()
            if self._own_server:
                server.on_stop_request(lambda _reason: self.request_stop())
        self.hooks: list[Hook] = list(hooks)
        if progress and (self.task is None or self.task == self.chief_task) and any(isinstance(h, StopAtStep) for h in self.hooks):
            self.hooks.append(ProgressHook())
        self.comm_seconds = 0.0
        self.steps_done = 0
        self._started = time.perf_counter()
        self._created = False
        self._stop_requested = False
        self.strategy.bind(self.ctx)

    # identity: read from the context the strategy shares ----------------------------------
    @property
    def spec(self) -> ClusterSpec | None:
        """The cluster (None when training locally)."""
        return self.ctx.spec

    @property
    def task(self) -> TaskId | None:
        """This process's task (None when training locally)."""
        return self.ctx.task

    @property
    def server(self) -> Server | None:
        return self.ctx.server

    @property
    def session(self) -> Session | None:
        return self.ctx.session

    @property
    def chief_task(self) -> TaskId | None:
        """The configured chief (``is_chief`` says who holds its duties now)."""
        return self.ctx.chief_task

    @property
    def checkpoint_dir(self) -> str | None:
        return self.ctx.checkpoint_dir

    @property
    def wait_timeout(self) -> float:
        return self.ctx.wait_timeout

    @property
    def num_workers(self) -> int:
        return self.ctx.num_workers

    @property
    def worker_index(self) -> int:
        return self.ctx.worker_index

    @property
    def task_name(self) -> str:
        return self.ctx.task_name

    @property
    def step(self) -> int:
        """The global step after the last ``apply`` (or the one ``create`` started from)."""
        return self.ctx.step

    @property
    def recovering(self) -> bool:
        """True while a lost ps shard or ring rank is being recovered."""
        return self.ctx.recovering

    @property
    def restored_from(self) -> str | None:
        """The checkpoint ``create`` restored from (None: a fresh start, or live state was found)."""
        return self.ctx.restored_from

    @property
    def is_chief(self) -> bool:
        """Whether this task holds the chief's duties now (create, checkpoint, recover): the
        configured chief, or the member its strategy elected when the chief is gone."""
        return self.ctx.is_chief

    # the loop ---------------------------------------------------------------------------
    def create(self, params: Mapping[str, Any], optimizer: Any = None) -> None:
        """The chief creates the parameters (with ``optimizer``); every other worker waits for them."""
        self.ctx.wait_for(self.strategy.needs(), self.wait_timeout)
        t = time.perf_counter()
        if self.checkpoint_dir and self.is_chief:  # training (again): an evaluator must not stop at an old end
            checkpoint_watch.clear_final(self.checkpoint_dir)
        restore = checkpoint.latest(self.checkpoint_dir) if self.checkpoint_dir and self.is_chief else None
        self.ctx.restored_from = restore  # the strategy clears it when live state made a restore needless
        self.ctx.step = self.strategy.create({k: np.asarray(v) for k, v in params.items()}, optimizer, restore)
        self.comm_seconds += time.perf_counter() - t
        self.ctx.saved_step = self.step if self.restored_from else -1
        self._save_anchor, self._saved_at = self.step, time.monotonic()  # as TF's saver hook: count from here
        self._created = True
        progress.report_progress(step=self.step)
        for hook in self.hooks:
            hook.begin(self)
        self._started = time.perf_counter()

    def params(self) -> dict[str, np.ndarray]:
        self._need_created()
        t = time.perf_counter()
        out = self.strategy.params()
        self.comm_seconds += time.perf_counter() - t
        return out

    def apply(self, grads: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> int:
        """Apply one step's gradients (PS: push, and the parameters on the next ``params``: read back
        with the push when synchronous, else pulled then; ring: allreduce the mean, then the
        optimizer locally). ``metrics`` (scalars) go to the hooks: checked first, so that a
        refused one leaves the step unapplied and the call safe to repeat. Returns the new step."""
        self._need_created()
        shown = scalar_metrics(metrics)
        t = time.perf_counter()
        try:
            self.ctx.step = self.strategy.apply({k: np.asarray(v) for k, v in grads.items()})
        except Exception as exc:
            progress.note_error(exc)
            raise
        self.comm_seconds += time.perf_counter() - t
        self.steps_done += 1
        progress.report_progress(step=self.step)
        # The due save comes before the hooks: the update is applied, so its checkpoint is owed
        # whatever a hook does next (one that raises ends the loop, and must not cost the save);
        # and every hook then sees the step as the session left it, this step's checkpoint
        # included, instead of some hooks seeing the step before its save and others after.
        if self._save_due():
            self.save_checkpoint()
        for hook in self.hooks:
            hook.after_step(self, self.step, shown)
        return self.step

    def _save_due(self) -> bool:
        """Due once the step is ``save_checkpoint_steps`` past the last save (or ``create``), as
        TF's ``SecondOrStepTimer``: the global step jumps (async pushes), so multiples are skipped."""
        saved = self.ctx.saved_step
        if not (self.checkpoint_dir and self.is_chief) or self.step == saved:
            return False
        since = saved if saved >= 0 else self._save_anchor  # a recovery's restore sets saved_step back
        if self.save_checkpoint_steps and self.step >= since + self.save_checkpoint_steps:
            if saved >= 0:
                return True
            # never saved here: a task that took the duties over goes on from the last save of the one before
            newest = checkpoint.latest(self.checkpoint_dir)
            if newest is not None:
                self._save_anchor = max(self._save_anchor, checkpoint_watch.checkpoint_step(newest))
            if self.step >= self._save_anchor + self.save_checkpoint_steps:
                return True
        return bool(self.save_checkpoint_secs) and time.monotonic() - self._saved_at >= self.save_checkpoint_secs

    def save_checkpoint(self) -> str | None:
        """Write a checkpoint now (the chief only; others return None)."""
        if not (self.checkpoint_dir and self.is_chief):
            return None
        path = self.strategy.save(self.checkpoint_dir, self.step, self.keep_checkpoints)
        self.ctx.saved_step, self._saved_at = self.step, time.monotonic()
        return path

    def should_stop(self) -> bool:
        """Whether the loop should end: a hook asked for it (``request_stop``) or answers so now."""
        return self._created and (self._stop_requested or any(h.should_stop(self) for h in self.hooks))

    def request_stop(self) -> None:
        """End the loop at the next ``should_stop()`` (for hooks, and for the script itself)."""
        self._stop_requested = True

    def timings(self) -> dict[str, float]:
        """Wall time since ``create`` split into communication (params, apply) and the rest (compute)."""
        total = time.perf_counter() - self._started
        return {"seconds": total, "communication_s": self.comm_seconds, "compute_s": max(0.0, total - self.comm_seconds),
                "steps": self.steps_done}

    def _need_created(self) -> None:
        if not self._created:
            raise RuntimeError("call mon.create(params, optimizer=...) first")

    # lifecycle --------------------------------------------------------------------------
    def close(self, finished: bool = True) -> None:
        """Close the run; ``finished``: training ended cleanly. Raises the first error of the
        steps of :meth:`_close` after running them all, the later ones attached as notes."""
        _raise_first(self._close(finished))

    def _close(self, finished: bool) -> list[Exception]:
        """Save a last checkpoint and end the hooks (on a clean finish only, as TF's
        ``MonitoredSession``: a failed step may be half applied, and would be saved under the last
        good step's number), then leave: strategy, goodbye, session, own server. Each step runs
        even when an earlier one failed, so no server or ring is left behind; returns the errors."""
        errors: list[Exception] = []
        durable = finished
        if finished and self._created:
            durable = _attempt(errors, self._save_final)
            for hook in self.hooks:
                _attempt(errors, hook.end, self)
        _attempt(errors, self.strategy.close)
        if self._presence is not None:  # after the last save: the ps may exit on this goodbye
            _attempt(errors, self._presence.goodbye,
                     durable and self.server is not None and self.server.stop_reason is None)
        if self.session is not None:
            _attempt(errors, self.session.close)
        if self.server is not None and self._own_server:
            _attempt(errors, self.server.stop)
        return errors

    def _save_final(self) -> None:
        """The last checkpoint, marked final so that evaluators stop after it (the chief only)."""
        if not (self.checkpoint_dir and self.is_chief):
            return
        if self.step != self.ctx.saved_step and not _saved_already(self.checkpoint_dir, self.step):
            self.save_checkpoint()
        checkpoint_watch.mark_final(self.checkpoint_dir)

    def __enter__(self) -> MonitoredTrainingSession:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception):  # the training loop failed: ``zmqflow status`` shows why
            progress.note_error(exc)
        errors = self._close(finished=exc_type is None)
        if exc is None:
            _raise_first(errors)
            return
        for error in errors:  # the loop's own error stays the one raised
            exc.add_note(f"closing the training session also failed: {error!r}")


def scalar_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """``metrics`` as floats, for the hooks; InvalidArgument naming the first that is not one
    number (an array of several, a string, None), before anything of the step is done."""
    shown: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        shape = getattr(value, "shape", ())  # numpy, torch, jax: one element, whatever the shape
        try:
            number = value.item() if hasattr(value, "item") and math.prod(shape) == 1 else value
            if isinstance(number, (str, bytes)) or math.prod(shape) != 1:
                raise TypeError
            shown[str(name)] = float(number)
        except (TypeError, ValueError):
            got = f"{type(value).__name__} of shape {tuple(shape)}" if shape else type(value).__name__
            raise InvalidArgument(f"metric {name!r}: expected one number, got {got}", name=str(name)) from None
    return shown


def _attempt(errors: list[Exception], step: Callable[..., object], *args: object) -> bool:
    """Run one cleanup step; its error goes to ``errors`` so that the next steps still run."""
    try:
        step(*args)
    except Exception as exc:
        errors.append(exc)
        return False
    return True


def _raise_first(errors: list[Exception]) -> None:
    """Raise the first error, the later ones attached as notes (none: return)."""
    if not errors:
        return
    for later in errors[1:]:
        errors[0].add_note(f"closing the training session also failed: {later!r}")
    raise errors[0]


def _placement(cluster: ClusterSpec | Mapping[str, Any] | str | os.PathLike[str] | None, task: TaskId | str | None,
               server: Server | None) -> tuple[ClusterSpec | None, TaskId | None]:
    """The cluster and this task: ``server``'s, else from the arguments or the environment;
    (None, None) to train locally."""
    if server is not None:
        return server.spec, server.task
    if cluster is not None or task is not None or _env_has_cluster():
        return resolve(cluster, task)
    return None, None


def _saved_already(directory: str, step: int) -> bool:
    """Whether the newest checkpoint is of ``step``: a chief that took over as the first one left
    (sync training) must not write the same final step again."""
    path = checkpoint.latest(directory)
    return path is not None and os.path.basename(path) == checkpoint.manifest_name(step)


def _env_has_cluster() -> bool:
    return bool(os.environ.get("ZMQFLOW_CLUSTER") or os.environ.get("TF_CONFIG") or is_slurm(os.environ))
