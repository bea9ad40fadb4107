"""The evaluator of ``train_and_evaluate``: a task beside training that evaluates each checkpoint.

As TF's, the evaluator (the ``evaluator`` job of the cluster spec or TF_CONFIG) is no part of
training: it is not a rank, no ring or synchronous step counts it, nothing waits for it or
places state on it, and it does not even serve its address. It watches the checkpoint directory
(:func:`zmqflow.checkpoint.checkpoints_iterator`) and restores each new checkpoint, with the
public :func:`zmqflow.checkpoint.restore`, into a private in-process cluster of its own (one ps
task on a loopback port, as the bridge runtime's private cluster): the training shards are
never touched, and the checkpoint's files are read only by the checkpoint API. ``eval_fn`` reads
the restored variables and returns its metrics, which go to the summaries (a JSON-lines file,
and TensorBoard events when tensorboardX is installed) and to monitoring. It stops after the
final checkpoint, which the chief marks when training ends.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..client import checkpoint, checkpoint_watch
from ..client.blocking import Session
from ..client.ring import default_members
from ..cluster import NOT_TRAINING, ClusterSpec, TaskId, resolve
from ..errors import InvalidArgument, NotFound
from ..observe import endpoint, metrics as observed
from ..ports import free_port
from ..server.task import Server
from ..slurm import is_slurm
from ..transport.curve import KEYS_ENV, Keys, generate
from .hooks import metrics_line

__all__ = ["EvalCheckpoint", "Evaluator", "train_and_evaluate", "task_role", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger("zmqflow.evaluate")


@dataclass
class EvalCheckpoint:
    """One checkpoint as ``eval_fn`` sees it: restored into the evaluator's private session."""

    step: int
    path: str
    session: Session

    def params(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The restored variables' values (every dense variable, or ``names``)."""
        if names is None:
            names = [v["name"] for v in self.session.variables() if not v.get("table")]
        return {k: np.asarray(v) for k, v in self.session.pull(list(names)).items()}


@dataclass
class Evaluator:
    """Evaluates every checkpoint of ``checkpoint_dir`` as it lands, until training has finished.

    ``output_dir`` (default ``checkpoint_dir/eval``, TF's place) receives ``metrics.jsonl``, one
    line per checkpoint, and TensorBoard events when tensorboardX is installed."""

    eval_fn: Callable[[EvalCheckpoint], Mapping[str, float]]
    checkpoint_dir: str
    output_dir: str | None = None
    timeout: float | None = None
    timeout_fn: Callable[[], bool] | None = None
    min_interval_secs: float = 0
    poll_secs: float = checkpoint_watch.POLL_SECS
    last_metrics: dict[str, float] | None = field(default=None, init=False)
    last_step: int | None = field(default=None, init=False)
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list, init=False)
    _server: Server | None = field(default=None, init=False, repr=False)
    _session: Session | None = field(default=None, init=False, repr=False)
    _jsonl: Any = field(default=None, init=False, repr=False)
    _tb: Any = field(default=None, init=False, repr=False)
    _keydir: str | None = field(default=None, init=False, repr=False)

    def run(self) -> dict[str, float] | None:
        """The loop: evaluate each new checkpoint; return the last metrics once training ended
        (or the timeout passed). A checkpoint pruned before its turn is skipped."""
        try:
            for path in checkpoint_watch.checkpoints_iterator(
                    self.checkpoint_dir, min_interval_secs=self.min_interval_secs, timeout=self.timeout,
                    timeout_fn=self.timeout_fn, poll_secs=self.poll_secs):
                try:
                    self.evaluate(path)
                except NotFound as exc:  # the chief's pruning took it first: the next one will do
                    log.warning("checkpoint %s gone before it was evaluated: %s", path, exc)
        finally:
            self.close()
        return self.last_metrics

    def evaluate(self, path: str) -> dict[str, float]:
        """Restore the checkpoint at ``path`` privately, run ``eval_fn`` on it, publish its metrics."""
        session = self._private_session()
        step = checkpoint.restore(session, path)
        metrics = self.eval_fn(EvalCheckpoint(step, path, session))
        if not isinstance(metrics, Mapping):
            raise InvalidArgument(f"eval_fn returned {type(metrics).__name__}; expected a mapping of metric name to number")
        shown = {str(k): float(v) for k, v in metrics.items()}
        self.last_metrics, self.last_step = shown, step
        self.history.append((step, shown))
        self._publish(shown, step)
        return shown

    def _publish(self, metrics: dict[str, float], step: int) -> None:
        """The one place evaluation metrics leave the evaluator: the summaries, and Prometheus
        (``zmqflow_eval{metric=...}``, served where ``ZMQFLOW_METRICS_PORT`` names a port)."""
        for name, value in metrics.items():
            observed.set_eval_metric(name, value, step)
        self._open_summaries()
        self._jsonl.write(metrics_line(step, metrics))
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        log.info("evaluated step %d: %s", step, ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()))

    def _open_summaries(self) -> None:
        if self._jsonl is not None:
            return
        directory = self.output_dir or os.path.join(self.checkpoint_dir, "eval")
        os.makedirs(directory, exist_ok=True)
        self._jsonl = open(os.path.join(directory, METRICS_FILE), "a")
        try:
            from tensorboardX import SummaryWriter  # type: ignore[import-not-found]

            self._tb = SummaryWriter(directory)
        except ImportError:
            self._tb = None

    def _private_session(self) -> Session:
        """A one-task cluster in this process, made once: checkpoints are restored here, never
        onto the training shards (a restore there would overwrite what training is doing)."""
        if self._session is None:
            spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}"]})
            if os.environ.get(KEYS_ENV):  # the training cluster's keys (launch --keys) name no task of this one
                self._keydir = tempfile.mkdtemp(prefix="zmqflow-eval-keys-")
                generate(self._keydir, spec)
            self._server = Server(spec, "ps:0", keys=self._keydir)
            # with keys, the session is the task's own (as a task's session is): restores need a task key
            keys = Keys.load(self._keydir, "ps:0", require_task=True) if self._keydir else None
            self._session = Session(self._server.target, keys=keys, name=None if keys else "evaluator")
        return self._session

    def close(self) -> None:
        """Stop the private cluster and close the summaries (``run`` does when it returns)."""
        if self._session is not None:
            self._session.close()
        if self._server is not None:
            self._server.stop()
        for writer in (self._jsonl, self._tb):
            if writer is not None:
                writer.close()
        if self._keydir is not None:
            shutil.rmtree(self._keydir, ignore_errors=True)
        self._session = self._server = self._jsonl = self._tb = self._keydir = None


