"""Services are actors addressed by name on a task's router; their ops are plain methods.

An op is a method marked with :func:`op`. Declared ops (``@op(Decl)``, ``Decl`` a request of
:mod:`zmqflow.wire.requests`) receive a :class:`CallContext` and the request converted to
``Decl`` at the edge, before the handler runs: a missing, unknown, mistyped or out-of-limit field
is an ``InvalidArgument`` naming the op and the field, never a crash. Undeclared ops (a bare
``@op``, for services outside zmqflow and ops that take any map) get the arguments as keywords,
their names checked against the signature. An op returns a msgpack-able value (arrays may sit
anywhere in it), an :class:`Answer` (such a value and a shorter one for a resent request), or a
coroutine for ops that wait and return either.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import InvalidArgument, NotFound
from ..wire.requests import OPEN, Request, Validator, compile_validator
from ..wire.requests.ps import Empty

__all__ = ["op", "Service", "CallContext", "Op", "Answer"]

F = TypeVar("F", bound=Callable[..., Any])


def op(target: Any) -> Any:
    """Mark a service method as callable over the wire: ``@op(Decl)`` with its request's
    declaration, or a bare ``@op`` for arguments bound as keywords against the signature.

    A declared handler called in-process may be given the fields as keywords instead of the
    request (``ps.push(ctx, dense=[...], step=0)``): they are checked as a call would be. The
    RPC dispatch calls the handler itself, with the request it checked at the edge."""
    if not (isinstance(target, type) and issubclass(target, Request)):
        target.__zf_op__ = True
        return target

    def mark(fn: F) -> F:
        if target is OPEN:
            fn.__zf_op__ = OPEN  # type: ignore[attr-defined]
            return fn

        @functools.wraps(fn)
        def handler(self: Any, ctx: CallContext, req: Any = None, /, **fields: Any) -> Any:
            if req is None:
                req = _validator(getattr(self, "name", "service"), fn.__name__, target)(fields)
            return fn(self, ctx, req)

        handler.__zf_op__ = target  # type: ignore[attr-defined]
        handler.__zf_handler__ = fn  # type: ignore[attr-defined]
        return handler  # type: ignore[return-value]

    return mark


_validators: dict[tuple[str, str, type], Validator] = {}


def _validator(service: str, name: str, declaration: type[Request]) -> Validator:
    """One compiled validator per service, op and declaration."""
    key = (service, name, declaration)
    found = _validators.get(key)
    if found is None:
        found = _validators[key] = compile_validator(service, name, declaration)
    return found


@dataclass(slots=True)
class CallContext:
    """What a handler knows about the call: who sent it and by when an answer is wanted.

    ``source`` is who calls: with keys, the name of the caller's authenticated key (a header that
    claims another is refused before dispatch, :mod:`.roles`); without keys, the header's field.
    ``verified`` says which; ``role`` is the key's role (every caller is a task without keys)."""

    service: str
    op: str
    peer: bytes
    source: str
    deadline: float | None  # loop time, or None for no deadline
    role: str = "task"
    verified: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """An op's answer, ``value``, and ``retry``, what a duplicate of its request is answered with
    where ``value`` encodes to more than a server keeps of a reply for one (``dedup.MAX_KEPT_REPLY``).

    A reply too big to keep leaves a duplicate only "already ran"; a push that read rows back
    would then lose its step to a client whose answer was lost. Its ``retry`` keeps the step and
    leaves the rows out: that client pulls them. A ``retry`` of None is none: "already ran"."""

    value: Any
    retry: Any


class Op:
    """An op and how its arguments are checked: by its declaration's validator (compiled once),
    or, undeclared, by the names its signature accepts (set operations: cheap)."""

    __slots__ = ("fn", "accepted", "required", "open", "declaration", "validate")

    def __init__(self, fn: Callable[..., Any], service: str = "service", name: str = "", declaration: Any = True):
        self.fn = fn
        declared = isinstance(declaration, type) and issubclass(declaration, Request) and declaration is not OPEN
        self.declaration: type[Request] | None = declaration if declared else None
        self.validate = _validator(service, name or fn.__name__, declaration) if declared else None
        params = list(inspect.signature(fn).parameters.values())[1:]  # after ctx
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.accepted = frozenset(p.name for p in params if p.kind in kinds)
        self.required = frozenset(p.name for p in params if p.kind in kinds and p.default is p.empty)
        self.open = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    def bind(self, service: str, name: str, ctx: CallContext, body: Any) -> Callable[[], Any]:
        """The call, once its arguments are checked: ``fn(ctx, request)`` or ``fn(ctx, **body)``."""
        fn = self.fn
        validate = self.validate
        if validate is not None:
            return functools.partial(fn, ctx, validate(body))  # a partial: no Python frame of its own
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InvalidArgument(f"{service}.{name}: arguments must be a map, got {type(body).__name__}")
        keys = body.keys()
        if not self.open and not keys <= self.accepted:
            unknown = ", ".join(sorted(map(str, keys - self.accepted)))
            raise InvalidArgument(f"{service}.{name}: unexpected argument(s) {unknown:.200}")
        if not self.required <= keys:
            raise InvalidArgument(f"{service}.{name}: missing argument(s) {', '.join(sorted(self.required - keys))}")

        def call() -> Any:
            try:
                return fn(ctx, **body)
            except TypeError:  # names that are not strings (a msgpack bin key) fail the call before it runs
                bad = next((k for k in body if not isinstance(k, str)), None)
                if bad is None:  # the handler's own error
                    raise
                raise InvalidArgument(f"{service}.{name}: argument names must be strings, got {bad!r:.80}") from None

        return call


class Service:
    """Base of every service: collects its ops and answers ``ping``."""

    name = "service"
    client_ops: frozenset[str] | None = None  # with keys, the ops a client key may call (None: rpc/roles.py's table)

    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        for attr in dir(type(self)):
            fn = getattr(type(self), attr, None)
            mark = getattr(fn, "__zf_op__", False) if callable(fn) else False
            if mark:
                raw = getattr(fn, "__zf_handler__", None)  # a declared handler, past its keyword shim
                bound = types.MethodType(raw, self) if raw is not None else getattr(self, attr)
                self.ops[attr] = Op(bound, self.name, attr, mark)

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

    @op(Empty)
    def ping(self, ctx: CallContext, req: Empty) -> dict[str, Any]:
        return {"service": self.name}

    async def start(self) -> None:
        """Called once the task's router is bound; override for background work."""

    async def stop(self) -> None:
        """Called before the router closes; cancel background work here."""
