"""Prometheus metrics of a task, kept as plain numbers and turned into series only when scraped.

Recording costs an attribute check when metrics are off (the owner holds ``None`` instead of a
:class:`TaskMetrics`) and a dict lookup and an add when on; values a layer already tracks (the
RPC counters, shard sizes, table rows) are never copied, but read by a probe at scrape time. This
is prometheus-client's custom-collector pattern: no lock or label lookup on the hot path.

Series live on a :class:`MetricsHub`'s own ``CollectorRegistry`` (never the library's global
one), so several hubs in one process (tests) stay apart. Within a hub every server's series carry
``task="ps:0"``, so the private cluster a bridge starts (worker:0 and ps:0 in one process) shows
both tasks on one endpoint. Every label value a peer can choose is capped (:data:`MAX_LABELS`
distinct values, the rest folded into ``"other"``), so no caller can grow the series without bound.
"""

from __future__ import annotations

import os
import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # prometheus-client loads on first scrape: a server that exports nothing does not carry it
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

from ..cluster import env_task_name
from ..version import __version__
from . import stragglers

__all__ = ["Histogram", "TaskMetrics", "ProcessMetrics", "MetricsHub", "HUB", "DEFINITIONS", "MAX_LABELS", "OTHER",
           "LATENCY_BUCKETS", "enable", "disable", "enabled", "for_task", "release", "record_straggler", "set_eval_metric",
           "record_checkpoint", "Sample"]

OTHER = "other"  # the label value the excess over a cap is folded into
MAX_LABELS = 64  # distinct values of one label a task exports (peers, tables, stragglers, eval metrics)
MAX_LABEL_CHARS = 64

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)
RING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

# name (without the prefix) -> (type, help, label names). The one list of what a task exports.
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "messages_total": ("counter", "Messages a task's router received (in) or sent (out), per peer: its routing id "
                       f"less any random suffix (the first {MAX_LABELS} names; the rest are peer=\"other\").",
                       ("task", "peer", "direction")),
    "bytes_total": ("counter", "Bytes of those messages, per peer and direction.", ("task", "peer", "direction")),
    "rpc_problems_total": ("counter", "Requests answered with an error, messages dropped unread, replies "
                           "undeliverable, replies arriving after their call ended.", ("task", "kind")),
    "request_seconds": ("histogram", "Time from a request's arrival to its reply, per registered op.", ("task", "op")),
    "variables": ("gauge", "Variable parts this task's shard holds.", ("task",)),
    "shard_bytes": ("gauge", "Bytes this task's shard holds (values and optimizer slots; tables).", ("task", "kind")),
    "pushes_applied_total": ("counter", "Gradient updates applied to a variable part: each async push per part, "
                             "each completed sync step per part.", ("task", "mode")),
    "stale_gradients_total": ("counter", "Sync gradients dropped: computed at an older step than the shard's.",
                              ("task",)),
    "sync_rounds_total": ("counter", "Sync steps completed on this shard (one per part per step).", ("task",)),
    "sync_missing_total": ("counter", "Sync steps that timed out or completed without a replica: source is the "
                           "shard, task the replica that did not push.", ("source", "task")),
    "global_step": ("gauge", "The highest sync step of this shard's parts.", ("task",)),
    "table_rows": ("gauge", "Rows of a dynamic embedding table on this shard.", ("task", "table")),
    "table_evictions_total": ("counter", "Rows a dynamic table evicted (capacity or age).", ("task", "table")),
    "table_dropped_pushes_total": ("counter", "Gradient rows a dynamic table dropped (ids not admitted or gone).",
                                   ("task", "table")),
    "shard_save_seconds": ("histogram", "Time a shard took to write its checkpoint file.", ("task",)),
    "ring_bytes_total": ("counter", "Bytes this rank put into ring allreduces.", ("task",)),
    "ring_allreduce_seconds": ("histogram", "Time of one ring allreduce call on this rank.", ("task",)),
    "ring_busbw_bytes_per_second": ("gauge", "Bus bandwidth of the last ring allreduce: bytes / seconds "
                                    "* 2(n-1)/n, comparable with nccl-tests' busbw.", ("task",)),
    "checkpoint_seconds": ("histogram", "Time a checkpoint save or restore driven by this process took.",
                           ("task", "kind")),
    "restarts": ("gauge", "Times zmqflow launch restarted this process (ZMQFLOW_RESTART_COUNT).", ("task",)),
    "straggler_total": ("counter", "Times a task was reported as a straggler, by reporter (source).",
                        ("source", "task")),
    "straggler_lag_seconds": ("gauge", "How far behind the last report found the task.", ("source", "task")),
    "eval": ("gauge", "The evaluator's last value of each metric.", ("metric",)),
    "eval_step": ("gauge", "The training step the last evaluation ran at.", ()),
    "build_info": ("gauge", "Always 1; the version label says which zmqflow serves.", ("version",)),
}
PREFIX = "zmqflow_"

