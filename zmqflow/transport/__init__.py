"""Transports behind one seam: ZeroMQ (tcp, ipc, inproc; CurveZMQ with keys), in-process delivery, and fault injection."""

from .base import AUTH_FAILED, CONNECTING, DOWN, UP, Connection, Listener, SendFailed, Transport
from .channel import Channel
from .context import context
from .curve import CurveClient, CurveServer, Keys
from .options import DEFAULT_OPTIONS, SocketOptions
from .registry import lookup, register, use
from .zeromq import ZmqTransport

__all__ = [
    "Channel", "context", "DEFAULT_OPTIONS", "SocketOptions",
    "CONNECTING", "UP", "DOWN", "AUTH_FAILED", "Connection", "Keys", "CurveClient", "CurveServer", "Listener", "SendFailed", "Transport",
    "ZmqTransport", "LocalTransport", "FaultInjector", "Packet", "Rule",
    "lookup", "register", "use",
]

# The test transports load when first named: a served task never uses them.
_LAZY = {"LocalTransport": ".local", "FaultInjector": ".faults", "Packet": ".faults", "Rule": ".faults"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
