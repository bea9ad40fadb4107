"""Cluster description: jobs of tasks, their addresses, and how a process finds its own task.

Accepts the two shapes users already have: a plain ``{"job": [addr, ...]}`` map and the
``TF_CONFIG`` shape ``{"cluster": {...}, "task": {"type": ..., "index": ...}}``. Everything is
validated up front so a bad spec fails before any socket is opened, naming the job, the index
and the value at fault.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import slurm as _slurm
from .errors import ConfigError
from .task_id import TaskId

__all__ = ["Address", "TaskId", "ClusterSpec", "KNOWN_ROLES", "resolve", "load_config", "shard_tasks", "catalog_task",
           "holder_tasks", "from_slurm", "task_from_pod", "env_task_name"]

KNOWN_ROLES = ("chief", "worker", "ps", "evaluator")
_JOB_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-\.]*[A-Za-z0-9])?$")


def _is_digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts '²' (which ``int`` refuses) and other scripts' digits."""
    return text.isascii() and text.isdigit()


@dataclass(frozen=True, slots=True)
class Address:
    """One task's endpoint. ``host:port`` means tcp; ``ipc://`` and ``inproc://`` are local."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    @classmethod
    def parse(cls, value: object, where: str = "address") -> "Address":
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: expected an address string like 'host:port', got {value!r}")
        text = value.strip()
        for scheme in ("ipc", "inproc"):
            prefix = scheme + "://"
            if text.startswith(prefix):
                path = text[len(prefix):]
                if not path:
                    raise ConfigError(f"{where}: {value!r} has an empty {scheme} path")
                return cls(scheme, path=path)
        if "://" in text:
            scheme, _, rest = text.partition("://")
            if scheme != "tcp":
                raise ConfigError(f"{where}: unsupported scheme {scheme!r} in {value!r} (tcp, ipc, inproc)")
            text = rest
        host, port = _split_host_port(text, value, where)
        return cls("tcp", host=host, port=port)

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint to connect to."""
        if self.scheme == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp://{host}:{self.port}"
        return f"{self.scheme}://{self.path}"

    def bind_endpoint(self) -> str:
        """The endpoint to bind: host names are resolved so only that interface is exposed."""
        if self.scheme != "tcp":
            return self.endpoint
        host = self.host
        if host not in ("*", "0.0.0.0", "::"):
            try:
                ipaddress.ip_address(host)
            except ValueError:
                try:
                    host = socket.gethostbyname(host)
                except OSError as exc:
                    raise ConfigError(f"cannot resolve host {self.host!r} to bind: {exc}") from None
        if ":" in host:
            return f"tcp://[{host}]:{self.port}"
        return f"tcp://{host}:{self.port}"

    def __str__(self) -> str:
        if self.scheme == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"{host}:{self.port}"
        return self.endpoint


