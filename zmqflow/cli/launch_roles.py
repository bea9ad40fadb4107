"""What ``zmqflow launch`` does with tasks that are not training: the evaluator.

``--evaluator`` adds ``evaluator:0`` (a free loopback port on ``--host``) to the cluster launch
generates or loads, and the command runs there too, with ``ZMQFLOW_TASK=evaluator:0``
(``zmqflow.train_and_evaluate`` then evaluates each checkpoint instead of training). A cluster
file may name an ``evaluator`` job itself; it is treated the same.

Launch's exit code is the training tasks': an evaluator that fails is reported (and in the
summary) but does not fail the run. When every training task has ended successfully, launch
waits up to ``--evaluator-grace`` seconds for the evaluator to finish the final checkpoint (it
stops by itself once the chief marked training finished), then stops it; when training failed
it is stopped at once (no final checkpoint will come).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable

from ..client.ring import default_members
from ..cluster import NOT_TRAINING, ClusterSpec, TaskId
from ..errors import ConfigError
from ..ports import free_port

__all__ = ["with_evaluator", "is_side_task", "await_side_tasks", "EVALUATOR_GRACE"]

EVALUATOR_GRACE = 120.0  # seconds an evaluator may take over the final checkpoint once training ended


def with_evaluator(spec: ClusterSpec, host: str = "127.0.0.1") -> ClusterSpec:
    """``spec`` with an ``evaluator:0`` task on a free port of ``host``."""
    if spec.num_tasks("evaluator"):
        raise ConfigError("--evaluator: the cluster already has an evaluator job "
                          f"({spec.num_tasks('evaluator')} task(s)); leave out --evaluator")
    if not default_members(spec):
        raise ConfigError("--evaluator: the cluster has no chief or worker to train, so nothing to evaluate")
    jobs = dict(spec.as_dict())
    jobs["evaluator"] = [f"{host}:{free_port(host)}"]
    return ClusterSpec(jobs)


def is_side_task(task: TaskId) -> bool:
    """Whether ``task`` runs beside training (an evaluator): launch's exit code is not its."""
    return task.job in NOT_TRAINING


def await_side_tasks(running: Iterable[tuple[TaskId, "subprocess.Popen[bytes]"]], grace: float,
                     say: Callable[[str], None]) -> None:
    """Wait up to ``grace`` seconds in all for the side tasks still running; say which are then
    stopped (launch's stop ends them)."""
    running = [(t, p) for t, p in running if p.poll() is None]
    if not running:
        return
    say(f"training ended; waiting up to {grace:g}s for {', '.join(str(t) for t, _ in running)} to finish")
    deadline = time.monotonic() + grace
    for task, proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{task} still running {grace:g}s after training ended; stopping it")
