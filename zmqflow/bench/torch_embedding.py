"""Torch embedding benchmark: ``zmqflow.torch.embedding.EmbeddingBag`` training steps beside torch's own.

A step is a forward of a batch of bags of Zipf-distributed ids (a few hot rows, a long tail), a
backward, and the sparse update: for zmqflow the rows of the batch's unique ids are looked up on,
and their gradient pushed (SGD) to, a table spread over 2 ps shards, each a separate process on tcp
loopback; the push runs in the background and the next step's lookup waits for it, so the timed
steps include every lookup and push. Beside it, in the same run and on the same ids: a local
``torch.nn.EmbeddingBag(sparse=True)`` with ``torch.optim.SGD``, the same work without a network.
The timed steps run in rounds, the two alternating, who goes first flipping every round, so both
see the same machine. Rows/s counts the ids in the batches (with repeats), as torch's own
throughput would. zmqflow's side runs plaintext.

Run ``python -m zmqflow.bench.torch_embedding [--quick] [--json FILE]``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from ..client.blocking import Session
from ..cluster import ClusterSpec
from ..ports import free_port
from ..state import init, optim
from ..torch.embedding import EmbeddingBag
from .embedding import zipf_ids
from .procs import Procs, plaintext, zf_task_process
from .report import align, script_main, write_jsonl

__all__ = ["embedding_rows", "run", "format_table"]

DIM = 64
SHARDS = 2
LR = 0.05


def _warm(model: "_Zmqflow | _Torch", batches: list[torch.Tensor], weights: torch.Tensor) -> None:
    """Untimed steps (and what they leave to finish)."""
    for ids in batches:
        model.step(ids, weights)
    model.finish()


def _steps(model: "_Zmqflow | _Torch", batches: list[torch.Tensor], weights: torch.Tensor) -> tuple[float, list[float]]:
    """Seconds for every batch (with whatever ``step`` leaves to finish), and each step's."""
    times = []
    start = time.perf_counter()
    for ids in batches:
        t0 = time.perf_counter()
        model.step(ids, weights)
        times.append(time.perf_counter() - t0)
    model.finish()
    return time.perf_counter() - start, times


class _Zmqflow:
    def __init__(self, sess: Session, rows: int):
        self.m = EmbeddingBag("bench_torch_embedding", rows, DIM, mode="sum", optimizer=optim.SGD(LR),
                              initializer=init.normal(0.01), session=sess)

    def step(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        (self.m(ids) * weights).sum().backward()  # the push starts here and runs in the background

    def finish(self) -> None:
        self.m.flush()


class _Torch:
    def __init__(self, rows: int):
        self.m = torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
        torch.nn.init.normal_(self.m.weight, std=0.01)
        self.opt = torch.optim.SGD(self.m.parameters(), lr=LR)

    def step(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.opt.zero_grad()
        (self.m(ids) * weights).sum().backward()
        self.opt.step()

    def finish(self) -> None:
        pass


def embedding_rows(quick: bool) -> dict[str, Any]:
    """Lookup+push rows/s of EmbeddingBag on 2 ps shards beside a local EmbeddingBag + SGD."""
    rows = 100_000 if quick else 1_000_000
    bags, per_bag = (128, 16) if quick else (512, 16)
    steps, warmup = (20, 3) if quick else (100, 10)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(zipf_ids(rng, bags * per_bag, rows).reshape(bags, per_bag)) for _ in range(warmup + steps)]
    weights = torch.from_numpy(rng.standard_normal((bags, DIM)).astype(np.float32))
    rounds = 2 if quick else 4
    chunks = [batches[warmup + steps * k // rounds:warmup + steps * (k + 1) // rounds] for k in range(rounds)]
    took: dict[str, list[float]] = {"zf": [], "torch": []}  # seconds of each round
    step_s: dict[str, list[float]] = {"zf": [], "torch": []}
    procs = Procs()
    try:
        with plaintext() as security:
            spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(SHARDS)]})
            for t in spec.tasks:
                procs.start(zf_task_process, spec.to_json(), str(t))
            with Session(cluster=spec, task="ps:0", timeout=120) as sess:
                zf = _Zmqflow(sess, rows)
                models: dict[str, _Zmqflow | _Torch] = {"zf": zf, "torch": _Torch(rows)}
                for model in models.values():
                    _warm(model, batches[:warmup], weights)
                for k, chunk in enumerate(chunks):  # who goes first flips every round
                    for side in ("zf", "torch") if k % 2 == 0 else ("torch", "zf"):
                        total, per_step = _steps(models[side], chunk, weights)
                        took[side].append(total)
                        step_s[side] += per_step
                counters = zf.m.counters
    finally:
        procs.close()
    zf_total, torch_total = sum(took["zf"]), sum(took["torch"])
    zf_steps, torch_steps = step_s["zf"], step_s["torch"]
    ids_per_batch = bags * per_bag
    row = {
        "shards": SHARDS,
        "rows": rows,
        "dim": DIM,
        "bags": bags,
        "batch_ids": ids_per_batch,
        "steps": steps,
        "unique_ids_per_batch": float(np.mean([len(torch.unique(b)) for b in batches[warmup:]])),
        "zmqflow_rows_per_s": ids_per_batch * steps / zf_total,
        "torch_rows_per_s": ids_per_batch * steps / torch_total,
        "zmqflow_step_p50_ms": statistics.median(zf_steps) * 1e3,
        "torch_step_p50_ms": statistics.median(torch_steps) * 1e3,
        "torch_threads": torch.get_num_threads(),
        "pushes": counters["pushes"],
        "rounds": rounds,
        "security": security,
    }
    row["ratio"] = row["zmqflow_rows_per_s"] / row["torch_rows_per_s"]
    return row


def run(quick: bool = False, json_out: str | None = None) -> list[dict[str, Any]]:
    result = [embedding_rows(quick)]
    if json_out:
        write_jsonl(json_out, [{"bench": "torch_embedding", **r} for r in result])
    return result


def format_table(result: list[dict[str, Any]]) -> str:
    lines = [["shards", "rows", "bag ids", "unique", "zmqflow rows/s", "torch rows/s", "ratio", "zmqflow p50 ms",
              "torch p50 ms"]]
    for r in result:
        lines.append([str(r["shards"]), f"{r['rows']:,}", f"{r['batch_ids']:,}", f"{r['unique_ids_per_batch']:.0f}",
                      f"{r['zmqflow_rows_per_s']:,.0f}", f"{r['torch_rows_per_s']:,.0f}", f"{r['ratio']:.2f}",
                      f"{r['zmqflow_step_p50_ms']:.2f}", f"{r['torch_step_p50_ms']:.2f}"])
    return "\n".join(["EmbeddingBag lookup+push (zmqflow, 2 ps processes) vs torch.nn.EmbeddingBag(sparse=True)+SGD",
                      *align(lines)])


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
