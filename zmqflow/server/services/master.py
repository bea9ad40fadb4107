"""The master service: the task's status, the cluster-wide view every session can ask for, and
the task's lifecycle: ``shutdown`` (``zmqflow stop``) and the training sessions' ``hello``/``goodbye``
that let a ps task exit once training is over (:mod:`.sessions`)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Protocol

from ...cluster import ClusterSpec, TaskId
from ...observe import progress
from ...version import __version__
from ...rpc import CallContext, Counters, RpcClient, Service, op
from ...wire import VERSION
from ...wire.requests import cluster as rq
from ...wire.requests.ps import Empty
from ...rpc.health import wait_for_tasks
from .sessions import SessionLedger

__all__ = ["MasterService", "TaskRuntime"]


class TaskRuntime(Protocol):
    """What services need from the server that hosts them."""

    spec: ClusterSpec
    task: TaskId
    counters: Counters
    started_at: float
    stop_reason: str | None

    @property
    def client(self) -> RpcClient: ...

    @property
    def target(self) -> str: ...

    def service_names(self) -> list[str]: ...

    def service_states(self) -> dict[str, str]: ...

    def progress_step(self) -> int | None: ...
    @property
    def exit_when_done(self) -> bool: ...

    def request_stop(self, reason: str) -> None: ...


class MasterService(Service):
    name = "master"

    def __init__(self, runtime: TaskRuntime):
        super().__init__()
        self.runtime = runtime
        self.sessions = SessionLedger(runtime.spec)

    @op(Empty)
    def ping(self, ctx: CallContext, req: Empty) -> dict[str, Any]:
        return {"service": self.name, "task": str(self.runtime.task), "time": time.time()}

    @op(Empty)
    def status(self, ctx: CallContext, req: Empty) -> dict[str, Any]:
        rt = self.runtime
        return {
            "task": str(rt.task),
            "job": rt.task.job,
            "index": rt.task.index,
            "address": rt.target,
            "roles": rt.service_names(),
            "state": rt.service_states(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "uptime_s": round(time.monotonic() - rt.started_at, 3),
            "version": __version__,
            "protocol": VERSION,
            "counters": rt.counters.as_dict(),
            "progress": self.progress(),
            "sessions": self.sessions.describe(),
            "stopping": rt.stop_reason,
        }

    def progress(self) -> dict[str, Any]:
        """This process's training progress; a task that trains nothing itself (a served ps)
        shows the step its shard holds, if any."""
        out = progress.snapshot()
        if "step" not in out and (step := self.runtime.progress_step()) is not None:
            out["step"] = step
        return out

    @op(Empty)
    def cluster(self, ctx: CallContext, req: Empty) -> dict[str, Any]:
        return {"cluster": self.runtime.spec.as_dict(), "task": str(self.runtime.task)}

    @op(rq.WaitForCluster)
    async def wait_for_cluster(self, ctx: CallContext, req: rq.WaitForCluster) -> bool:
        await wait_for_tasks(self.runtime.client, self.runtime.spec, req.timeout)
        return True

    @op(rq.Stop)
    def shutdown(self, ctx: CallContext, req: rq.Stop) -> dict[str, Any]:
        """Answer, then stop as on SIGTERM (``zmqflow stop``; ``stop`` is every service's own
        lifecycle hook, hence the op's name). Who may: any key the task admits (rpc/roles.py)."""
        who = f"by {ctx.role} key {ctx.source!r}" if ctx.verified else \
            f"by {ctx.source!r} (no keys)" if ctx.source else "(no keys)"
        reason = f"stop requested {who}" + (f": {req.reason}" if req.reason else "")
        self.runtime.request_stop(reason)
        return {"task": str(self.runtime.task), "stopping": True}

    @op(rq.Hello)
    def hello(self, ctx: CallContext, req: rq.Hello) -> dict[str, Any]:
        """A training session of the caller's task opened."""
        counted = self.sessions.hello(ctx.source, req.session)
        return {"task": str(self.runtime.task), "counted": counted}

    @op(rq.Goodbye)
    def goodbye(self, ctx: CallContext, req: rq.Goodbye) -> dict[str, Any]:
        """A training session of the caller's task closed; the last one may end this task."""
        counted = self.sessions.goodbye(ctx.source, req.session, req.finished)
        if counted and self.runtime.exit_when_done and self.sessions.done:
            self.runtime.request_stop("every chief and worker task finished training (--exit-when-done)")
        return {"task": str(self.runtime.task), "counted": counted}

    def state(self) -> str | None:
        if not self.runtime.exit_when_done:
            return None
        waiting = self.sessions.waiting()
        return f"exits when done; waiting for {', '.join(waiting)}" if waiting else "training done; exiting"