Sample = tuple[str, tuple[str, ...], Any]  # (definition name, label values, number or Histogram)


class Histogram:
    """Bucket counts kept as plain ints: ``observe`` is a bisect and two adds, no lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), list(self.counts)):
            total += n
            out.append((bound, float(total)))
        return out


def label(value: bytes | str) -> str:
    """A label value from a peer-chosen name: text, bounded in length."""
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    return text[:MAX_LABEL_CHARS]


_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8,}$")


def peer_label(peer: bytes) -> str:
    """A routing id without its random suffix: ``trainer`` for the session ``trainer-1a2b3c4d``,
    ``worker:0`` for that task's client. With keys a task's routing id is unguessable so that no
    other key holder can take its connection over; the endpoint must not publish it."""
    return _RANDOM_SUFFIX.sub("", label(peer))


class TaskMetrics:
    """One task's series. The RPC server, ring and ps service call the recording methods; a probe
    (set by the task's server) reads the rest at scrape time."""

    def __init__(self, task: str, max_peers: int = MAX_LABELS):
        self.task = task
        self.max_peers = int(max_peers)
        self.by_label: dict[str, list[int]] = {}  # peer name -> [msgs in, bytes in, msgs out, bytes out]
        self.peers: dict[bytes, list[int]] = {}  # routing id -> its name's counts (a cache)
        self.other = [0, 0, 0, 0]  # peers past the cap
        self.latency: dict[tuple[str, str], Histogram] = {}
        self.ring_seconds = Histogram(RING_BUCKETS)
        self.ring_bytes = 0
        self.ring_busbw = 0.0
        self.probe: Callable[[], Iterable[Sample]] | None = None

    def _new_peer(self, peer: bytes) -> list[int]:
        """The counts of a routing id seen first: those of its name (several sessions of one name
        share them), cached per routing id up to a bound; past the caps, ``other``'s."""
        name = peer_label(peer)
        st = self.by_label.get(name)
        if st is None:
            if len(self.by_label) >= self.max_peers:
                return self.other
            st = self.by_label[name] = [0, 0, 0, 0]
        if len(self.peers) < 4 * self.max_peers:
            self.peers[peer] = st
        return st

    def message_in(self, peer: bytes, nbytes: int) -> None:
        st = self.peers.get(peer) or self._new_peer(peer)
        st[0] += 1
        st[1] += nbytes

    def message_out(self, peer: bytes, nbytes: int) -> None:
        st = self.peers.get(peer) or self._new_peer(peer)
        st[2] += 1
        st[3] += nbytes

    def request(self, service: str, op: str, seconds: float) -> None:
        """A registered op's latency (callers pass only ops that bound: the set stays the code's)."""
        key = (service, op)
        h = self.latency.get(key)
        if h is None:
            h = self.latency[key] = Histogram(LATENCY_BUCKETS)
        h.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # Histogram.observe, inlined: once per request
        h.sum += seconds

    def ring_allreduce(self, nbytes: int, seconds: float, ranks: int) -> None:
        self.ring_bytes += nbytes
        self.ring_seconds.observe(seconds)
        if seconds > 0 and ranks > 1:
            self.ring_busbw = nbytes / seconds * 2 * (ranks - 1) / ranks

    def samples(self) -> Iterator[Sample]:
        t = self.task
        for name, st in [*list(self.by_label.items()), (OTHER, self.other)]:
            for i, direction in ((0, "in"), (2, "out")):
                yield "messages_total", (t, name, direction), st[i]
                yield "bytes_total", (t, name, direction), st[i + 1]
        for (service, op), h in list(self.latency.items()):
            yield "request_seconds", (t, f"{service}.{op}"), h
        yield "ring_bytes_total", (t,), self.ring_bytes
        yield "ring_allreduce_seconds", (t,), self.ring_seconds
        yield "ring_busbw_bytes_per_second", (t,), self.ring_busbw
        if self.probe is not None:
            for name, labels, value in self.probe():
                yield name, (t, *labels), value


class ProcessMetrics:
    """What belongs to the process rather than one server: restarts, checkpoints it drove, the
    evaluator's values and straggler reports. Always recorded (the calls are rare)."""

    def __init__(self) -> None:
        self._task: str | None = None  # named on first use: reading the environment parses cluster settings
        self.checkpoints = {"save": Histogram(CHECKPOINT_BUCKETS), "restore": Histogram(CHECKPOINT_BUCKETS)}
        self.stragglers: dict[tuple[str, str], list[float]] = {}  # (source, task) -> [count, last lag]
        self.evals: dict[str, float] = {}
        self.eval_step = 0
        self._lock = threading.Lock()  # reports may come from any thread

    @property
    def task(self) -> str:
        """The process's task: as set by :func:`enable`, else as its environment names it (a pod's
        index, TF_CONFIG, Slurm or ``ZMQFLOW_TASK``), else empty."""
        if self._task is None:
            self._task = env_task_name() or ""
        return self._task

    @task.setter
    def task(self, value: str) -> None:
        self._task = value

    def straggler(self, source: str, task: str, lag_s: float) -> None:
        key = (label(source), label(task))
        with self._lock:
            st = self.stragglers.get(key)
            if st is None:
                if len(self.stragglers) >= MAX_LABELS:
                    key = (OTHER, OTHER)
                st = self.stragglers.setdefault(key, [0, 0.0])
            st[0] += 1
            st[1] = float(lag_s)

    def eval(self, name: str, value: float, step: int) -> None:
        key = label(name)
        with self._lock:
            if key not in self.evals and len(self.evals) >= MAX_LABELS:
                key = OTHER
            self.evals[key] = float(value)
            self.eval_step = int(step)

    def samples(self) -> Iterator[Sample]:
        t = self.task
        for kind, h in self.checkpoints.items():
            yield "checkpoint_seconds", (t, kind), h
        try:
            restarts = int(os.environ.get("ZMQFLOW_RESTART_COUNT", "0"))
        except ValueError:
            restarts = 0
        yield "restarts", (t,), restarts
        with self._lock:
            stragglers, evals, step = list(self.stragglers.items()), list(self.evals.items()), self.eval_step
        for (source, task), (count, lag) in stragglers:
            yield "straggler_total", (source, task), count
            yield "straggler_lag_seconds", (source, task), lag
        for name, value in evals:
            yield "eval", (name,), value
        if evals:
            yield "eval_step", (), step
        yield "build_info", (__version__,), 1


class MetricsHub:
    """A registry and the task recorders it exports: one per process (:data:`HUB`), or one per
    test. Its collector turns the recorders' numbers into metric families at scrape time."""

    def __init__(self) -> None:
        self._registry: CollectorRegistry | None = None
        self.process = ProcessMetrics()
        self._tasks: list[TaskMetrics] = []
        self._lock = threading.Lock()
        self._registry_lock = threading.Lock()  # registering may describe the hub, which takes _lock

    @property
    def registry(self) -> CollectorRegistry:
        """The hub's own registry, made on first use (an endpoint, a test): importing
        prometheus-client costs every process several MB of resident memory."""
        with self._registry_lock:
            if self._registry is None:
                from prometheus_client import CollectorRegistry

                self._registry = CollectorRegistry(auto_describe=False)
                self._registry.register(self)
            return self._registry

    def task(self, name: str, max_peers: int = MAX_LABELS) -> TaskMetrics:
        m = TaskMetrics(name, max_peers)
        with self._lock:
            self._tasks.append(m)
        return m

    def release(self, metrics: TaskMetrics) -> None:
        with self._lock:
            self._tasks = [m for m in self._tasks if m is not metrics]

    def collect(self) -> Iterator[Metric]:
        families = {name: _family(name) for name in DEFINITIONS}
        with self._lock:
            sources = [*self._tasks, self.process]
        for source in sources:
            for name, labels, value in source.samples():
                family = families[name]
                if isinstance(value, Histogram):
                    family.add_metric(list(labels), value.cumulative(), value.sum)  # type: ignore[attr-defined]
                else:
                    family.add_metric(list(labels), value)  # type: ignore[attr-defined]
        yield from families.values()

    def sample_names(self) -> set[str]:
        """Every sample name this hub can export (``_total``, ``_bucket``, ``_count``, ``_sum``)."""
        out = set()
        for name, (kind, _, _) in DEFINITIONS.items():
            full = PREFIX + name
            out |= {f"{full}_bucket", f"{full}_count", f"{full}_sum"} if kind == "histogram" else {full}
        return out


def _family(name: str) -> Metric:
    kind, doc, labels = DEFINITIONS[name]
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
    return cls(PREFIX + name, doc, labels=list(labels))


HUB = MetricsHub()
_enabled = False


def enable(task: str | None = None) -> None:
    """Record from now on: servers started after this get a :class:`TaskMetrics`. ``task`` names
    the process in its process-wide series (else its environment does: see ``ProcessMetrics.task``)."""
    global _enabled
    _enabled = True
    if task is not None:
        HUB.process.task = task


def disable() -> None:
    """Servers started from now on record nothing (those running keep their recorders)."""
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


def for_task(task: str, hub: MetricsHub | None = None) -> TaskMetrics | None:
    """A recorder for a server starting now, or ``None`` when metrics are off (nothing recorded).
    Given a ``hub``, always one on that hub."""
    if hub is not None:
        return hub.task(task)
    return HUB.task(task) if _enabled else None


def release(metrics: TaskMetrics | None, hub: MetricsHub | None = None) -> None:
    """A stopped server's series go (a task restarted in-process starts its counters again)."""
    if metrics is not None:
        (hub or HUB).release(metrics)


def record_straggler(source: str, task: str, lag_s: float) -> None:
    """``source`` found ``task`` ``lag_s`` seconds behind: counts ``zmqflow_straggler_total`` and
    sets ``zmqflow_straggler_lag_seconds`` for the pair."""
    HUB.process.straggler(source, task, lag_s)


def set_eval_metric(name: str, value: float, step: int) -> None:
    """The evaluator's latest ``name`` (``zmqflow_eval{metric=name}``) and the step it ran at
    (``zmqflow_eval_step``)."""
    HUB.process.eval(name, value, step)


def record_checkpoint(kind: str, seconds: float) -> None:
    """A checkpoint ``save`` or ``restore`` this process drove took ``seconds``."""
    h = HUB.process.checkpoints.get(kind)
    if h is not None:
        h.observe(seconds)


# the straggler detectors (sync ps rounds, the ring) report here: Prometheus sees what the log says
stragglers.subscribe(record_straggler)
