"""DLRM (Naumov et al., 2019), small: a bottom MLP over the dense features, one embedding bag per
categorical feature, the pairwise dot products of all those vectors, and a top MLP to a logit.

Where the tables live is the caller's choice: ``embedding_bag`` makes each one, so the same model
runs with ``torch.nn.EmbeddingBag`` in one process or with tables on ps shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ...errors import InvalidArgument
from ...torch.embedding import Embedding, EmbeddingBag, prefetch

__all__ = ["DLRM", "EmbeddingBagFactory", "torch_embedding_bag"]

# (feature index, rows, dim) -> a module called as ``bag(ids, offsets)`` returning (bags, dim).
EmbeddingBagFactory = Callable[[int, int, int], nn.Module]


def torch_embedding_bag(feature: int, rows: int, dim: int) -> nn.Module:
    """A local table with sparse gradients (only the rows a batch touched are updated)."""
    bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
    nn.init.uniform_(bag.weight, -0.05, 0.05)
    return bag


def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``forward(dense (B, D) float, sparse (B, K) int64) -> logits (B,)``; one id per feature
    per example (each a bag of one, as in Criteo)."""

    def __init__(self, vocab_sizes: Sequence[int], dense_features: int = 13, dim: int = 16,
                 bottom: Sequence[int] = (64,), top: Sequence[int] = (64, 32),
                 embedding_bag: EmbeddingBagFactory = torch_embedding_bag):
        super().__init__()
        if not vocab_sizes:
            raise InvalidArgument("DLRM needs at least one categorical feature")
        self.dim = dim
        self.bottom = _mlp([dense_features, *bottom, dim], last_relu=True)
        self.tables = nn.ModuleList(embedding_bag(f, rows, dim) for f, rows in enumerate(vocab_sizes))
        vectors = len(vocab_sizes) + 1
        pairs = vectors * (vectors - 1) // 2
        self.top = _mlp([dim + pairs, *top, 1], last_relu=False)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if sparse.dim() != 2 or sparse.shape[1] != len(self.tables) or sparse.shape[0] != dense.shape[0]:
            raise InvalidArgument(f"DLRM: sparse must be (batch, {len(self.tables)}) beside dense's "
                                  f"{dense.shape[0]} rows, got {tuple(sparse.shape)}")
        x = self.bottom(dense)
        offsets = torch.arange(sparse.shape[0], dtype=torch.int64)
        columns = [sparse[:, f].contiguous() for f in range(len(self.tables))]
        sharded = [(table, ids) for table, ids in zip(self.tables, columns)
                   if isinstance(table, (Embedding, EmbeddingBag))]
        if sharded:  # tables on the ps shards: every lookup at once, one request a shard
            prefetch(sharded)
        vectors = [x] + [table(ids, offsets) for table, ids in zip(self.tables, columns)]
        stacked = torch.stack(vectors, dim=1)  # (B, K + 1, dim)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)
