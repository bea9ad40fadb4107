"""Which transport serves an endpoint: a scheme -> backend table, and a scoped override for tests.

As in dask.distributed's comm registry, the scheme before ``://`` picks the backend (a bare
``host:port`` is tcp). ``tcp``, ``ipc`` and ``inproc`` are ZeroMQ. ``use(transport)`` routes every
endpoint of every RPC client and server *created* inside it to ``transport`` instead (a context
variable, so it follows the asyncio tasks started there and nothing else); that is how an
in-process cluster runs on the fault injector without each layer above passing it down.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from .base import Transport
from .zeromq import ZmqTransport

__all__ = ["register", "lookup", "scheme_of", "use", "current_override", "plain_zeromq"]

_ZMQ = ZmqTransport()
_backends: dict[str, Transport] = {"tcp": _ZMQ, "ipc": _ZMQ, "inproc": _ZMQ}
_override: contextvars.ContextVar[Transport | None] = contextvars.ContextVar("zmqflow_transport", default=None)


def scheme_of(endpoint: str) -> str:
    scheme, sep, _ = endpoint.partition("://")
    return scheme if sep else "tcp"


def register(scheme: str, transport: Transport) -> None:
    """Serve endpoints of ``scheme`` with ``transport`` (replacing what served them)."""
    _backends[scheme] = transport


def current_override() -> Transport | None:
    """The transport ``use`` installed around the caller, if any."""
    return _override.get()


def lookup(endpoint: str) -> Transport:
    """The transport for ``endpoint``: the scoped override, else the one registered for its scheme."""
    override = _override.get()
    if override is not None:
        return override
    try:
        return _backends[scheme_of(endpoint)]
    except KeyError:
        known = ", ".join(sorted(_backends))
        raise ValueError(f"no transport for {endpoint!r}: scheme {scheme_of(endpoint)!r} is not one of {known}") from None


def plain_zeromq(endpoint: str, given: Transport | None = None) -> bool:
    """Whether ``endpoint`` is served by ZeroMQ's own transport: none ``given``, no override, and
    ZeroMQ registered for its scheme. Only then may a side channel beside it (a bulk stream) be
    used: it would bypass a test's fault injector."""
    return given is None and isinstance(lookup(endpoint), ZmqTransport)


@contextlib.contextmanager
def use(transport: Transport) -> Iterator[Transport]:
    """Route the RPC clients and servers created inside this block through ``transport``."""
    token = _override.set(transport)
    try:
        yield transport
    finally:
        _override.reset(token)