def task_role(cluster: Any = None, task: "TaskId | str | None" = None) -> str:
    """This process's job: as given, else as ``zmqflow launch``, TF_CONFIG or Slurm name it;
    ``"local"`` without a cluster."""
    if cluster is None and task is None and not (os.environ.get("ZMQFLOW_CLUSTER") or os.environ.get("TF_CONFIG")
                                                 or is_slurm(os.environ)):
        return "local"
    _, me = resolve(cluster, task)
    return me.job if me is not None else "local"


def train_and_evaluate(train_fn: Callable[[], Any], eval_fn: Callable[[EvalCheckpoint], Mapping[str, float]], *,
                       checkpoint_dir: str, cluster: Any = None, task: "TaskId | str | None" = None,
                       output_dir: str | None = None, timeout: float | None = None,
                       timeout_fn: Callable[[], bool] | None = None, min_interval_secs: float = 0,
                       poll_secs: float = checkpoint_watch.POLL_SECS) -> dict[str, float] | None:
    """TF's ``train_and_evaluate`` for zmqflow: on the evaluator task evaluate each checkpoint of
    ``checkpoint_dir`` until training has finished, and return the last metrics; on ps, chief
    and worker tasks run ``train_fn()`` (which trains with ``checkpoint_dir``) and return None.
    Without a cluster, train, then evaluate the checkpoints training left, and return the last
    metrics. ``train_fn`` ending normally on the chief (rank 0) marks training finished (as its
    ``MonitoredTrainingSession`` does on close), naming the newest checkpoint as the final one."""
    if not checkpoint_dir:
        raise InvalidArgument("train_and_evaluate needs checkpoint_dir: the evaluator finds checkpoints there")
    role = task_role(cluster, task)
    evaluator = Evaluator(eval_fn, checkpoint_dir, output_dir=output_dir, timeout=timeout, timeout_fn=timeout_fn,
                          min_interval_secs=min_interval_secs, poll_secs=poll_secs)
    if role in NOT_TRAINING:
        spec, me = resolve(cluster, task)
        served = endpoint.start_for(spec, me) if me is not None else None  # ZMQFLOW_METRICS_PORT: Prometheus sees it
        try:
            return evaluator.run()
        finally:
            if served is not None:
                served.close()
    train_fn()
    if role == "local" or _is_chief(cluster, task):
        checkpoint_watch.mark_final(checkpoint_dir)  # the newest checkpoint is the final one
    if role == "local":
        return evaluator.run()
    return None


def _is_chief(cluster: Any, task: "TaskId | str | None") -> bool:
    """Whether this task is rank 0 (the chief, else worker 0): who checkpoints, so who says training ended."""
    spec, me = resolve(cluster, task)
    members = default_members(spec)
    return bool(members) and me == members[0]
