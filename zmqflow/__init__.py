"""zmqflow: a distributed training runtime on ZeroMQ, msgpack and numpy."""

from .version import __version__

from . import errors, init, optim
from .cluster import Address, ClusterSpec, TaskId
from .optim import SyncReplicas
from .placement import GreedyLoadBalancing, RoundRobin, device, placement
from .ps.partition import fixed_size_partitioner, min_max_variable_partitioner
from .server import AsyncServer, Server
from .embedding import AsyncEmbedding
from .session import AsyncSession, Embedding, Session, Variable
from .variables import AsyncVariable

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
    "Variable",
    "AsyncVariable",
    "Embedding",
    "AsyncEmbedding",
    "init",
    "optim",
    "SyncReplicas",
    "device",
    "placement",
    "RoundRobin",
    "GreedyLoadBalancing",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
]
