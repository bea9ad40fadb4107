"""Hybrid parallelism for recommendation models: embedding tables on the ps shards, everything
else replicated with its gradients averaged over the ring.

Why both: a model's tables are large (millions of rows) and each step touches few of their
rows, so they are best kept once, sharded, and updated sparsely by a server-side optimizer; its
dense layers are small and every step touches all of them, so each rank keeps a copy and the
ring averages their gradients. ``HybridStrategy`` is the one object that sets this up::

    zt.init()
    model = DLRM(...)                                    # torch.nn.EmbeddingBag tables
    hybrid = HybridStrategy(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                            embedding_optimizer=zf.optim.Adagrad(0.05))
    for batch in data:
        hybrid.zero_grad()
        loss_fn(model(...), y).backward()
        hybrid.step()
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgument
from ..state import init as zf_init
from . import collectives
from .embedding import Embedding, EmbeddingBag
from .optimizer import DistributedOptimizer

__all__ = ["HybridStrategy", "StepTimes"]


@dataclass
class StepTimes:
    """Seconds spent over ``steps`` steps: in the embedding tables (lookups, and waits for the
    previous step's pushes), waiting for the dense gradients' allreduce, and the rest (compute)."""

    steps: int = 0
    total_s: float = 0.0
    embedding_s: float = 0.0
    dense_comm_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return max(0.0, self.total_s - self.embedding_s - self.dense_comm_s)

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"step_ms": 1e3 * self.total_s / n, "compute_ms": 1e3 * self.compute_s / n,
                "embedding_ms": 1e3 * self.embedding_s / n, "dense_comm_ms": 1e3 * self.dense_comm_s / n}


class HybridStrategy:
    """Puts ``model``'s embedding tables on the ps shards and averages its other gradients by ring.

    Each ``torch.nn.EmbeddingBag`` of ``model`` is replaced by a ``zmqflow.torch.EmbeddingBag`` of
    the same shape and mode, named ``{prefix}{module path}`` on the cluster and updated by
    ``embedding_optimizer`` (a ``zmqflow.optim`` optimizer) on the shards; its local weight is
    dropped, from the model and from ``dense_optimizer``. Tables that already are
    ``zmqflow.torch.EmbeddingBag`` and ``Embedding`` modules are kept as they are (and pushed,
    flushed and timed as the placed ones). What remains, every
    ``nn.Parameter``, is wrapped in a ring ``DistributedOptimizer`` and broadcast from
    ``root_rank`` so every rank starts from the same weights. ``initializer`` (a ``zmqflow.init``
    initializer) fills new tables; by default each is N(0, 1) as torch's.

    ``backward_passes_per_step``: backward passes accumulated before each :meth:`step`. Above 1,
    the dense gradients are summed locally before their average, and the tables this strategy
    places hold their gradients (``push="step"``) until :meth:`step` pushes each table's sum, so the
    shards' optimizer runs once per step, as it would on one process.

    Call ``zmqflow.torch.init()`` first; every rank must build the same model and optimizers.
    """

    def __init__(self, model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer, embedding_optimizer: Any = None,
                 *, prefix: str = "", initializer: Any = None, root_rank: int = 0, backward_passes_per_step: int = 1):
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"HybridStrategy: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(dense_optimizer, torch.optim.Optimizer):
            raise InvalidArgument(f"HybridStrategy: dense_optimizer must be a torch.optim.Optimizer, "
                                  f"got {type(dense_optimizer).__name__}")
        self.model = model
        local = [(path, m) for path, m in model.named_modules() if isinstance(m, torch.nn.EmbeddingBag)]
        for path, table in local:  # refuse before changing anything: nothing is dropped in silence
            if table.max_norm is not None or table.padding_idx is not None or table.scale_grad_by_freq:
                raise InvalidArgument(f"HybridStrategy: table {path!r} uses max_norm, padding_idx or "
                                      "scale_grad_by_freq, which tables on ps shards do not support")
            if table.weight.dtype != torch.float32:
                raise InvalidArgument(f"HybridStrategy: table {path!r} is {table.weight.dtype}; tables on the ps "
                                      "shards it makes are float32")
        passes = backward_passes_per_step
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise InvalidArgument(f"HybridStrategy: backward_passes_per_step must be an integer >= 1, got {passes!r}")
        if local and dense_optimizer.state:
            raise InvalidArgument("HybridStrategy: dense_optimizer has already stepped; build the strategy before "
                                  "training")
        push = "step" if passes > 1 else "backward"
        dropped = self._place_tables(local, prefix, embedding_optimizer, initializer, push)
        for group in dense_optimizer.param_groups:  # the shards' optimizer updates the tables now
            group["params"] = [p for p in group["params"] if id(p) not in dropped]
        # every sharded module: those placed here and those the model already held (Embedding too)
        self.tables = [m for m in model.modules() if isinstance(m, (EmbeddingBag, Embedding))]
        self.optimizer = DistributedOptimizer(dense_optimizer, named_parameters=model.named_parameters(),
                                              backend="ring", backward_passes_per_step=passes)
        collectives.broadcast_parameters(model.state_dict(), root_rank=root_rank)
        self.times = StepTimes()
        self._in_tables = 0.0
        self._prefetched = sum(t.prefetch_s for t in self.tables)  # the tables' prefetch seconds counted so far
        self._entered: float | None = None
        for table in self.tables:
            table.register_forward_pre_hook(self._enter_table)
            table.register_forward_hook(self._leave_table)
        self._step_began = time.perf_counter()
        self._backward_wait = self.optimizer.buckets.wait_s

    # setting up ------------------------------------------------------------------------------
    def _place_tables(self, local: list[tuple[str, torch.nn.EmbeddingBag]], prefix: str, optimizer: Any,
                      initializer: Any, push: str) -> set[int]:
        """Swap each local table for a sharded one; the ids of the weights dropped."""
        dropped: set[int] = set()
        for path, old in local:
            name = f"{prefix}{path}"
            init = initializer
            if init is None:  # torch's N(0, 1), a seed of its own per table so tables differ
                init = zf_init.normal(stddev=1.0, seed=zlib.crc32(name.encode()))
            new = EmbeddingBag(name, old.num_embeddings, old.embedding_dim, mode=old.mode, optimizer=optimizer,
                               initializer=init, include_last_offset=old.include_last_offset, push=push)
            new.requires_grad_(old.weight.requires_grad)  # a frozen table stays frozen on the shards
            parent_path, _, attr = path.rpartition(".")
            setattr(self.model.get_submodule(parent_path), attr, new)
            dropped.add(id(old.weight))
        return dropped

    # timing ----------------------------------------------------------------------------------
    def _enter_table(self, module: torch.nn.Module, args: Any) -> None:
        self._entered = time.perf_counter()

    def _leave_table(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self._entered is not None:
            self._in_tables += time.perf_counter() - self._entered
            self._entered = None

    # training --------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)
        for table in self.tables:  # what tables that push at the step hold goes too
            table.zero_grad(set_to_none)

    def step(self) -> None:
        """Finish this step: start the push of what tables hold (``push="step"``), wait for the
        dense gradients' average, then update the dense parameters. (Tables that push at backward
        sent their sparse gradients already; the next lookup of each table waits for its pushes.)"""
        began = time.perf_counter()
        for table in self.tables:
            table.push_held()
        self.optimizer.synchronize()
        buckets = self.optimizer.buckets
        # backward itself waits for the last buckets when every gradient started them: counted here too
        waited = time.perf_counter() - began + buckets.wait_s - self._backward_wait
        self._backward_wait = buckets.wait_s
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        now = time.perf_counter()
        self.times.steps += 1
        self.times.total_s += now - self._step_began
        prefetched = sum(t.prefetch_s for t in self.tables)  # lookups started (and pushes awaited) before forward
        self.times.embedding_s += self._in_tables + prefetched - self._prefetched
        self.times.dense_comm_s += waited
        self._in_tables, self._prefetched = 0.0, prefetched
        self._step_began = now

    def reset_times(self) -> None:
        """Start the clocks again (after warm-up steps, say)."""
        self.times = StepTimes()
        self._in_tables = 0.0
        self._prefetched = sum(t.prefetch_s for t in self.tables)
        self._step_began = time.perf_counter()
        self._backward_wait = self.optimizer.buckets.wait_s

    def flush(self) -> None:
        """Wait until this rank's sparse gradients have landed on the shards."""
        began = time.perf_counter()
        for table in self.tables:
            table.flush()
        self.times.embedding_s += time.perf_counter() - began
