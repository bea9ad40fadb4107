"""A synthetic click log shaped like Criteo's: 13 count-valued dense features and categorical
features whose ids follow Zipf's law over vocabularies from tens to a million rows.

Labels come from a planted logistic model, so a recommendation model has something real to
find, and how much it finds is measurable (held-out AUC): a bias, weights on the (log) dense
features, a hidden effect per id on most categorical features, and one pairwise interaction
between two features' hidden id vectors (what DLRM's dot interaction is for). The same seed
gives the same bytes in every process, so each worker builds the data itself and takes its own
shard instead of receiving it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import InvalidArgument

__all__ = ["DataConfig", "ClickData", "make_data", "roc_auc", "DENSE_FEATURES"]

DENSE_FEATURES = 13


@dataclass(frozen=True)
class DataConfig:
    """What to generate. The default vocabularies make two tables big enough (1M and 200k rows)
    that keeping them on ps shards, not replicated on every worker, is the point."""

    samples: int = 400_000
    held_out: int = 50_000
    vocab_sizes: tuple[int, ...] = (1_000_000, 200_000, 50_000, 10_000, 2_000, 500, 100, 20)
    zipf: float = 1.1  # ids drawn with P(rank r) ~ 1 / r**zipf
    effect_scale: float = 0.8  # std of the hidden per-id effects on the logit
    interaction_pair: tuple[int, int] = (2, 4)  # the features whose hidden vectors interact
    interaction_dim: int = 4
    interaction_scale: float = 0.9
    dense_scale: float = 0.35
    seed: int = 0
    effect_features: tuple[int, ...] | None = None  # features with a hidden per-id effect; None: all

    def __post_init__(self) -> None:
        if self.samples < 1 or self.held_out < 1:
            raise InvalidArgument(f"DataConfig: samples ({self.samples}) and held_out ({self.held_out}) must be >= 1")
        if not self.vocab_sizes or min(self.vocab_sizes) < 2:
            raise InvalidArgument(f"DataConfig: every vocabulary needs at least 2 ids, got {self.vocab_sizes}")
        k = len(self.vocab_sizes)
        bad = [f for f in (*(self.effect_features or ()), *self.interaction_pair) if not 0 <= f < k]
        if bad:
            raise InvalidArgument(f"DataConfig: features {bad} are outside the {k} categorical features")


@dataclass
class ClickData:
    """One split: ``dense`` (n, 13) float32 already log1p'd, ``sparse`` (n, K) int64 ids (one per
    feature, as Criteo has), ``labels`` (n,) float32 clicks, and the planted ``logits``."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    logits: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def shard(self, index: int, count: int) -> "ClickData":
        """Every ``count``-th example from ``index``: a worker's own part of the training split."""
        if not 0 <= index < count:
            raise InvalidArgument(f"shard {index} of {count} does not exist")
        s = slice(index, None, count)
        return ClickData(self.dense[s], self.sparse[s], self.labels[s], self.logits[s])

    def batch(self, idx: np.ndarray | slice) -> "ClickData":
        return ClickData(self.dense[idx], self.sparse[idx], self.labels[idx], self.logits[idx])


def _zipf_ids(rng: np.random.Generator, vocab: int, n: int, s: float) -> np.ndarray:
    """``n`` ids in [0, vocab) by a truncated Zipf law, the popular ids scattered over the range
    (a fixed permutation), as hashed categorical values are."""
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -s)
    cdf /= cdf[-1]
    drawn = np.minimum(np.searchsorted(cdf, rng.random(n)), vocab - 1)
    return rng.permutation(vocab)[drawn].astype(np.int64)


def make_data(config: DataConfig = DataConfig()) -> tuple[ClickData, ClickData]:
    """(train, held_out), the same for the same ``config`` in any process."""
    rng = np.random.default_rng(config.seed)
    n = config.samples + config.held_out
    k = len(config.vocab_sizes)
    # Dense: counts with long tails, as Criteo's integer features are; models see log1p(count).
    scale = rng.uniform(0.5, 2.0, DENSE_FEATURES)
    counts = np.floor(np.exp(rng.normal(0.0, 1.0, (n, DENSE_FEATURES)) * scale + scale))
    dense = np.log1p(counts)
    sparse = np.empty((n, k), dtype=np.int64)
    for f, vocab in enumerate(config.vocab_sizes):
        sparse[:, f] = _zipf_ids(rng, vocab, n, config.zipf)
    # The planted model.
    centred = (dense - dense.mean(0)) / dense.std(0)
    logit = centred @ (rng.normal(0.0, config.dense_scale, DENSE_FEATURES))
    logit += config.dense_scale * centred[:, 0] * centred[:, 1]  # a dense interaction, for the bottom MLP
    for f in range(k) if config.effect_features is None else config.effect_features:
        logit += rng.normal(0.0, config.effect_scale, config.vocab_sizes[f])[sparse[:, f]]
    a, b = config.interaction_pair
    d = config.interaction_dim
    ua = rng.normal(0.0, 1.0, (config.vocab_sizes[a], d))[sparse[:, a]]
    ub = rng.normal(0.0, 1.0, (config.vocab_sizes[b], d))[sparse[:, b]]
    logit += config.interaction_scale * (ua * ub).sum(1) / np.sqrt(d)
    logit -= np.median(logit) + 1.0  # clicks are the minority (about 40%)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    cut = config.samples
    parts = (dense.astype(np.float32), sparse, labels, logit.astype(np.float32))
    return ClickData(*(p[:cut] for p in parts)), ClickData(*(p[cut:] for p in parts))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by ranks (the Mann-Whitney statistic), ties given their mean
    rank: the chance a random click scores above a random non-click."""
    labels = np.asarray(labels).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if labels.shape != scores.shape:
        raise InvalidArgument(f"roc_auc: {labels.shape[0]} labels but {scores.shape[0]} scores")
    pos = labels > 0.5
    n_pos = int(pos.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise InvalidArgument("roc_auc needs both clicks and non-clicks among the labels")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Mean rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    mean_rank = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