def _split_host_port(text: str, value: object, where: str) -> tuple[str, int]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"{where}: malformed address {value!r}, expected '[v6-host]:port'")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"{where}: malformed address {value!r}, expected 'host:port'")
    if not host or not (host == "*" or _HOST_RE.match(host) or _is_ip(host)):
        raise ConfigError(f"{where}: malformed host {host!r} in {value!r}")
    if not _is_digits(port_text):
        raise ConfigError(f"{where}: malformed port {port_text!r} in {value!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} out of range 1..65535 in {value!r}")
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ClusterSpec:
    """Jobs mapped to their tasks' addresses, validated on construction."""

    __slots__ = ("_jobs",)

    def __init__(self, spec: "Mapping[str, Any] | ClusterSpec"):
        if isinstance(spec, ClusterSpec):
            self._jobs: dict[str, dict[int, Address]] = {j: dict(t) for j, t in spec._jobs.items()}
            return
        if not isinstance(spec, Mapping):
            raise ConfigError(f"cluster spec must be a mapping of job -> addresses, got {type(spec).__name__}")
        if _is_tf_shaped(spec):
            spec = spec["cluster"]
        self._jobs = {}
        seen: dict[Address, TaskId] = {}
        for job, tasks in spec.items():
            if not isinstance(job, str) or not _JOB_RE.match(job):
                raise ConfigError(f"malformed job name {job!r}: letters, digits, '_' and '-', starting with a letter")
            parsed = _parse_tasks(job, tasks)
            for index, addr in parsed.items():
                other = seen.get(addr)
                if other is not None:
                    raise ConfigError(
                        f"duplicate address {addr}: job {job!r} index {index} and job {other.job!r} index {other.index}"
                    )
                seen[addr] = TaskId(job, index)
            self._jobs[job] = parsed
        if not any(self._jobs.values()):
            raise ConfigError("cluster spec has no tasks")

    # construction -----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: "str | os.PathLike[str]") -> "ClusterSpec":
        return cls(_read_json_file(path))

    @classmethod
    def from_json(cls, text: str) -> "ClusterSpec":
        return cls(_loads(text, "cluster JSON"))

    # queries ----------------------------------------------------------------------------
    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    @property
    def tasks(self) -> list[TaskId]:
        return [TaskId(job, i) for job, tasks in self._jobs.items() for i in sorted(tasks)]

    def num_tasks(self, job: str) -> int:
        return len(self._jobs.get(job, {}))

    def task_indices(self, job: str) -> list[int]:
        return sorted(self._jobs.get(job, {}))

    def address(self, task: "TaskId | str") -> Address:
        tid = TaskId.parse(task)
        try:
            return self._jobs[tid.job][tid.index]
        except KeyError:
            raise ConfigError(f"unknown task {tid} (job {tid.job!r} index {tid.index}); cluster has {self.describe()}") from None

    def task_at(self, endpoint: str) -> TaskId | None:
        """The task whose address is ``endpoint`` (either form), or None."""
        for tid in self.tasks:
            addr = self.address(tid)
            if endpoint in (addr.endpoint, str(addr)):
                return tid
        return None

    def __contains__(self, task: object) -> bool:
        try:
            tid = TaskId.parse(task)  # type: ignore[arg-type]
        except ConfigError:
            return False
        return tid.index in self._jobs.get(tid.job, {})

    def __iter__(self) -> Iterator[TaskId]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return sum(len(t) for t in self._jobs.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __hash__(self) -> int:
        return hash(self.to_json())

    def as_dict(self) -> dict[str, list[str] | dict[str, str]]:
        """Plain shape: lists when indices are dense from 0, else ``{"index": addr}`` maps."""
        out: dict[str, list[str] | dict[str, str]] = {}
        for job, tasks in self._jobs.items():
            if sorted(tasks) == list(range(len(tasks))):
                out[job] = [str(tasks[i]) for i in range(len(tasks))]
            else:
                out[job] = {str(i): str(tasks[i]) for i in sorted(tasks)}
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=False)

    def describe(self) -> str:
        return ", ".join(f"{job}: {len(t)}" for job, t in self._jobs.items())

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _parse_tasks(job: str, tasks: object) -> dict[int, Address]:
    if isinstance(tasks, str):
        raise ConfigError(f"job {job!r}: expected a list or an index map of addresses, got the string {tasks!r}")
    if isinstance(tasks, Mapping):
        out: dict[int, Address] = {}
        for key, value in tasks.items():
            valid = (isinstance(key, int) and key >= 0) or (isinstance(key, str) and _is_digits(key))
            if isinstance(key, bool) or not valid:
                raise ConfigError(f"job {job!r}: task index {key!r} is not a non-negative integer")
            index = int(key)
            if index in out:
                raise ConfigError(f"job {job!r}: task index {index} given twice")
            out[index] = Address.parse(value, f"job {job!r} index {index}")
        return out
    if isinstance(tasks, (list, tuple)):
        return {i: Address.parse(v, f"job {job!r} index {i}") for i, v in enumerate(tasks)}
    raise ConfigError(f"job {job!r}: expected a list or an index map of addresses, got {type(tasks).__name__}")


def _is_tf_shaped(data: Mapping[str, Any]) -> bool:
    """``{"cluster": {job: addrs}, "task": ...}``; a plain spec may still have a job named "cluster"."""
    return isinstance(data.get("cluster"), Mapping)


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc}") from None


def _read_json_file(path: "str | os.PathLike[str]") -> Any:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {str(path)!r}: {exc.strerror or exc}") from None
    return _loads(text, f"cluster file {str(path)!r}")


def load_config(value: "str | os.PathLike[str] | Mapping[str, Any] | ClusterSpec") -> tuple[ClusterSpec, TaskId | None]:
    """A cluster and the task it names (TF_CONFIG shape), from a path, inline JSON or a dict."""
    if isinstance(value, ClusterSpec):
        return value, None
    if isinstance(value, Mapping):
        data: Any = value
    elif not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"cluster must be a path, inline JSON, a mapping or a ClusterSpec, got {type(value).__name__}")
    else:
        text = os.fspath(value)
        data = _loads(text, "inline cluster JSON") if text.lstrip().startswith("{") else _read_json_file(text)
    if not isinstance(data, Mapping):
        raise ConfigError(f"cluster spec must be a JSON object, got {type(data).__name__}")
    task = _task_from_tf_config(data.get("task")) if _is_tf_shaped(data) else None
    return ClusterSpec(data), task


