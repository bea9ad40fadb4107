"""``EmbeddingBag`` and ``Embedding`` whose tables live sharded on the ps tasks.

Called as ``torch.nn.EmbeddingBag``/``torch.nn.Embedding`` are, they hold no local copy of the
table. A forward fetches the rows of the batch's *unique* ids only, one request per shard that owns
some of them, into a small tensor ``rows`` [n_unique, dim], and computes the result with
``F.embedding_bag`` / ``F.embedding`` over the inverse indices. The gradient autograd computes for
``rows`` is therefore already summed per unique id: backward sends it to the shards as a sparse
gradient, where the table's server-side optimizer (``zmqflow.optim``) applies it, as on any
parameter server (each rank's gradient as pushed, not divided by the number of ranks).

The one parameter, ``trainable``, has no elements: it is the table's switch, so that every way
torch freezes a model reaches the table (``model.requires_grad_(False)``, or ``requires_grad =
False`` on each of its parameters): then backward pushes nothing. ``rows`` is made from it, so it
gets an (empty) gradient whenever the table trains, as DDP expects of every parameter in use; an
optimizer's step over it changes nothing.

By default (``push="backward"``) each backward pass through a table pushes its gradient then, as
a parameter server's async workers do (and as torchrec's optimizer fused into backward does): it
is applied on the shards without waiting for ``optimizer.step()``. So gradient accumulation over
several backward passes applies each pass's gradient as it comes (the next pass reads rows the
last one moved), a module called twice in a step is updated twice, ``clip_grad_norm_`` over
``model.parameters()`` does not reach the table's gradient, and ``torch.autograd.grad`` through a
table pushes too (detach the rows, or freeze the table, to probe gradients). The push runs in the
background: backward returns at once.

With ``push="step"`` backward holds each pass's gradient in this process instead, and
``push_held()`` (``HybridStrategy.step()`` calls it) sends what was held as one push of the sum:
accumulated passes all read the rows as the last step left them, and the shards apply their
optimizer once per step, as a local table under gradient accumulation. A ``zero_grad()`` that
drops the table's switch gradient (the model's or an optimizer's, ``set_to_none`` as torch's
default) drops what is held, seen at the table's next forward.

Mixed precision: under loss scaling (``torch.amp.GradScaler``) backward gives the table the
gradient of the scaled loss, which only the step can unscale, and which overflows to inf now and
then. So a table under a scaler pushes at the step: ``push_held(scale=scaler.get_scale())``
divides the held sum by the scale and skips a step that overflowed; the dense step, and the
scaler's back-off when only a table overflowed, are then the caller's (``HybridStrategy.step(
scaler=scaler)`` does all of it, for every table, as ``GradScaler.step`` does for a local model). No
table ever sends a gradient holding inf or NaN to the shards: one that ``push="backward"`` (or
``push_held()`` without a scale) would send is dropped and raised as ``InvalidArgument``.

The next forward of the table (from any module of this session), ``synchronize()``, ``flush()``
(which first starts the push of what is held), ``weight``, ``export()``, ``size()`` and
``evict()`` first wait for this process's pushes, so a session reads its own writes, and an error of
a background push is raised there.

Tables are variables like any other: ``zmqflow.checkpoint`` saves and restores them (call
``flush()`` before saving so the checkpoint holds this process's last step).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..bridge import runtime
from ..client.blocking import Session
from ..errors import InvalidArgument
from ..state import init as zf_init
from .grouped import lookup_many_async
from .sharded import ShardedTable

__all__ = ["EmbeddingBag", "Embedding", "MODES", "prefetch"]

MODES = ("sum", "mean", "max")
PUSH_AT = ("backward", "step")  # when a table's gradients go to the shards
_DTYPES = {torch.float16: np.dtype("float16"), torch.float32: np.dtype("float32"), torch.float64: np.dtype("float64")}


def _default_session() -> Session:
    """The process-wide runtime's session (``zmqflow.bridge.runtime.init()`` if not yet joined)."""
    return runtime.init().session


