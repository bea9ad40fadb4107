"""zmqflow: a distributed training runtime on ZeroMQ, msgpack and numpy.

The public names load on first use (PEP 562): ``zmqflow serve``, the process of every task,
imports the server's modules only, not the client, training loops and benchmarks, which would
cost each task server start-up time and resident memory. ``import zmqflow as zf; zf.Session``
and ``from zmqflow import Session`` work as with eager imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .version import __version__

# public name -> (module, attribute); attribute None: the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "errors": (".errors", None),
    "init": (".init", None),
    "optim": (".optim", None),
    "checkpoint": (".client.checkpoint", None),
    "Address": (".cluster", "Address"),
    "ClusterSpec": (".cluster", "ClusterSpec"),
    "TaskId": (".cluster", "TaskId"),
    "SyncReplicas": (".state.optim", "SyncReplicas"),
    "AsyncElasticRing": (".client.elastic_ring", "AsyncElasticRing"),
    "ElasticRing": (".client.elastic_ring", "ElasticRing"),
    "AsyncRing": (".client.ring", "AsyncRing"),
    "Ring": (".client.ring_blocking", "Ring"),
    "Hook": (".training.hooks", "Hook"),
    "LoggingHook": (".training.hooks", "LoggingHook"),
    "ProgressHook": (".training.hooks", "ProgressHook"),
    "StopAtStep": (".training.hooks", "StopAtStep"),
    "SummaryHook": (".training.hooks", "SummaryHook"),
    "MonitoredTrainingSession": (".training.monitored", "MonitoredTrainingSession"),
    "ParameterServerStrategy": (".training.parameter_server", "ParameterServerStrategy"),
    "RingAllReduceStrategy": (".training.ring_allreduce", "RingAllReduceStrategy"),
    "LocalStrategy": (".training.strategy", "LocalStrategy"),
    "EvalCheckpoint": (".training.evaluate", "EvalCheckpoint"),
    "Evaluator": (".training.evaluate", "Evaluator"),
    "train_and_evaluate": (".training.evaluate", "train_and_evaluate"),
    "GreedyLoadBalancing": (".client.placement", "GreedyLoadBalancing"),
    "RoundRobin": (".client.placement", "RoundRobin"),
    "device": (".client.placement", "device"),
    "placement": (".client.placement", "placement"),
    "fixed_size_partitioner": (".state.partition", "fixed_size_partitioner"),
    "min_max_variable_partitioner": (".state.partition", "min_max_variable_partitioner"),
    "AsyncServer": (".server.task", "AsyncServer"),
    "Server": (".server.task", "Server"),
    "ServerLimits": (".server.limits", "ServerLimits"),
    "AsyncEmbedding": (".client.embedding", "AsyncEmbedding"),
    "Embedding": (".client.blocking", "Embedding"),
    "Session": (".client.blocking", "Session"),
    "Variable": (".client.blocking", "Variable"),
    "AsyncSession": (".client.session", "AsyncSession"),
    "AsyncVariable": (".client.variables", "AsyncVariable"),
    "report_progress": (".observe.progress", "report_progress"),
}


def __getattr__(name: str) -> Any:
    entry = _LAZY.get(name)
    if entry is None:
        # a subpackage or module, as ``zf.cluster.resolve()`` (eager imports used to bind them all)
        if name.isidentifier() and not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            module = importlib.import_module(f".{name}", __name__)
            globals()[name] = module
            return module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(entry[0], __name__)
    value = module if entry[1] is None else getattr(module, entry[1])
    if name == "checkpoint":
        # zf.checkpoint also holds the directory watch (checkpoints_iterator, mark_final, ...): one
        # public namespace for checkpoints, as tf.train's, though the watch lives in a module of its own
        watch = importlib.import_module(".client.checkpoint_watch", __name__)
        for attr in watch.__all__:
            setattr(value, attr, getattr(watch, attr))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
