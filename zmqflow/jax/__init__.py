"""JAX on zmqflow: collectives over pytrees, a gradient-averaging optax transformation, embeddings.

Install with ``pip install 'zmqflow[jax]'``; the core package never imports JAX.

    import optax, zmqflow.jax as zf_jax
    zf_jax.init()                                   # under `zmqflow launch`, or alone
    params = zf_jax.broadcast(params, root=0)       # every rank starts from rank 0's weights
    opt = optax.chain(zf_jax.distributed_gradients(), optax.sgd(0.1))
"""

from .collectives import (OPS, allgather, allreduce, barrier, broadcast, init, is_initialized, local_rank,
                          local_size, rank, shutdown, size)
from ..observe.progress import report_progress
from .embedding import Embedding, lookup_many, push_many
from .gradients import DistributedGradients, GradientTransformation, distributed_gradients

__all__ = ["OPS", "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "allreduce", "broadcast", "allgather", "barrier",
           "distributed_gradients", "DistributedGradients", "GradientTransformation", "Embedding", "lookup_many",
           "push_many", "report_progress"]
