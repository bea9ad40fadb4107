"""Services are actors addressed by name on a task's router; their ops are plain methods.

An op is a method marked with :func:`op`. It receives a :class:`CallContext` and the request's
arguments as keywords, and returns a msgpack-able value (arrays may sit anywhere in it) or a
coroutine for ops that wait. Arguments are bound against the signature before the call, so a
wrong or missing argument is an ``InvalidArgument`` naming the op, not a crash.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import InvalidArgument, NotFound

__all__ = ["op", "Service", "CallContext", "Op"]

F = TypeVar("F", bound=Callable[..., Any])


def op(fn: F) -> F:
    """Mark a service method as callable over the wire."""
    fn.__zf_op__ = True  # type: ignore[attr-defined]
    return fn


@dataclass(slots=True)
class CallContext:
    """What a handler knows about the call: who sent it and by when an answer is wanted."""

    service: str
    op: str
    peer: bytes
    source: str
    deadline: float | None  # loop time, or None for no deadline


class Op:
    """An op and the argument names its signature accepts (checked with set operations: cheap)."""

    __slots__ = ("fn", "accepted", "required", "open")

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        params = list(inspect.signature(fn).parameters.values())[1:]  # after ctx
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.accepted = frozenset(p.name for p in params if p.kind in kinds)
        self.required = frozenset(p.name for p in params if p.kind in kinds and p.default is p.empty)
        self.open = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    def bind(self, service: str, name: str, ctx: CallContext, body: Any) -> Callable[[], Any]:
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InvalidArgument(f"{service}.{name}: arguments must be a map, got {type(body).__name__}")
        keys = body.keys()
        if not self.open and not keys <= self.accepted:
            unknown = ", ".join(sorted(map(str, keys - self.accepted)))
            raise InvalidArgument(f"{service}.{name}: unexpected argument(s) {unknown}")
        if not self.required <= keys:
            raise InvalidArgument(f"{service}.{name}: missing argument(s) {', '.join(sorted(self.required - keys))}")
        fn = self.fn
        return lambda: fn(ctx, **body)


class Service:
    """Base of every service: collects its ops and answers ``ping``."""

    name = "service"

    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        for attr in dir(type(self)):
            fn = getattr(type(self), attr, None)
            if callable(fn) and getattr(fn, "__zf_op__", False):
                self.ops[attr] = Op(getattr(self, attr))

    def find_op(self, name: str) -> Op:
        found = self.ops.get(name)
        if found is None:
            raise NotFound(f"service {self.name!r} has no op {name!r} (ops: {', '.join(sorted(self.ops))})")
        return found

    def state(self) -> str | None:
        """A few words on a state an operator should see in ``zmqflow status`` (None: nothing to say)."""
        return None

    def admit(self, ctx: CallContext) -> None:
        """Called before every call is dispatched; raise to refuse it (a shard being restored does)."""

    @op
    def ping(self, ctx: CallContext) -> dict[str, Any]:
        return {"service": self.name}

    async def start(self) -> None:
        """Called once the task's router is bound; override for background work."""

    async def stop(self) -> None:
        """Called before the router closes; cancel background work here."""
