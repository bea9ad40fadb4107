"""Which training tasks have sessions open on this task, and whether training is over (sans-IO).

TF's ps tasks never exit (``server.join()`` forever, tensorflow/tensorflow#4713). Here a training
session says hello to every ps task when it opens and goodbye when it closes, and a ps started
with ``--exit-when-done`` stops once training is over by this rule, chosen to be safe:

- only the chief and the workers of the cluster spec count; an evaluator (or any other job, or a
  caller that is no task) never holds a ps up and never ends it;
- a task is finished when it said goodbye with ``finished`` (a clean end of training) and no
  session of that task is open: several sessions of one task (threads, a restarted process)
  count together, and a new hello makes the task unfinished again;
- a goodbye without ``finished`` (an exception, a stop) leaves the task unfinished: under
  ``launch --restart on-failure`` it may come back. A task that crashed without any goodbye and
  never comes back holds the ps until the operator runs ``zmqflow stop`` (or sends SIGTERM):
  waiting too long is recoverable, exiting under a live worker is not;
- training is over when every chief and worker task is finished.

The task a session counts for is its caller's identity (the authenticated key's name with keys),
never a field of the message; the session id only tells one task's sessions apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...cluster import ClusterSpec

__all__ = ["SessionLedger", "TRAINING_JOBS"]

TRAINING_JOBS = ("chief", "worker")
MAX_OPEN = 4096  # sessions kept per task: a caller cannot grow this task's memory without bound


@dataclass
class _TaskSessions:
    open: set[str] = field(default_factory=set)
    # sessions opened past MAX_OPEN: not named, but counted, so the task stays unfinished until as
    # many goodbyes of sessions not in ``open`` came (waiting too long beats exiting under one)
    unnamed: int = 0
    finished: bool = False


class SessionLedger:
    """Hellos and goodbyes by task; :attr:`done` once every training task finished."""

    def __init__(self, spec: ClusterSpec):
        self.training = [str(t) for t in spec.tasks if t.job in TRAINING_JOBS]
        self._tasks: dict[str, _TaskSessions] = {}

    def _counted(self, task: str) -> _TaskSessions | None:
        if task not in self.training:
            return None
        return self._tasks.setdefault(task, _TaskSessions())

    def hello(self, task: str, session: str) -> bool:
        """A session of ``task`` opened; False when ``task`` does not count (not chief or worker)."""
        entry = self._counted(task)
        if entry is None:
            return False
        if len(entry.open) < MAX_OPEN:
            entry.open.add(session)
        elif session not in entry.open:
            entry.unnamed += 1
        entry.finished = False
        return True

    def goodbye(self, task: str, session: str, finished: bool) -> bool:
        """A session of ``task`` closed; the task is finished once it said so and none is open."""
        entry = self._counted(task)
        if entry is None:
            return False
        if session in entry.open:
            entry.open.remove(session)
        elif entry.unnamed:
            entry.unnamed -= 1
        if not finished:
            entry.finished = False
        elif not entry.open and not entry.unnamed:
            entry.finished = True
        return True

    @property
    def done(self) -> bool:
        """Every chief and worker task finished (never true for a cluster without any)."""
        return bool(self.training) and not self.waiting()

    def waiting(self) -> list[str]:
        """The training tasks not finished yet, in spec order."""
        return [t for t in self.training if not (t in self._tasks and self._tasks[t].finished)]

    def describe(self) -> dict[str, dict[str, object]]:
        """Per training task: sessions open and whether it finished (for ``status``)."""
        return {t: {"open": len(e.open) + e.unnamed, "finished": e.finished} for t, e in self._tasks.items()}
