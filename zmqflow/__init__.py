"""zmqflow: a distributed training runtime on ZeroMQ, msgpack and numpy."""

__version__ = "0.1.0"

from . import errors
from .cluster import Address, ClusterSpec, TaskId
from .server import AsyncServer, Server

__all__ = ["__version__", "errors", "Address", "ClusterSpec", "TaskId", "AsyncServer", "Server"]