def _task_from_tf_config(task: object) -> TaskId | None:
    if task is None:
        return None
    if not isinstance(task, Mapping) or "type" not in task:
        raise ConfigError(f"'task' must look like {{\"type\": \"worker\", \"index\": 0}}, got {task!r}")
    index = task.get("index", 0)
    if isinstance(index, str) and _is_digits(index):
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"'task' index must be a non-negative integer, got {index!r}")
    job = task["type"]
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ConfigError(f"'task' type must be a job name, got {job!r}")
    return TaskId(job, index)


def resolve(
    cluster: "str | os.PathLike[str] | Mapping[str, Any] | ClusterSpec | None" = None,
    task: "str | TaskId | None" = None,
    env: Mapping[str, str] | None = None,
    *,
    require_task: bool = True,
) -> tuple[ClusterSpec, TaskId | None]:
    """Find the cluster and this process's task: flags, then ZMQFLOW_* (ZMQFLOW_TASK, else
    ZMQFLOW_TASK_JOB with the pod's index: :func:`task_from_pod`), then TF_CONFIG, then
    Slurm's variables (:func:`from_slurm`, with ZMQFLOW_SLURM_PS and ZMQFLOW_SLURM_BASE_PORT).
    Slurm comes last so a process ``zmqflow launch`` starts inside a Slurm job follows the
    ZMQFLOW_* it was given, and it is read only when nothing else names a cluster: its task
    is then Slurm's unless a task was named."""
    env = os.environ if env is None else env
    spec: ClusterSpec | None = None
    file_task: TaskId | None = None
    if cluster is not None:
        spec, file_task = load_config(cluster)
    elif env.get("ZMQFLOW_CLUSTER"):
        spec, file_task = load_config(env["ZMQFLOW_CLUSTER"])
    tid: TaskId | None
    if task is not None:
        tid = TaskId.parse(task)
    elif env.get("ZMQFLOW_TASK"):
        tid = TaskId.parse(env["ZMQFLOW_TASK"])
    elif env.get("ZMQFLOW_TASK_JOB"):
        tid = task_from_pod(env)
    else:
        tid = file_task
    tf_config = env.get("TF_CONFIG")
    if tf_config and (spec is None or tid is None):  # read only when it has something to give
        data = _loads(tf_config, "TF_CONFIG")
        if not isinstance(data, Mapping) or not _is_tf_shaped(data):
            raise ConfigError("TF_CONFIG must be a JSON object whose 'cluster' maps jobs to addresses")
        tf_spec, tf_task = load_config(data)
        if spec is None:
            spec = tf_spec
        if tid is None:
            tid = tf_task
    if spec is None and _slurm.is_slurm(env):
        spec, slurm_task = from_slurm(env, ps=_env_int(env, "ZMQFLOW_SLURM_PS", 0),
                                      base_port=_env_int(env, "ZMQFLOW_SLURM_BASE_PORT", 2222))
        if tid is None:
            tid = slurm_task
    if spec is None:
        raise ConfigError("no cluster given: pass --cluster, or set ZMQFLOW_CLUSTER or TF_CONFIG, or run under Slurm")
    if tid is None and require_task:
        raise ConfigError("no task given: pass --task, or set ZMQFLOW_TASK or TF_CONFIG's 'task'")
    if tid is not None and tid not in spec and tid.job not in NOT_TRAINING:  # TF's evaluator may be left out
        if not require_task:  # a tool that only needs the cluster ignores a stray task name
            return spec, None
        raise ConfigError(f"unknown task {tid} (job {tid.job!r} index {tid.index}); cluster has {spec.describe()}")
    return spec, tid


def env_task_name(env: Mapping[str, str] | None = None) -> str | None:
    """This process's task as its environment names it (ZMQFLOW_TASK, a pod's job and index,
    TF_CONFIG's task, Slurm's rank), or None: a process that is a task presents its task key,
    however its task was named. Unreadable settings give None here; ``resolve`` reports them."""
    env = os.environ if env is None else env
    if env.get("ZMQFLOW_TASK"):
        return env["ZMQFLOW_TASK"]
    try:
        _, tid = resolve(None, None, env=env, require_task=False)
    except ConfigError:
        return None
    return str(tid) if tid is not None else None


