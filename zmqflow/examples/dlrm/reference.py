"""The yardstick: the same DLRM trained in one process with plain torch (tables in local memory,
Adam on the dense parameters, Adagrad on the touched embedding rows), on the same examples the
cluster sees, so the distributed run's AUC has something to be compared with."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from .data import ClickData, DataConfig, make_data, roc_auc
from .model import DLRM

__all__ = ["TrainConfig", "predict", "evaluate", "batches", "train_reference"]


@dataclass(frozen=True)
class TrainConfig:
    """One run's optimisation settings; ``batch`` is the global batch (all workers together)."""

    steps: int = 400
    batch: int = 1024
    dense_lr: float = 2e-3
    embedding_lr: float = 0.05
    dim: int = 16
    seed: int = 0


def predict(model: torch.nn.Module, data: ClickData, batch: int = 8192) -> np.ndarray:
    """Logits for every example of ``data``, without gradients."""
    out = []
    with torch.no_grad():
        for i in range(0, len(data), batch):
            out.append(model(torch.from_numpy(data.dense[i:i + batch]), torch.from_numpy(data.sparse[i:i + batch])))
    return torch.cat(out).numpy()


def evaluate(model: torch.nn.Module, data: ClickData) -> float:
    return roc_auc(data.labels, predict(model, data))


def batches(n: int, batch: int, steps: int, seed: int) -> "list[np.ndarray]":
    """Example indices for ``steps`` batches: passes over a fresh permutation each epoch."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    order = rng.permutation(n)
    at = 0
    for _ in range(steps):
        if at + batch > n:
            order, at = rng.permutation(n), 0
        out.append(order[at:at + batch])
        at += batch
    return out


def train_reference(train: ClickData, held_out: ClickData, vocab_sizes: "tuple[int, ...]",
                    config: TrainConfig = TrainConfig()) -> dict[str, float]:
    """Train one process's DLRM; its held-out AUC, samples/s and seconds."""
    torch.manual_seed(config.seed)
    model = DLRM(vocab_sizes, dim=config.dim)
    tables = [p for name, p in model.named_parameters() if name.startswith("tables.")]
    dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    dense_opt = torch.optim.Adam(dense, lr=config.dense_lr)
    sparse_opt = torch.optim.Adagrad(tables, lr=config.embedding_lr, initial_accumulator_value=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    for idx in batches(len(train), config.batch, config.steps, config.seed):
        b = train.batch(idx)
        loss = loss_fn(model(torch.from_numpy(b.dense), torch.from_numpy(b.sparse)), torch.from_numpy(b.labels))
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
    seconds = time.perf_counter() - start
    return {"auc": evaluate(model, held_out), "samples_per_s": config.steps * config.batch / seconds,
            "seconds": seconds}


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description="Train the DLRM demo's model in one process.")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch", type=int, default=TrainConfig.batch)
    parser.add_argument("--samples", type=int, default=DataConfig.samples)
    args = parser.parse_args(argv)
    torch.sparse.check_sparse_tensor_invariants.disable()  # said outright, so torch does not warn on every run
    torch.set_num_threads(1)  # one core each: threads fighting other processes for 2 cores cost 10x
    data_config = DataConfig(samples=args.samples)
    train, held_out = make_data(data_config)
    result = train_reference(train, held_out, data_config.vocab_sizes, TrainConfig(steps=args.steps, batch=args.batch))
    print(f"reference AUC {result['auc']:.3f}  {result['samples_per_s']:.0f} samples/s  "
          f"({result['seconds']:.1f} s; planted model's own AUC {roc_auc(held_out.labels, held_out.logits):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
