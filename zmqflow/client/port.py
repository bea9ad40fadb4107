"""The narrow ports between handles and the session that owns their connections.

Handles (variables, tables) and the checkpoint functions need a session only to reach a task,
reach the catalog and push gradients; blocking handles also need a way to run a coroutine on
the session's loop. They see these protocols, never the session's class, so the session can
import the handles without the handles importing it back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, Protocol, TypeVar

from ..cluster import ClusterSpec, TaskId

__all__ = ["SessionPort", "LoopPort"]

T = TypeVar("T")


class SessionPort(Protocol):
    """What an async handle may ask of its session."""

    timeout: float
    bulk_lanes: int  # the pull streams a large pull spreads over in all (:mod:`.bulk_lanes`)

    async def call_task(self, task: TaskId, service: str, op: str, body: Any = None, *,
                        timeout: float | None = None, size: int = 0) -> Any:
        """``service.op`` on one task of the session's cluster, within ``timeout`` (the session's by
        default). ``size``: the bytes its reply will carry, when it is a large read."""
        ...

    async def bulk_stream(self, task: TaskId, kind: str = "pull", lane: int = 0) -> Any:
        """The bulk stream of ``kind`` (``pull``: a :class:`.bulk.BulkStream`; ``push``: a
        :class:`.bulk_push.PushStream`) to ``task`` in ``lane``, or None where there is none."""
        ...

    async def call_catalog(self, op: str, body: Any, timeout: float | None = None) -> Any:
        """``catalog.op`` on the task that holds the cluster's catalog."""
        ...

    async def cluster(self) -> ClusterSpec:
        """The cluster the session talks to."""
        ...

    async def push(self, grads: Mapping[Any, Any], step: int | None = None, *, timeout: float | None = None,
                   learning_rate: float | None = None) -> int | None:
        """Gradients through each variable's optimizer; the session keeps the step it returns."""
        ...


class LoopPort(Protocol):
    """What a blocking handle may ask of its session: run a coroutine on its loop and wait."""

    def run_on_loop(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """The coroutine's result, waiting at most ``timeout`` (the session's deadline by default) plus a margin."""
        ...