class _ShardedModule(torch.nn.Module):
    """What both modules share: the table, the lookup of unique rows, and the push of their gradient."""

    kind = "embedding"

    def __init__(self, name: str, num_embeddings: int | None, embedding_dim: int, optimizer: Any = None, *,
                 initializer: Any = None, dtype: torch.dtype = torch.float32, partitions: Any = None,
                 partition_strategy: str = "mod", min_frequency: int = 1, capacity: int | None = None,
                 session: Session | None = None, push: str = "backward"):
        super().__init__()
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{self.kind}: name must be a non-empty string, got {name!r}")
        if push not in PUSH_AT:
            raise InvalidArgument(f"{self.kind} {name!r}: push must be one of {', '.join(PUSH_AT)}, got {push!r}")
        if dtype not in _DTYPES:
            raise InvalidArgument(f"{self.kind} {name!r}: dtype must be one of {', '.join(map(str, _DTYPES))}, got {dtype}")
        if initializer is None:  # torch's nn.Embedding init, N(0, 1); seeded by the name so every rank agrees
            initializer = zf_init.normal(stddev=1.0, seed=zlib.crc32(name.encode()))
        self.table = ShardedTable.open(
            session if session is not None else _default_session(), name, num_embeddings, embedding_dim,
            dtype=_DTYPES[dtype], initializer=initializer, optimizer=optimizer, partitions=partitions,
            partition_strategy=partition_strategy, min_frequency=min_frequency, capacity=capacity)
        self.name = name
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.push = push
        self.trainable = torch.nn.Parameter(torch.empty(0, dtype=dtype))
        # a state dict holds no switch (nothing to keep: it has no value), as it held nothing before
        self.register_state_dict_post_hook(_drop_switch)
        self.register_load_state_dict_pre_hook(_add_switch)
        self._prefetched: tuple[torch.Tensor, np.ndarray, torch.Tensor, Any] | None = None
        self.prefetch_s = 0.0  # seconds spent in prefetch(): embedding time outside forward

    # the table -----------------------------------------------------------------------------
    @property
    def session(self) -> Session:
        return self.table.session

    @property
    def partitions(self) -> list[dict[str, Any]]:
        """Each part's task and rows."""
        return self.table.handle.partitions

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The spec of the optimizer the shards apply to pushed gradients."""
        return self.table.optimizer

    @property
    def counters(self) -> dict[str, int]:
        """This module's traffic: lookups, unique ids looked up, pushes, ids pushed, rows the shards
        updated, and pushes skipped (gradients holding inf or NaN, never sent)."""
        return dict(self.table.counters)

    @property
    def pending_pushes(self) -> int:
        """Background pushes of this table not finished yet."""
        return len(self.table.pending)

    @property
    def held_passes(self) -> int:
        """Backward passes whose gradients are held for :meth:`push_held` (``push="step"``)."""
        return self.table.held

    def synchronize(self) -> None:
        """Wait until this process's pushes to the table have landed; raise what any of them raised."""
        self.table.synchronize()

    def push_held(self, scale: float | None = None) -> int:
        """Start one push of the gradients backward held (``push="step"``), their sum, without
        waiting for it; the passes it carries (0 when none was held). Under loss scaling pass
        ``scale=scaler.get_scale()``: the sum is divided by it, and a step whose gradients hold
        inf or NaN is skipped (dropped, counted in ``counters["pushes_skipped"]``, 0 returned)."""
        return self.table.push_held(scale)

    def held_finite(self, scale: float = 1.0) -> bool:
        """Whether the held gradients divided by ``scale`` are all finite: a step that pushes
        several tables decides to skip them all before pushing any."""
        return self.table.held_finite(scale)

    def skip_held(self) -> int:
        """Drop the held gradients of a step skipped for an overflow elsewhere (another table, or
        the dense gradients); the passes dropped."""
        return self.table.skip_held()

    def flush(self) -> None:
        """Push what is held, then wait until every push of this process has landed."""
        self.table.push_held()
        self.table.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients held for the next push, as local gradients are dropped."""
        self.table.drop_held()
        super().zero_grad(set_to_none)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table of a static table, read from the shards (detached; it costs
        ``num_embeddings * dim`` values over the network: for small tables and tests)."""
        return torch.from_numpy(self.table.read_all())

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` (any shape), detached, creating no rows of a dynamic table."""
        flat = self._ids(ids)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        rows = torch.from_numpy(self.table.lookup(uniq.cpu().numpy(), create=False)).to(ids.device)
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def export(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(ids, rows)`` pages of every row held, shard by shard (dynamic tables too)."""
        for ids, rows in self.table.export():
            yield torch.from_numpy(ids), torch.from_numpy(rows)

    def size(self) -> int:
        """Rows held over all shards (a dynamic table grows as it admits ids)."""
        return self.table.size()

    def evict(self, older_than: Any = None, **kwargs: Any) -> int:
        """Drop rows of a dynamic table not updated in the last N pushes or for a while; see
        ``AsyncEmbedding.evict``."""
        return self.table.evict(older_than, **kwargs)

    @property
    def push_gradients(self) -> bool:
        """Whether backward pushes this table's gradients: its ``trainable`` switch requires grad."""
        return self.trainable.requires_grad

    # forward machinery ---------------------------------------------------------------------
    def _ids(self, ids: Any) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise InvalidArgument(f"{self.kind} {self.name!r}: ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidArgument(f"{self.kind} {self.name!r}: ids must be integers, got {ids.dtype}")
        return ids.reshape(-1).long()

    def prefetch(self, input: torch.Tensor) -> None:
        """Start fetching the rows ``forward(input)`` (this very tensor) will need, and return: a
        model with several tables prefetches each before the first forward, so their lookups
        travel at once instead of one round trip after another (or in one request a shard, with
        the module-level :func:`prefetch` of them all). It waits for the table's pending pushes first."""
        prefetch([(self, input)])

    @torch.compiler.disable  # network calls and numpy: outside any compiled graph, run eagerly
    def _unique(self, flat: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """(the unique ids, checked against the table's range, as numpy; the inverse indices)."""
        uniq, inverse = torch.unique(flat, return_inverse=True)  # sorted: the ends are the extremes
        num = self.num_embeddings
        if num is not None and len(uniq) and (int(uniq[0]) < 0 or int(uniq[-1]) >= num):
            bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
            raise InvalidArgument(f"{self.kind} {self.name!r}: id {bad} out of range [0, {num})")
        return uniq.cpu().numpy(), inverse

    @torch.compiler.disable
    def _rows(self, flat: torch.Tensor, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the unique ids, requiring grad when a backward should push; inverse indices).
        The rows come in the switch's dtype, so a model cast with ``.to(torch.bfloat16)`` computes
        in it; their gradient goes back to the table in the table's own."""
        pre, self._prefetched = self._prefetched, None
        if pre is not None and pre[0] is input:  # prefetched for this tensor: its lookup is under way
            _, ids, inverse, fut = pre
            found = self.table.result(fut)
        else:
            ids, inverse = self._unique(flat)
            found = self.table.lookup(ids, create=self.training)
        rows = torch.from_numpy(found).to(flat.device)
        if self.push == "step" and self.trainable.grad is None and self.table.held:
            # the switch's gradient is gone since the last backward: the model's or an optimizer's
            # zero_grad() dropped that step's gradients, so what is held for the push goes too
            self.table.drop_held()
        if self.trainable.requires_grad and torch.is_grad_enabled():  # a batch with no ids too: DDP
            # expects the switch used
            return _PushRows.apply(self.trainable, rows, self.table, ids, self.push == "step"), inverse
        return rows.to(self.trainable.dtype), inverse

    def extra_repr(self) -> str:
        size = "dynamic" if self.num_embeddings is None else str(self.num_embeddings)
        kind = self.optimizer.get("kind") if self.optimizer else None
        return f"{self.name!r}, {size}, {self.embedding_dim}, parts={len(self.partitions)}, optimizer={kind}"


class _PushRows(torch.autograd.Function):
    """``rows`` as a function of the table's switch: backward sends their gradient to the shards
    (in the background) and gives the switch its empty one."""

    @staticmethod
    def forward(ctx: Any, switch: torch.Tensor, rows: torch.Tensor, table: ShardedTable,
                ids: np.ndarray, hold: bool) -> torch.Tensor:
        ctx.table, ctx.ids, ctx.switch, ctx.rows_dtype = table, ids, (switch.dtype, switch.device), rows.dtype
        ctx.hold = hold
        return rows.to(switch.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if len(ctx.ids):  # a copy: autograd may accumulate into this gradient in place while the push is queued
            rows = grad.detach().to(ctx.rows_dtype).cpu().numpy().copy()
            if ctx.hold:
                ctx.table.hold(ctx.ids, rows)
            else:
                ctx.table.push_async(ctx.ids, rows)
        dtype, device = ctx.switch
        return torch.empty(0, dtype=dtype, device=device), None, None, None, None


def prefetch(pairs: Iterable[tuple[torch.nn.Module, torch.Tensor]]) -> None:
    """``module.prefetch(input)`` for each pair, their lookups grouped: one request a shard for
    them all, not one a table (a model's tables, before its forward). Each module's next forward
    of that very tensor then takes its rows, as after its own ``prefetch``."""
    pairs = list(pairs)
    bad = next((m for m, _ in pairs if not isinstance(m, _ShardedModule)), None)
    if bad is not None:
        raise InvalidArgument(f"prefetch: {type(bad).__name__} is not a table on the ps shards (EmbeddingBag, "
                              "Embedding)")
    began = time.perf_counter()
    uniques = [m._unique(m._ids(x)) for m, x in pairs]
    for create in (True, False):  # a module in training makes rows, in eval it does not
        chosen = [k for k, (m, _) in enumerate(pairs) if m.training == create]
        futures = lookup_many_async([pairs[k][0].table for k in chosen], [uniques[k][0] for k in chosen], create)
        for k, fut in zip(chosen, futures):
            module, x = pairs[k]
            module._prefetched = (x, uniques[k][0], uniques[k][1], fut)
    spent = (time.perf_counter() - began) / max(len(pairs), 1)
    for module, _ in pairs:  # the lookups were started together: each table's share of the time
        module.prefetch_s += spent


def _drop_switch(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    state_dict.pop(prefix + "trainable", None)


def _add_switch(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    state_dict.setdefault(prefix + "trainable", torch.empty(0, dtype=module.trainable.dtype))


class EmbeddingBag(_ShardedModule):
    """``torch.nn.EmbeddingBag`` over a table on the ps shards.

    ``num_embeddings=None`` makes a dynamic table: any int64 id, a row created on first lookup in
    training mode (after ``min_frequency`` sightings; in eval mode unknown ids read zeros and create
    nothing), at most ``capacity`` rows per shard with least-recently-used eviction (``evict()``
    drops stale rows). ``optimizer`` is a server-side ``zmqflow.optim`` optimizer (SGD, Momentum,
    Adagrad, Adam: all apply to the pushed rows only, Adam lazily); ``None`` takes the existing
    table's (or that of one another process is creating), or SGD(0.01) when this creates it.
    ``initializer`` is a ``zmqflow.init`` initializer, by default N(0, 1) as torch's.
    ``partitions`` (parts, one per ps shard by default, or a partitioner) and ``partition_strategy``
    ("mod" or "div") place a static table's rows as TF's ``embedding_lookup`` does. ``session``
    defaults to the process-wide runtime's. ``push``: ``"backward"`` sends each backward pass's
    gradient at once, ``"step"`` holds them for ``push_held()`` (gradient accumulation, loss
    scaling; see the module's docstring).
    """

    kind = "EmbeddingBag"

    def __init__(self, name: str, num_embeddings: int | None, embedding_dim: int, mode: str = "mean",
                 optimizer: Any = None, *, include_last_offset: bool = False, **kwargs: Any):
        if mode not in MODES:
            raise InvalidArgument(f"EmbeddingBag {name!r}: mode must be one of {', '.join(MODES)}, got {mode!r}")
        super().__init__(name, num_embeddings, embedding_dim, optimizer, **kwargs)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """2-D ``input`` (bags of equal length) or 1-D ``input`` with ``offsets`` (each bag's start)."""
        flat = self._ids(input)
        if input.dim() == 2:
            if offsets is not None:
                raise InvalidArgument(f"EmbeddingBag {self.name!r}: offsets must be None when input is 2-D "
                                      f"(bags of equal length), got offsets of shape {list(offsets.shape)}")
            bags, length = input.shape
            offsets = torch.arange(bags + int(self.include_last_offset), device=input.device) * length
        elif input.dim() == 1:
            self._check_offsets(offsets, len(flat))
        else:
            raise InvalidArgument(f"EmbeddingBag {self.name!r}: input must be 2-D (bags of equal length) or 1-D "
                                  f"with offsets, got shape {list(input.shape)}")
        weights = self._check_weights(per_sample_weights, input)
        rows, inverse = self._rows(flat, input)
        return F.embedding_bag(inverse, rows, offsets, mode=self.mode, per_sample_weights=weights,
                               include_last_offset=self.include_last_offset)

    def _check_offsets(self, offsets: Any, n: int) -> None:
        where = f"EmbeddingBag {self.name!r}"
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
            got = list(offsets.shape) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
            raise InvalidArgument(f"{where}: 1-D input needs offsets, a 1-D tensor of each bag's start; got {got}")
        if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
            raise InvalidArgument(f"{where}: offsets must be integers, got {offsets.dtype}")
        if self.include_last_offset and len(offsets) == 0:
            raise InvalidArgument(f"{where}: with include_last_offset, offsets needs at least one entry")
        if len(offsets):
            if int(offsets[0]) != 0:
                raise InvalidArgument(f"{where}: offsets[0] must be 0 (the first bag starts at the first id), got {int(offsets[0])}")
            if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > n:
                raise InvalidArgument(f"{where}: offsets must be non-decreasing and at most the input's length ({n})")

    def _check_weights(self, weights: Any, input: torch.Tensor) -> torch.Tensor | None:
        if weights is None:
            return None
        where = f"EmbeddingBag {self.name!r}"
        if self.mode != "sum":
            raise InvalidArgument(f"{where}: per_sample_weights need mode='sum' (as torch's), the mode is {self.mode!r}")
        if not isinstance(weights, torch.Tensor) or weights.shape != input.shape:
            got = list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise InvalidArgument(f"{where}: per_sample_weights must have the input's shape {list(input.shape)}, got {got}")
        if weights.dtype != self.trainable.dtype:
            raise InvalidArgument(f"{where}: per_sample_weights must be {self.trainable.dtype} (the module's dtype), "
                                  f"got {weights.dtype}")
        return weights.reshape(-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"


class Embedding(_ShardedModule):
    """``torch.nn.Embedding`` over a table on the ps shards: ``forward(ids)`` gives rows of shape
    ``ids.shape + (embedding_dim,)``. Options as :class:`EmbeddingBag`'s."""

    kind = "Embedding"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = self._ids(ids)
        rows, inverse = self._rows(flat, ids)
        return F.embedding(inverse.reshape(ids.shape), rows)
