"""PyTorch on zmqflow, shaped like Horovod's ``horovod.torch``.

::

    import zmqflow.torch as zt
    zt.init()                                   # the cluster `zmqflow launch` gives, or a private one
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    zt.broadcast_parameters(model.state_dict(), root_rank=0)
    zt.broadcast_optimizer_state(opt, root_rank=0)

Collectives (``allreduce``, ``allgather``, ``broadcast``, ...) run on the ring of every rank;
``DistributedOptimizer`` averages gradients over that ring in buckets overlapped with backward
(``backend='ring'``) or keeps the parameters on the ps shards (``backend='ps'``).
``EmbeddingBag``/``Embedding`` are modules whose tables live sharded on the ps tasks (``prefetch``
starts several tables' lookups in one request a shard);
``HybridStrategy`` puts a model's tables there and averages the rest by ring.
"""

from .collectives import (
    Average,
    Handle,
    Max,
    Min,
    Sum,
    allgather,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    synchronize,
)
from ..observe.progress import report_progress
from .embedding import Embedding, EmbeddingBag, prefetch
from .hybrid import HybridStrategy
from .optimizer import DistributedOptimizer

__all__ = [
    "Average", "Sum", "Min", "Max", "Handle", "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
    "local_size", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "broadcast",
    "broadcast_", "broadcast_object", "broadcast_parameters", "broadcast_optimizer_state", "barrier", "synchronize",
    "DistributedOptimizer", "EmbeddingBag", "Embedding", "prefetch", "HybridStrategy", "report_progress",
]
