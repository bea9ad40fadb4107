"""Cluster-wide liveness: ping every task, concurrently, until all answer or time runs out."""

from __future__ import annotations

import asyncio

from ..cluster import ClusterSpec, TaskId, training_tasks
from ..errors import ClusterNotReady, ZmqflowError
from .client import RpcClient

__all__ = ["wait_for_tasks", "probe"]

_PROBE_TIMEOUT = 1.0


async def probe(client: RpcClient, spec: ClusterSpec, task: TaskId, timeout: float) -> dict | None:
    """The task's status, or None when it did not answer within ``timeout``."""
    try:
        return await client.call(spec.address(task).endpoint, "master", "status", timeout=timeout, name=str(task))
    except ZmqflowError:
        return None


async def wait_for_tasks(client: RpcClient, spec: ClusterSpec, timeout: float, tasks: list[TaskId] | None = None) -> None:
    """Return when every task answers a ping; else raise ClusterNotReady naming the silent ones.
    By default every task that trains: an evaluator is not waited for (it may not serve at all)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    waiting = list(tasks if tasks is not None else training_tasks(spec))
    while waiting:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        per_try = max(0.05, min(_PROBE_TIMEOUT, remaining))
        calls = [
            client.call(spec.address(t).endpoint, "master", "ping", timeout=per_try, name=str(t)) for t in waiting
        ]
        started = loop.time()
        results = await asyncio.gather(*calls, return_exceptions=True)
        waiting = [t for t, r in zip(waiting, results) if isinstance(r, BaseException)]
        if waiting:  # an unreachable task fails fast; do not spin on it
            await asyncio.sleep(max(0.0, min(0.05 - (loop.time() - started), deadline - loop.time())))
    if waiting:
        names = [str(t) for t in waiting]
        raise ClusterNotReady(
            f"{len(names)} of {len(spec)} tasks did not answer within {timeout:g}s: {', '.join(names)}", missing=names
        )
