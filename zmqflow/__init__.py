"""zmqflow: a distributed training runtime on ZeroMQ, msgpack and numpy."""

from .version import __version__

from . import errors, init, optim
from .client import checkpoint, checkpoint_watch as _checkpoint_watch
from .cluster import Address, ClusterSpec, TaskId
from .state.optim import SyncReplicas
from .client.elastic_ring import AsyncElasticRing, ElasticRing
from .client.ring import AsyncRing, Ring
from .training.hooks import Hook, LoggingHook, ProgressHook, StopAtStep, SummaryHook
from .training.monitored import MonitoredTrainingSession
from .training.parameter_server import ParameterServerStrategy
from .training.ring_allreduce import RingAllReduceStrategy
from .training.strategy import LocalStrategy
from .training.evaluate import EvalCheckpoint, Evaluator, train_and_evaluate
from .client.placement import GreedyLoadBalancing, RoundRobin, device, placement
from .state.partition import fixed_size_partitioner, min_max_variable_partitioner
from .server.task import AsyncServer, Server
from .server.limits import ServerLimits
from .client.embedding import AsyncEmbedding
from .client.blocking import Embedding, Session, Variable
from .client.session import AsyncSession
from .client.variables import AsyncVariable
from .observe.progress import report_progress

# zf.checkpoint also holds the directory watch (checkpoints_iterator, mark_final, ...): one public
# namespace for checkpoints, as tf.train's, though the watch lives in a module of its own.
for _name in _checkpoint_watch.__all__:
    setattr(checkpoint, _name, getattr(_checkpoint_watch, _name))
del _name

__all__ = [
    "__version__",
    "errors",
    "checkpoint",
    "Address",
    "ClusterSpec",
    "TaskId",
    "AsyncServer",
    "Server",
    "ServerLimits",
    "AsyncSession",
    "Session",
    "Variable",
    "AsyncVariable",
    "Embedding",
    "AsyncEmbedding",
    "Ring",
    "AsyncRing",
    "ElasticRing",
    "AsyncElasticRing",
    "MonitoredTrainingSession",
    "LocalStrategy",
    "ParameterServerStrategy",
    "RingAllReduceStrategy",
    "train_and_evaluate",
    "Evaluator",
    "EvalCheckpoint",
    "Hook",
    "StopAtStep",
    "LoggingHook",
    "SummaryHook",
    "ProgressHook",
    "init",
    "optim",
    "SyncReplicas",
    "device",
    "placement",
    "RoundRobin",
    "GreedyLoadBalancing",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
    "report_progress",
]
