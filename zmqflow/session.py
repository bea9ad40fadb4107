"""Client sessions: talk to a cluster through one of its tasks, from any Python process.

``AsyncSession`` holds its own connections on the caller's loop; ``Session`` runs one on a
background loop for scripts and notebooks. A session is pointed at a target (``server.target``
or ``"tcp://host:port"``) or at a task of a cluster spec.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from .cluster import Address, ClusterSpec, TaskId, load_config
from .errors import ConfigError
from .loop import LoopThread
from .rpc import DEFAULT_TIMEOUT, RpcClient

__all__ = ["AsyncSession", "Session"]

_WAIT_MARGIN = 5.0


def _target_endpoint(target: str | None, cluster: Any, task: "TaskId | str | None") -> tuple[str, ClusterSpec | None]:
    if target is not None:  # "host:port", "tcp://host:port", "ipc://path" or "inproc://name"
        return Address.parse(target, "session target").endpoint, None
    if cluster is None:
        raise ConfigError("a session needs a target, or cluster= and task=")
    spec, file_task = load_config(cluster)
    tid = TaskId.parse(task) if task is not None else file_task or spec.tasks[0]
    return spec.address(tid).endpoint, spec


class AsyncSession:
    """A session whose methods are coroutines. Use on one event loop."""

    def __init__(
        self,
        target: str | None = None,
        *,
        cluster: "ClusterSpec | Mapping[str, Any] | str | os.PathLike[str] | None" = None,
        task: "TaskId | str | None" = None,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        self.endpoint, self._spec = _target_endpoint(target, cluster, task)
        self.timeout = timeout
        self._client: RpcClient | None = None

    @property
    def client(self) -> RpcClient:
        if self._client is None:
            self._client = RpcClient(identity=f"session-{uuid.uuid4().hex[:12]}", default_timeout=self.timeout)
        return self._client

    async def call(self, service: str, op: str, body: Any = None, *, task: "TaskId | str | None" = None, timeout: float | None = None) -> Any:
        """Call ``service.op`` on the session's target, or on another ``task`` of its cluster."""
        endpoint, name = self.endpoint, None
        if task is not None:
            spec = await self.cluster()
            tid = TaskId.parse(task)
            endpoint, name = spec.address(tid).endpoint, str(tid)
        return await self.client.call(endpoint, service, op, body, timeout=timeout, name=name)

    async def cluster(self) -> ClusterSpec:
        """The cluster the target belongs to (asked once, then remembered)."""
        if self._spec is None:
            reply = await self.client.call(self.endpoint, "master", "cluster")
            self._spec = ClusterSpec(reply["cluster"])
        return self._spec

    async def status(self, task: "TaskId | str | None" = None) -> dict[str, Any]:
        return await self.call("master", "status", task=task)

    async def wait_for_cluster(self, timeout: float = 30.0) -> None:
        """Return when every task of the cluster answers; else ClusterNotReady naming the others."""
        await self.client.call(
            self.endpoint, "master", "wait_for_cluster", {"timeout": float(timeout)}, timeout=timeout + _WAIT_MARGIN
        )

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Session:
    """The blocking twin of :class:`AsyncSession`, for scripts and notebooks."""

    def __init__(self, target: str | None = None, **kwargs: Any):
        self._async = AsyncSession(target, **kwargs)
        self._thread = LoopThread(name="zmqflow-session")

    def _run(self, coro: Any, timeout: float | None) -> Any:
        limit = (self._async.timeout if timeout is None else timeout) + _WAIT_MARGIN
        return self._thread.call(coro, timeout=limit)

    def call(self, service: str, op: str, body: Any = None, *, task: "TaskId | str | None" = None, timeout: float | None = None) -> Any:
        return self._run(self._async.call(service, op, body, task=task, timeout=timeout), timeout)

    def cluster(self) -> ClusterSpec:
        return self._run(self._async.cluster(), None)

    def status(self, task: "TaskId | str | None" = None) -> dict[str, Any]:
        return self._run(self._async.status(task), None)

    def wait_for_cluster(self, timeout: float = 30.0) -> None:
        self._run(self._async.wait_for_cluster(timeout), timeout)

    def close(self) -> None:
        if self._thread.loop.is_closed():
            return
        self._thread.call(self._async.close(), timeout=5)
        self._thread.stop()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
