"""The master service: the task's status and the cluster-wide view every session can ask for."""

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

__all__ = ["MasterService", "TaskRuntime"]


class TaskRuntime(Protocol):
    """What services need from the server that hosts them."""

    spec: ClusterSpec
    task: TaskId
    counters: Counters
    started_at: float

    @property
    def client(self) -> RpcClient: ...

    @property
    def target(self) -> str: ...

    def service_names(self) -> list[str]: ...

    def service_states(self) -> dict[str, str]: ...

    def progress_step(self) -> int | None: ...


class MasterService(Service):
    name = "master"

    def __init__(self, runtime: TaskRuntime):
        super().__init__()
        self.runtime = runtime

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
