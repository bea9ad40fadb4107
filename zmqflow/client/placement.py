"""Where new variables go: ``zf.device`` pins, ``zf.placement`` picks a policy.

Both are context managers over context variables, so they nest and work across threads and
tasks. The decision itself is made by the cluster's catalog, which sees every declaration.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from ..cluster import TaskId

__all__ = ["device", "placement", "RoundRobin", "GreedyLoadBalancing", "current_device", "current_policy"]


@dataclass(frozen=True)
class RoundRobin:
    """Each new variable (or part) on the next ps task, in declaration order (TF's default)."""

    name = "round_robin"


@dataclass(frozen=True)
class GreedyLoadBalancing:
    """Each new variable (or part) on the ps task holding the fewest bytes."""

    name = "greedy"


_device: contextvars.ContextVar[TaskId | None] = contextvars.ContextVar("zmqflow_device", default=None)
_policy: contextvars.ContextVar["RoundRobin | GreedyLoadBalancing"] = contextvars.ContextVar("zmqflow_policy", default=RoundRobin())


@contextlib.contextmanager
def device(spec: "str | TaskId | None") -> Iterator[None]:
    """Pin the variables declared inside to one task: ``"/job:ps/task:1"`` or ``"ps:1"``."""
    token = _device.set(None if spec is None else TaskId.parse(spec))
    try:
        yield
    finally:
        _device.reset(token)


@contextlib.contextmanager
def placement(policy: "RoundRobin | GreedyLoadBalancing") -> Iterator[None]:
    token = _policy.set(policy)
    try:
        yield
    finally:
        _policy.reset(token)


def current_device() -> TaskId | None:
    return _device.get()


def current_policy() -> "RoundRobin | GreedyLoadBalancing":
    return _policy.get()
