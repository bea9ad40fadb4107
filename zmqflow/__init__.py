"""zmqflow: a distributed training runtime on ZeroMQ, msgpack and numpy."""

from .version import __version__

from . import errors
from .cluster import Address, ClusterSpec, TaskId
from .server import AsyncServer, Server
from .session import AsyncSession, Session

__all__ = [
    "__version__",
    "errors",
    "Address",
    "ClusterSpec",
    "TaskId",
    "AsyncServer",
    "Server",
    "AsyncSession",
    "Session",
]
