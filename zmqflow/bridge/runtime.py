"""One process's place in the cluster, for the framework bridges (``zmqflow.torch``, ``zmqflow.jax``).

``init()`` finds the cluster and this task as ``zmqflow launch`` gives them (``ZMQFLOW_CLUSTER``
and ``ZMQFLOW_TASK``, then ``TF_CONFIG``, then Slurm's variables under ``srun``), or as passed, hosts this task's server in-process, and
opens a session on it and, for a rank (the chief, then every worker), the ring of all ranks. It
is process-wide, as Horovod's ``hvd.init()`` is, because the collectives of every rank must run
in the same order on one ring. Without any cluster it starts a private one in-process (this
process as ``worker:0`` beside one ``ps:0``), so the same script runs alone.

A chief or worker says hello to the ps tasks on ``init()`` and goodbye on ``shutdown()`` (also
run at exit): ``finished`` unless the process is ending on an uncaught exception, so a ps under
``--exit-when-done`` exits once training is over. When a stop request stops this process's
server (``zmqflow stop``), the runtime shuts down with it, and ``current()`` and ``init()``
raise ``Unavailable`` naming the request, so a training loop ends with that error, not a hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..client.blocking import Session
from ..client.presence import Presence
from ..client.ring import default_members
from ..client.ring_blocking import Ring
from ..cluster import ClusterSpec, TaskId, resolve
from ..errors import ConfigError, Unavailable, ZmqflowError
from ..observe.endpoint import Endpoint
from ..observe.endpoint import start_for as start_metrics
from ..observe import timeline
from ..ports import free_port
from ..server.task import Server
from ..slurm import is_slurm

__all__ = ["Runtime", "init", "current", "shutdown", "is_initialized"]


@dataclass
class Runtime:
    """What a bridge needs of this process: its task, server, session, and (for a rank) the ring."""

    spec: ClusterSpec
    task: TaskId
    server: Server
    session: Session
    ring: Ring | None
    members: list[TaskId]
    local_rank: int
    local_size: int
    timeout: float
    _extra: list[Server] = field(default_factory=list, repr=False)  # the private cluster's other tasks
    metrics: Endpoint | None = None  # ZMQFLOW_METRICS_PORT's endpoint, serving this process's tasks
    presence: Presence | None = field(default=None, repr=False)  # hello/goodbye to the ps tasks

    def require_ring(self) -> Ring:
        """The ring of the ranks; a ``ConfigError`` on a task that is none (a ps task, say)."""
        if self.ring is None:
            raise ConfigError(f"task {self.task} is not a rank: ranks are the chief and the workers "
                              f"({', '.join(map(str, self.members))})")
        return self.ring

    @property
    def rank(self) -> int:
        return self.require_ring().rank

    @property
    def size(self) -> int:
        return len(self.members)

    def close(self, finished: bool = True) -> None:
        """Leave: goodbye to the ps tasks (``finished``: training ended cleanly), the ring, the rest."""
        if self.presence is not None:
            self.presence.goodbye(finished)
        if self.ring is not None and self.server.stop_reason is None:  # a stopped server has no ring left
            try:  # done here: a peer finishing the last collective must not take our exit for a death
                self.ring.leave()
            except ZmqflowError as exc:
                log.debug("leaving the ring ended with %s", exc)
        self.session.close()
        self.server.stop()
        for s in self._extra:
            s.stop()
        if self.metrics is not None:
            self.metrics.close()


log = logging.getLogger("zmqflow.bridge")
_lock = threading.Lock()
_current: Runtime | None = None
_exit_hook = False
_stopped: str | None = None  # why a stop request shut the runtime down (cleared by shutdown())
_failed = False  # an uncaught exception is ending the process: its goodbye is not "finished"


def init(cluster: "ClusterSpec | Mapping[str, Any] | str | os.PathLike[str] | None" = None,
         task: "TaskId | str | None" = None, *, timeout: float = 60.0, wait: bool = True) -> Runtime:
    """Join the cluster (once per process; a second call returns the same runtime).

    ``wait``: block until every rank's server answers, so the first collective does not race
    a rank still starting."""
    global _current
    with _lock:
        if _current is not None:
            return _current
        if _stopped is not None:
            raise _stopped_error()
        extra: list[Server] = []
        private = False
        if cluster is None and task is None and not (os.environ.get("ZMQFLOW_CLUSTER") or os.environ.get("TF_CONFIG")
                                                     or is_slurm(os.environ)):
            for var in ("ZMQFLOW_TASK", "ZMQFLOW_TASK_JOB"):  # a task was meant to join a cluster, not train alone
                if os.environ.get(var):
                    raise ConfigError(f"{var} is set ({os.environ[var]!r}) but no cluster is: set ZMQFLOW_CLUSTER "
                                      "(or TF_CONFIG), pass cluster=, or unset it to train alone")
            spec = ClusterSpec({"worker": [f"127.0.0.1:{free_port()}"], "ps": [f"127.0.0.1:{free_port()}"]})
            me = TaskId("worker", 0)
            private = True
        else:
            spec, found = resolve(cluster, task)
            if found is None:
                raise ConfigError("no task given: pass task=, or set ZMQFLOW_TASK or TF_CONFIG's 'task'")
            me = found
        timeline.set_task(me)  # names this process's timeline file and track, unless already written
        endpoint = start_metrics(spec, me)  # first: the servers are made with metrics on
        try:
            if private:
                extra.append(Server(spec, "ps:0", default_timeout=timeout))
            server = Server(spec, me, default_timeout=timeout)
        except BaseException:
            for s in extra:
                s.stop()
            if endpoint is not None:
                endpoint.close()
            raise
        session: Session | None = None
        try:
            members = default_members(spec)
            ring = Ring(server, members, timeout=timeout) if me in members else None
            local_rank, local_size = _local(spec, me, members)
            # the task's own keys (not whatever the environment names): its session is this task
            session = Session(server.target, name=str(me), timeout=timeout, keys=server.async_server.keys)
            runtime = Runtime(spec, me, server, session, ring, members, local_rank, local_size, timeout, extra, endpoint)
            if wait:
                server.wait_for_cluster(timeout)
            runtime.presence = Presence(session, spec, me)
            runtime.presence.hello()
        except BaseException:
            if session is not None:
                session.close()
            server.stop()
            for s in extra:
                s.stop()
            if endpoint is not None:
                endpoint.close()
            raise
        _current = runtime
        server.on_stop_request(lambda reason: _stop_requested(reason, server))
        global _exit_hook
        if not _exit_hook:  # a process that exits without shutdown() (an exception, sys.exit) still
            atexit.register(_at_exit)  # stops its server first: one still serving at teardown can crash it
            _previous_hook = sys.excepthook

            def note_failure(*info: object) -> None:
                global _failed
                _failed = True
                _previous_hook(*info)  # type: ignore[arg-type]

            sys.excepthook = note_failure
            _exit_hook = True
        return runtime


def _local(spec: ClusterSpec, me: TaskId, members: list[TaskId]) -> tuple[int, int]:
    """(local rank, ranks on this host): ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when a launcher
    set them, else counted over the ranks whose address names the same host."""
    if "LOCAL_RANK" in os.environ:
        rank = _env_int("LOCAL_RANK", 0)
        size = _env_int("LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in os.environ else rank + 1
        if rank >= size:
            raise ConfigError(f"LOCAL_RANK={rank} is not below LOCAL_WORLD_SIZE={size}")
        return rank, size
    host = spec.address(me).host
    same = [m for m in members if spec.address(m).host == host]
    return (same.index(me) if me in same else 0), max(1, len(same))


def _env_int(var: str, least: int) -> int:
    try:
        value = int(os.environ[var])
    except ValueError:
        raise ConfigError(f"{var}={os.environ[var]!r} is not an integer") from None
    if value < least:
        raise ConfigError(f"{var}={value} is below {least}")
    return value


def _stopped_error() -> Unavailable:
    return Unavailable(f"the zmqflow runtime shut down: this task's server was stopped ({_stopped}); "
                       "call zmqflow.bridge.runtime.shutdown() before init() to join again", reason=_stopped)


def _stop_requested(reason: str, server: Server) -> None:
    """This process's server was stopped by request: shut its runtime down, loudly."""
    global _current, _stopped
    with _lock:
        if _current is None or _current.server is not server:  # a runtime already left
            return
        runtime, _current = _current, None
        _stopped = reason
    log.warning("the zmqflow runtime is shutting down: %s", reason)
    if runtime is not None:
        runtime.close(finished=False)


def current() -> Runtime:
    """The runtime ``init()`` made; a clear error before it, and ``Unavailable`` after a stop request."""
    if _current is None and _stopped is not None:
        raise _stopped_error()
    if _current is None:
        raise ConfigError("the zmqflow runtime is not initialised: call zmqflow.torch.init() (or zmqflow.jax.init()) first")
    return _current


def is_initialized() -> bool:
    return _current is not None


def shutdown(finished: bool = True) -> None:
    """Leave the cluster: goodbye to the ps tasks (``finished``: training ended; pass False when
    it did not), stop this process's server and session (init() may be called again)."""
    global _current, _stopped
    with _lock:
        runtime, _current, _stopped = _current, None, None
    if runtime is not None:
        runtime.close(finished)


def _at_exit() -> None:
    """At interpreter exit: a clean exit finished training; an uncaught exception did not."""
    shutdown(finished=not _failed)