def task_from_pod(env: Mapping[str, str] | None = None) -> TaskId:
    """This pod's task when one template serves a whole job (Kubernetes): the job is
    ZMQFLOW_TASK_JOB, the index ZMQFLOW_TASK_INDEX, else JOB_COMPLETION_INDEX (an Indexed Job
    sets it), else the ordinal a StatefulSet puts at the end of the host name (``zf-ps-3``)."""
    env = os.environ if env is None else env
    job = env.get("ZMQFLOW_TASK_JOB", "").strip()
    if not _JOB_RE.match(job):
        raise ConfigError(f"ZMQFLOW_TASK_JOB={job!r} is not a job name")
    for name in ("ZMQFLOW_TASK_INDEX", "JOB_COMPLETION_INDEX"):
        text = env.get(name, "").strip()
        if text:
            if not _is_digits(text):
                raise ConfigError(f"{name}={text!r}: expected a non-negative integer")
            return TaskId(job, int(text))
    host = env.get("HOSTNAME") or socket.gethostname()
    ordinal = host.split(".")[0].rpartition("-")[2]
    if not _is_digits(ordinal):
        raise ConfigError(f"ZMQFLOW_TASK_JOB={job!r} needs an index: set ZMQFLOW_TASK_INDEX or JOB_COMPLETION_INDEX, "
                          f"or run where the host name ends in '-<ordinal>' (a StatefulSet pod), not {host!r}")
    return TaskId(job, int(ordinal))


def shard_tasks(spec: ClusterSpec) -> list[TaskId]:
    """Where variables go by default (round-robin, greedy, a table's parts): every ps task, or
    the first task of a cluster without a ps job. Every task hosts a shard, so ``zf.device`` may
    pin a variable to any task; :func:`holder_tasks` says which tasks hold some."""
    ps = [TaskId("ps", i) for i in spec.task_indices("ps")]
    return ps or [training_tasks(spec)[0]]


# Jobs named in a cluster that take no part in training (TF's evaluator): nobody waits for them,
# no state is placed on them, and they are never ranks.
NOT_TRAINING = ("evaluator",)


def training_tasks(spec: ClusterSpec) -> list[TaskId]:
    """Every task but the evaluator's: what training waits for and may place state on. The
    evaluator reads checkpoints from disk and need not even serve its address. A cluster of
    evaluators alone keeps them all (there is nothing else to name)."""
    tasks = [t for t in spec.tasks if t.job not in NOT_TRAINING]
    return tasks or spec.tasks


def holder_tasks(spec: ClusterSpec, records: Iterable[Mapping[str, Any]]) -> list[TaskId]:
    """The tasks whose shards hold state, in the cluster's order: the default shards and every
    task a catalog record places a part on (a variable pinned to a worker). What checkpoints
    save and recoveries fence: a task holding nothing is never asked, so it need not be up."""
    named = {TaskId.parse(p["task"]) for r in records for p in r.get("parts", ())}
    default = set(shard_tasks(spec))
    return [t for t in spec.tasks if t in default or t in named]


def catalog_task(spec: ClusterSpec) -> TaskId:
    return shard_tasks(spec)[0]


def from_slurm(environ: Mapping[str, str] | None = None, *, ps: int = 0,
               base_port: int = 2222) -> tuple[ClusterSpec, TaskId]:
    """The cluster of a Slurm step and this process's task, from SLURM_JOB_NODELIST (or the
    step's SLURM_STEP_NODELIST), SLURM_NTASKS, SLURM_TASKS_PER_NODE, SLURM_PROCID and
    SLURM_LOCALID. Ranks are placed in block order on their nodes, each serving on
    ``base_port + local id``; the first ``ps`` ranks are ``ps:0..``, the rest ``worker:0..``.
    Every rank computes the same spec, so no rank has to publish its address."""
    env = os.environ if environ is None else environ
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ConfigError(f"ps {ps!r}: expected a non-negative integer")
    layout = _slurm.layout(env, base_port)
    if ps >= len(layout.tasks):
        raise ConfigError(f"ps={ps} leaves no worker: the Slurm step has {len(layout.tasks)} tasks")
    jobs: dict[str, list[str]] = {"ps": [], "worker": []} if ps else {"worker": []}
    for t in layout.tasks:
        jobs["ps" if t.rank < ps else "worker"].append(str(Address("tcp", t.host, t.port)))
    me = TaskId("ps", layout.rank) if layout.rank < ps else TaskId("worker", layout.rank - ps)
    return ClusterSpec(jobs), me


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    if not _is_digits(text):
        raise ConfigError(f"{name}={env.get(name)!r}: expected a non-negative integer")
    return int(text)
