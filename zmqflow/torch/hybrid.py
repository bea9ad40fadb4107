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

Under mixed precision's loss scaling the loop is ``scaler.scale(loss).backward();
hybrid.step(scaler=scaler); scaler.update()``: the tables' gradients are unscaled at the step,
and a step that overflowed anywhere (dense, or any table on any rank) changes nothing, as
``GradScaler.step`` leaves a local model unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgument
from ..state import init as zf_init
from . import collectives
from .embedding import Embedding, EmbeddingBag
from .grouped import push_held_many
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
    initializer) fills new tables, each with a seed of its own made from the initializer's and the
    table's name, so tables differ as torch's drawn one after another do; by default N(0, 1) as torch's.

    The tables this strategy places hold their gradients (``push="step"``) until :meth:`step`
    pushes each table's sum, so the shards' optimizer runs once per step, as it would on one
    process, and a loss scaler's scale can be taken off first. ``backward_passes_per_step``:
    backward passes accumulated before each :meth:`step`; above 1, the dense gradients are summed
    locally before their average.

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
        dropped = self._place_tables(local, prefix, embedding_optimizer, initializer)
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
        # a one-value stand-in the loss scaler checks besides the dense optimizer: its gradient is
        # inf when a table overflowed, so scaler.update() lowers the scale for the tables too
        self._overflow = torch.nn.Parameter(torch.zeros(1))
        self._overflow_check = torch.optim.SGD([self._overflow], lr=0.0)

    # setting up ------------------------------------------------------------------------------
    def _place_tables(self, local: list[tuple[str, torch.nn.EmbeddingBag]], prefix: str, optimizer: Any,
                      initializer: Any) -> set[int]:
        """Swap each local table for a sharded one; the ids of the weights dropped."""
        dropped: set[int] = set()
        for path, old in local:
            name = f"{prefix}{path}"
            new = EmbeddingBag(name, old.num_embeddings, old.embedding_dim, mode=old.mode, optimizer=optimizer,
                               initializer=_table_initializer(initializer, name),
                               include_last_offset=old.include_last_offset, push="step")
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

    def step(self, scaler: Any = None) -> None:
        """Finish this step: start the push of what tables hold (``push="step"``), wait for the
        dense gradients' average, then update the dense parameters. (Tables that push at backward
        sent their sparse gradients already; the next lookup of each table waits for its pushes.)

        ``scaler``: the ``torch.amp.GradScaler`` whose ``scale(loss)`` backward ran on. The tables'
        gradients are divided by its scale, and when any gradient holds inf or NaN (dense, or a
        table's on any rank) neither the tables nor the dense parameters change; ``scaler.update()``,
        called after, then lowers the scale, as it does for a local model."""
        began = time.perf_counter()
        scaled = scaler is not None and scaler.is_enabled()
        if scaled:
            self._refuse_pushed_at_backward()
        else:  # every table's held gradients, one request a shard
            push_held_many([t.table for t in self.tables])
        self.optimizer.synchronize()
        buckets = self.optimizer.buckets
        # backward itself waits for the last buckets when every gradient started them: counted here too
        waited = time.perf_counter() - began + buckets.wait_s - self._backward_wait
        self._backward_wait = buckets.wait_s
        if scaled:
            self._step_scaled(scaler)
        else:
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

    def _refuse_pushed_at_backward(self) -> None:
        """A table the model brought that pushes at backward sent its gradient scaled already."""
        late = [t.name for t in self.tables if t.push == "backward" and t.push_gradients]
        if late:
            raise InvalidArgument(f"HybridStrategy.step(scaler=...): table(s) {', '.join(map(repr, late))} push at "
                                  "backward, where the loss scale cannot be taken off; make them with push=\"step\"")

    def _step_scaled(self, scaler: Any) -> None:
        """Unscale and push the tables and step the dense parameters, or skip all of it when any
        gradient overflowed; the scaler learns of the tables' overflow through ``_overflow``."""
        scale = scaler.get_scale()
        tables_ok = all(table.held_finite(scale) for table in self.tables)
        if collectives.size() > 1:  # every rank skips or none: the dense replicas stay equal
            overflowed = collectives.allreduce(torch.tensor([0.0 if tables_ok else 1.0]), op=collectives.Max)
            tables_ok = not bool(overflowed.item())
        self._overflow.grad = torch.full_like(self._overflow, 0.0 if tables_ok else math.inf)
        scaler.unscale_(self._overflow_check)
        dense_ok = _finite([p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None])
        if tables_ok and dense_ok:
            push_held_many([t.table for t in self.tables], scale=scale)
        else:
            for table in self.tables:
                table.skip_held()
        if tables_ok:  # the scaler skips the dense step itself when a dense gradient overflowed
            with self.optimizer.skip_synchronize():
                scaler.step(self.optimizer)

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
        push_held_many([t.table for t in self.tables])
        for table in self.tables:
            table.synchronize()
        self.times.embedding_s += time.perf_counter() - began


def _table_initializer(initializer: Any, name: str) -> Any:
    """The initializer of table ``name``: torch's N(0, 1) by default; a random one given gets a
    seed made from its own and the name, so tables of one shape differ and a run stays the same."""
    if initializer is None:
        return zf_init.normal(stddev=1.0, seed=zlib.crc32(name.encode()))
    init = zf_init.from_spec(initializer)
    if init.kind == "constant":  # nothing drawn: no seed to vary
        return init
    return dataclasses.replace(init, seed=init.seed ^ zlib.crc32(name.encode()))


def _finite(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is free of inf and NaN (one device sync for them all)."""
    checks = [torch.isfinite(g.coalesce().values() if g.is_sparse else g).all() for g in grads]
    return bool(torch.stack([c.to(checks[0].device) for c in checks]).all()) if checks else True
