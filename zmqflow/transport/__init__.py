"""ZeroMQ sockets driven by asyncio: options, the process context, and the channel."""

from .channel import Channel
from .context import context
from .options import DEFAULT_OPTIONS, SocketOptions

__all__ = ["Channel", "context", "DEFAULT_OPTIONS", "SocketOptions"]
