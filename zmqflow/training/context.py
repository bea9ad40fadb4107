"""What a strategy may see of the training run, and what it may report back.

:class:`MonitoredTrainingSession` builds one :class:`TrainingContext` and hands it to its
strategy; the strategy never sees the session itself. The fields above the line are the run's
configuration (read them, do not change them); the ones below are the run's state that a strategy
owns the truth of (the global step after a restore, recovery in progress, who holds the chief's
duties) and sets, and the monitored session reads back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..client.blocking import Session
from ..cluster import ClusterSpec, TaskId
from ..rpc.health import wait_for_tasks
from ..server.task import Server

__all__ = ["TrainingContext"]


@dataclass
class TrainingContext:
    """The strategy's view of one training run (local, or one task of a cluster)."""

    # configuration: read only -----------------------------------------------------------
    spec: ClusterSpec | None = None
    """The cluster, or None when training locally in one process."""
    task: TaskId | None = None
    """This process's task (None locally)."""
    server: Server | None = None
    """This task's server: the loop thread and the ring service live on it (None locally)."""
    session: Session | None = None
    """A client session on ``server``: pushes, pulls, variables, checkpoints of the shards."""
    chief_task: TaskId | None = None
    """The configured chief: the first of ``members``; it creates, checkpoints and recovers."""
    members: list[TaskId] = field(default_factory=list)
    """The tasks that train (the chief and the workers), in rank order."""
    wait_timeout: float = 120.0
    """How long to wait for the cluster, and for the chief's parameters, before giving up."""
    checkpoint_dir: str | None = None
    """Where checkpoints go and recovery restores from (None: no checkpoints, no recovery)."""

    # state: the strategy sets these, the monitored session reads them --------------------
    step: int = 0
    """The global step. Strategies set it when it moves outside ``create``/``apply`` (a restore
    rewinds it during a recovery)."""
    saved_step: int = -1
    """The newest step known to be checkpointed: a restore sets it to the restored step, so the
    monitored session does not write that step again."""
    restored_from: str | None = None
    """The checkpoint ``create`` was asked to restore; a strategy clears it when it found live
    state and restored nothing."""
    recovering: bool = False
    """True while this task waits for (or runs) a recovery, for whoever watches the run."""
    acting_chief: TaskId | None = None
    """Who holds the chief's duties now (create, checkpoint, recover). Starts as ``chief_task``;
    strategies that elect another one when the chief dies set it (None: no one, yet)."""

    def __post_init__(self) -> None:
        if self.acting_chief is None:
            self.acting_chief = self.chief_task

    @property
    def is_chief(self) -> bool:
        """Whether this task holds the chief's duties now (always, locally)."""
        return self.task is None or self.task == self.acting_chief

    @property
    def task_name(self) -> str:
        """This task as logs name it."""
        return str(self.task) if self.task is not None else "local"

    @property
    def num_workers(self) -> int:
        """How many tasks train (1 locally)."""
        return len(self.members) if self.spec is not None else 1

    @property
    def worker_index(self) -> int:
        """This task's rank among ``members`` (0 locally, or when it is not a member)."""
        return self.members.index(self.task) if self.task in self.members else 0

    def wait_for(self, tasks: list[TaskId], timeout: float) -> None:
        """Block until ``tasks`` answer (``ClusterNotReady`` naming the missing ones otherwise);
        a no-op locally."""
        if self.server is None or self.spec is None:
            return
        client = self.server.async_server.client
        self.server.loop_thread.call(wait_for_tasks(client, self.spec, timeout, tasks), timeout=timeout + 5)
