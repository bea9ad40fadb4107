"""Train the DLRM on the synthetic click log with hybrid parallelism: tables on the ps shards,
dense gradients averaged by ring (``zmqflow.torch.hybrid.HybridStrategy``). Run on every rank by
``zmqflow demo --model dlrm`` (or ``zmqflow launch --workers 2 --ps 2 -- python -m
zmqflow.examples.dlrm.train``); alone, it makes a private cluster of itself and one ps. Rank 0
then reports the held-out AUC, samples/s and the step time split, and trains the same model in
plain torch in one process for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib

import torch

import zmqflow.torch as zt
from zmqflow import init as zf_init
from zmqflow import optim as zf_optim
from zmqflow.torch.hybrid import HybridStrategy

from .data import DataConfig, make_data, roc_auc
from .model import DLRM
from .reference import TrainConfig, batches, evaluate, train_reference

__all__ = ["main"]


def progress(step: int, total: int, loss: float, shown: list[int]) -> None:
    """A text progress bar every 10% (the launcher tags each line with its task, so no ``\\r``)."""
    pct = 100 * step // total
    if pct >= shown[0] or step == total:
        filled = pct // 5
        print(f"[{'#' * filled}{'.' * (20 - filled)}] {pct:3d}%  step {step}/{total}  loss {loss:.4f}", flush=True)
        shown[0] = (pct // 10 + 1) * 10


def summary(r: dict) -> str:
    """The lines the demo ends with; the first starts with ``AUC``."""
    ref = f"{r['reference_auc']:.3f}" if r.get("reference_auc") is not None else "not run"
    return (f"AUC {r['auc']:.3f} on {r['held_out']} held-out examples (single-process torch reference: {ref}; "
            f"the planted model's own: {r['planted_auc']:.3f})\n"
            f"{r['samples_per_s']:.0f} samples/s over {r['workers']} workers and {r['ps']} ps shards, "
            f"{r['step_ms']:.1f} ms/step = {r['compute_ms']:.1f} compute + {r['embedding_ms']:.1f} embedding "
            f"+ {r['dense_comm_ms']:.1f} dense communication"
            + (f"; the reference: {r['reference_samples_per_s']:.0f} samples/s" if r.get("reference_auc") else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch", type=int, default=TrainConfig.batch, help="global batch (all workers together)")
    parser.add_argument("--samples", type=int, default=DataConfig.samples, help="training examples generated")
    parser.add_argument("--held-out", type=int, default=DataConfig.held_out)
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process torch reference")
    parser.add_argument("--result", help="rank 0 writes its results (JSON) here")
    parser.add_argument("--quiet", action="store_true", help="no summary lines (the demo prints them from --result)")
    args = parser.parse_args(argv)
    torch.sparse.check_sparse_tensor_invariants.disable()  # said outright, so torch does not warn on every run
    torch.set_num_threads(1)  # one core per rank: threads fighting the other processes cost far more than they win
    data_config = DataConfig(samples=args.samples, held_out=args.held_out)
    train_config = TrainConfig(steps=args.steps, batch=args.batch)

    runtime = zt.init()
    rank, size = zt.rank(), zt.size()
    if args.batch % size:
        sys.exit(f"--batch {args.batch} does not split evenly over {size} workers")
    train, held_out = make_data(data_config)
    mine = train.shard(rank, size)
    torch.manual_seed(train_config.seed)
    model = DLRM(data_config.vocab_sizes, dim=train_config.dim)
    hybrid = HybridStrategy(
        model, torch.optim.Adam(model.parameters(), lr=train_config.dense_lr),
        embedding_optimizer=zf_optim.Adagrad(train_config.embedding_lr), prefix="dlrm/",
        initializer=zf_init.uniform(-0.05, 0.05, seed=zlib.crc32(b"dlrm")))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    shown = [10]
    for step, idx in enumerate(batches(len(mine), args.batch // size, args.steps, train_config.seed + rank), 1):
        b = mine.batch(idx)
        hybrid.zero_grad()
        loss = loss_fn(model(torch.from_numpy(b.dense), torch.from_numpy(b.sparse)), torch.from_numpy(b.labels))
        loss.backward()
        hybrid.step()
        if rank == 0:
            progress(step, args.steps, loss.item(), shown)
    hybrid.flush()
    times = hybrid.times
    zt.barrier()  # every rank's last sparse gradients have landed before rank 0 reads the tables
    if rank == 0:
        model.eval()
        result = {"auc": evaluate(model, held_out), "held_out": len(held_out), "workers": size,
                  "ps": runtime.spec.num_tasks("ps"),
                  "planted_auc": roc_auc(held_out.labels, held_out.logits), "steps": args.steps,
                  "batch": args.batch, "samples_per_s": args.steps * args.batch / max(times.total_s, 1e-9),
                  **times.per_step_ms(), "reference_auc": None}
    zt.barrier()  # the others wait while rank 0 reads the tables, then leave
    if rank != 0:
        zt.shutdown()
        return 0
    zt.shutdown()
    if not args.no_reference:
        began = time.perf_counter()
        print("training the single-process torch reference on the same examples...", flush=True)
        ref = train_reference(train, held_out, data_config.vocab_sizes, train_config)
        result.update(reference_auc=ref["auc"], reference_samples_per_s=ref["samples_per_s"],
                      reference_s=time.perf_counter() - began)
    result["summary"] = summary(result)
    if args.result:
        with open(args.result, "w") as fh:
            json.dump(result, fh)
    if not args.quiet:
        print(result["summary"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
