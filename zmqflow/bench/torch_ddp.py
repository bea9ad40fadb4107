"""Training step time: ``zmqflow.torch.DistributedOptimizer`` (ring) beside torch DDP over gloo.

Two ranks, separate processes on this machine, each running both: the same MLP
(about 4.2 M float32 parameters) from the same seed, the same batches, plain SGD, one thread of
torch compute per rank, 25 MB buckets on both sides. Phases alternate within the same processes,
who goes first flipping every round (zmqflow, DDP; DDP, zmqflow; ...), so both see the same
machine and neither always runs just after the other; each phase warms up first
(untimed), then times ``steps`` steps from a barrier: step time = elapsed / steps on the slower
rank. Reported: the median over phases of each, and ratio = zmqflow / DDP (target <= 1.0). Both
models train on identical data for the same steps, so ``max_param_diff`` (their largest
difference at the end) shows the two did the same work.

With ``device="cuda"`` (``zmqflow bench torch --only ddp --device cuda``) both models, their
batches and gradients live on the GPU: DDP's gloo reduces CUDA tensors, zmqflow's ring stages
them through the host's shared memory; each timed span ends when the GPU is done.

The paths differ by design: zmqflow's ring reduces over same-host shared memory, DDP's gloo over
tcp loopback; both plaintext (no ``ZMQFLOW_KEYS`` in the ranks).

Run ``python -m zmqflow.bench.torch_ddp [--quick] [--json FILE]``, or call :func:`ddp_ratio`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from ..errors import ConfigError
from ..ports import free_port
from ..transport.memory import keep_big_blocks
from .procs import plaintext, run_to_end, spawn_queue
from .report import script_main, write_jsonl

__all__ = ["ddp_ratio", "run", "format_table", "MODEL_SIZES"]

MODEL_SIZES = (1024, 2048, 1024, 10)  # Linear-ReLU layers: ~4.2 M parameters
BATCH = 64  # per rank
BUCKET_MB = 25


def _settings(quick: bool) -> dict[str, int]:
    return {"steps": 8, "warmup": 2, "rounds": 2} if quick else {"steps": 25, "warmup": 3, "rounds": 4}


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(MODEL_SIZES, MODEL_SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _rank(spec_json: str, port: int, rank: int, quick: bool, out: Any, device: str = "cpu") -> None:
    """Process entry: one rank running both phases; puts ("zf"|"ddp", round, seconds per step) and
    ("diff", max difference) on ``out``."""
    keep_big_blocks()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import zmqflow.torch as zt

    torch.set_num_threads(1)
    cfg = _settings(quick)
    zt.init(spec_json, f"worker:{rank}", timeout=120)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        zf_model, ddp_inner = _model(torch).to(device), _model(torch).to(device)
        zf_opt = zt.DistributedOptimizer(torch.optim.SGD(zf_model.parameters(), lr=0.01), zf_model.named_parameters(),
                                         bucket_mb=BUCKET_MB)
        ddp_model = DistributedDataParallel(ddp_inner, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=BUCKET_MB)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        data = [(torch.randn(BATCH, MODEL_SIZES[0], generator=g).to(device),
                 torch.randint(0, MODEL_SIZES[-1], (BATCH,), generator=g).to(device)) for _ in range(4)]
        done = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step(model: Any, opt: Any, i: int) -> None:
            x, y = data[i % len(data)]
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        phases = {"zf": (zf_model, zf_opt, zt.barrier), "ddp": (ddp_model, ddp_opt, dist.barrier)}
        for r in range(cfg["rounds"]):
            for kind in ("zf", "ddp") if r % 2 == 0 else ("ddp", "zf"):  # who goes first flips every round
                model, opt, barrier = phases[kind]
                for i in range(cfg["warmup"]):
                    step(model, opt, i)
                done()
                barrier()
                t0 = time.perf_counter()
                for i in range(cfg["steps"]):
                    step(model, opt, i)
                done()
                out.put((kind, r, rank, (time.perf_counter() - t0) / cfg["steps"]))
        with torch.no_grad():
            diff = max(float((p - q).abs().max()) for p, q in zip(zf_model.parameters(), ddp_inner.parameters()))
        out.put(("diff", 0, rank, diff))
    finally:
        dist.destroy_process_group()
        zt.shutdown()


def ddp_ratio(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Step times of zmqflow's DistributedOptimizer (ring) and torch DDP (gloo) on 2 ranks, and
    their ratio; see the module docstring for what is measured."""
    keep_big_blocks()
    import torch  # (fails early, here, where torch is missing)

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: torch sees no CUDA device here")

    cfg = _settings(quick)
    spec = json.dumps({"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]})
    out = spawn_queue()
    port = free_port()  # gloo's rendezvous: one for both ranks
    with plaintext() as security:
        run_to_end(_rank, [(spec, port, r, quick, out, device) for r in range(2)], 900)
    got: dict[tuple[str, int], float] = {}
    diff = 0.0
    while not out.empty():
        kind, r, _, value = out.get()
        if kind == "diff":
            diff = max(diff, value)
        else:
            got[(kind, r)] = max(got.get((kind, r), 0.0), value)  # the slower rank sets the pace
    zf = [got[("zf", r)] for r in range(cfg["rounds"])]
    ddp = [got[("ddp", r)] for r in range(cfg["rounds"])]
    params = sum(a * b + b for a, b in zip(MODEL_SIZES, MODEL_SIZES[1:]))
    zf_ms, ddp_ms = statistics.median(zf) * 1e3, statistics.median(ddp) * 1e3
    return {
        "bench": "torch_ddp", "device": device, "ranks": 2, "params": params, "batch_per_rank": BATCH, "bucket_mb": BUCKET_MB,
        "threads_per_rank": 1, "cpus": os.cpu_count(), "security": security, **cfg,
        "zmqflow_step_ms": zf_ms, "ddp_step_ms": ddp_ms, "ratio": zf_ms / ddp_ms,
        "zmqflow_rounds_ms": [x * 1e3 for x in zf], "ddp_rounds_ms": [x * 1e3 for x in ddp],
        "max_param_diff": diff,
    }


def run(quick: bool = False, json_out: str | None = None, echo: Any = print, device: str = "cpu") -> dict[str, Any]:
    result = ddp_ratio(quick, device)
    if json_out:
        write_jsonl(json_out, [result])
    return result


def format_table(r: dict[str, Any]) -> str:
    return "\n".join([
        f"MLP {'-'.join(map(str, MODEL_SIZES))} ({r['params'] / 1e6:.1f} M params), batch {r['batch_per_rank']} per rank, "
        f"{r['ranks']} ranks on {r.get('device', 'cpu')}, {r['steps']} timed steps x {r['rounds']} rounds, {r['cpus']} CPUs",
        f"zmqflow ring: {r['zmqflow_step_ms']:.1f} ms/step  (rounds: {', '.join(f'{x:.1f}' for x in r['zmqflow_rounds_ms'])})",
        f"torch DDP/gloo: {r['ddp_step_ms']:.1f} ms/step  (rounds: {', '.join(f'{x:.1f}' for x in r['ddp_rounds_ms'])})",
        f"ratio zmqflow/DDP: {r['ratio']:.2f} (target <= 1.0); max parameter difference: {r['max_param_diff']:.2g}",
    ])


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
