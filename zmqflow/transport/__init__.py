"""Transports behind one seam: ZeroMQ (tcp, ipc, inproc; CurveZMQ with keys), in-process delivery, and fault injection."""

from .base import AUTH_FAILED, CONNECTING, DOWN, UP, Connection, Listener, SendFailed, Transport
from .channel import Channel
from .context import context
from .curve import CurveClient, CurveServer, Keys
from .faults import FaultInjector, Packet, Rule
from .local import LocalTransport
from .options import DEFAULT_OPTIONS, SocketOptions
from .registry import lookup, register, use
from .zeromq import ZmqTransport

__all__ = [
    "Channel", "context", "DEFAULT_OPTIONS", "SocketOptions",
    "CONNECTING", "UP", "DOWN", "AUTH_FAILED", "Connection", "Keys", "CurveClient", "CurveServer", "Listener", "SendFailed", "Transport",
    "ZmqTransport", "LocalTransport", "FaultInjector", "Packet", "Rule",
    "lookup", "register", "use",
]
