"""Allreduce benchmark: zmqflow's ring beside torch.distributed's gloo, memcpy, and PS push/pull.

For 2 and 3 ranks (separate processes on tcp loopback) and float32 tensors from 1 KB to 64 MB:
the median time of an allreduce (sum), reported as nccl-tests does: algbw = bytes / time and
busbw = algbw x 2(n-1)/n, the bandwidth each link carries. Beside it in the same run: gloo's
allreduce when torch is installed (CPU wheel), numpy memcpy of the same bytes, and the PS
equivalent (every worker pushes its gradient to one ps shard and pulls the result), so users see
where each wins. Targets (reported, never asserted): ring busbw >= 1.0x gloo at 16 MB and up on
2 ranks, >= 0.5x at 64 KB. With ``device="cuda"`` both sides reduce GPU buffers (cupy arrays for
the ring, CUDA tensors for gloo; every rank on the one visible GPU) and the PS columns are left out.

Run ``zmqflow bench allreduce [--quick] [--vs gloo] [--device cuda] [--json FILE] [--plot FILE]``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..ports import free_port
from ..transport.memory import keep_big_blocks
from .procs import Procs, run_to_end, spawn_queue, zf_task_process
from .report import KiB, MiB, align, cell, script_main, size_label, write_jsonl
from .stats import median_seconds, memcpy_gbps

__all__ = ["format_table", "gloo_available", "run"]

SIZES = (KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES = (KiB, 64 * KiB, MiB, 16 * MiB)
DEVICES = ("cpu", "cuda")


def _reps(size: int, quick: bool) -> int:
    """Timed calls per size: 20 up to 1 MB, 6 above (halved with --quick, 3 at least)."""
    base = 20 if size <= MiB else 6
    return max(3, base // (2 if quick else 1))


def _check_sum(result: Any, ranks: int, who: str) -> None:
    """A warm-up's result must be every rank's ones summed: a fast wrong answer is no result."""
    ends = [float(result[0]), float(result[-1])]
    if ends != [float(ranks)] * 2:
        raise AssertionError(f"{who}: allreduce of ones over {ranks} ranks gave {ends} at its ends")


def _zf_rank(spec_json: str, rank: int, sizes: Sequence[int], quick: bool, out: Any,
             ring_kwargs: dict[str, Any] | None = None, device: str = "cpu") -> None:
    """Process entry: one rank of the ring; rank 0 puts ("zf", size, median seconds) on ``out``.
    ``ring_kwargs`` (e.g. ``chunk_bytes``) go to the Ring, to tune it; ``device="cuda"`` reduces
    cupy arrays."""
    keep_big_blocks()
    from ..client.ring_blocking import Ring
    from ..cluster import ClusterSpec
    from ..server.task import Server

    xp: Any = np
    if device == "cuda":
        import cupy as xp  # type: ignore[import-not-found,no-redef]
    with Server(ClusterSpec.from_json(spec_json), f"worker:{rank}") as server:
        ring = Ring(server, timeout=120, **(ring_kwargs or {}))
        ring.barrier()
        for size in sizes:
            x = xp.ones(size // 4, np.float32)
            _check_sum(ring.allreduce(x), ring.size, "zmqflow's ring")  # also the warm-up
            median = median_seconds(lambda: ring.allreduce(x), _reps(size, quick), before=ring.barrier)
            if rank == 0:
                out.put(("zf", size, median))
        ring.barrier()
        ring.leave()  # a rank done first must not look dead to one still finishing the last barrier


def _gloo_rank(port: int, rank: int, world: int, sizes: Sequence[int], quick: bool, out: Any, device: str = "cpu") -> None:
    """Process entry: one rank of torch.distributed's gloo; rank 0 puts ("gloo", size, seconds) on
    ``out``. On ``cuda`` each call waits for the device, as the ring's does."""
    keep_big_blocks()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    done = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call() -> None:
        dist.all_reduce(x)
        done()

    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        call()
        _check_sum(x, world, "gloo")  # also the warm-up
        median = median_seconds(call, _reps(size, quick), before=dist.barrier)
        if rank == 0:
            out.put(("gloo", size, median))
    dist.barrier()
    dist.destroy_process_group()


def _ps_rank(spec_json: str, rank: int, sizes: Sequence[int], quick: bool, out: Any) -> None:
    """The PS way to the same result: push the gradient, pull the variable (sync, all workers)."""
    keep_big_blocks()
    from ..client.ring_blocking import Ring
    from ..client.blocking import Session
    from ..cluster import ClusterSpec
    from ..server.task import Server
    from ..state.optim import SGD, SyncReplicas

    spec = ClusterSpec.from_json(spec_json)
    n = spec.num_tasks("worker")
    with Server(spec, f"worker:{rank}") as server, Session(server.target, name=f"worker:{rank}", timeout=120) as sess:
        ring = Ring(server, timeout=120)  # only to line the workers up between measurements
        ring.barrier()
        for size in sizes:
            name = f"g{size}"
            opt = SyncReplicas(SGD(1.0), replicas_to_aggregate=n)
            var = sess.variable(name, shape=(size // 4,), optimizer=opt) if rank == 0 else None
            ring.barrier()
            var = var or sess.get(name)
            g = np.ones(size // 4, np.float32)
            sess.global_step()

            def push_pull() -> None:
                var.push(g)
                var.read()

            push_pull()  # warm up
            median = median_seconds(push_pull, _reps(size, quick), before=ring.barrier)
            if rank == 0:
                out.put(("ps", size, median))
        ring.barrier()


def gloo_available() -> bool:
    """Whether torch (and so gloo) can be found, without importing it here."""
    return importlib.util.find_spec("torch") is not None


def run(quick: bool = False, ranks: Sequence[int] = (2, 3), json_out: str | None = None, echo: Any = print,
        gloo: bool | None = None, sizes: Sequence[int] | None = None, ps: bool = True,
        ring_kwargs: dict[str, Any] | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """One row per rank count x size: the ring, gloo, PS and memcpy. ``gloo``: None runs it when
    torch is installed (its columns ``None`` otherwise), True requires it (``--vs gloo``: a
    missing torch is a ConfigError before anything runs), False leaves it out. ``sizes``
    overrides the sizes, ``ps=False`` skips the PS columns, ``ring_kwargs`` tune the ring,
    ``device="cuda"`` reduces GPU buffers on both sides (no PS columns)."""
    keep_big_blocks()
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda":
        if importlib.util.find_spec("cupy") is None:
            raise ConfigError("the GPU allreduce needs cupy (pip install cupy-cuda12x or cupy-cuda13x)")
        ps = False
    sizes = tuple(sizes) if sizes else (QUICK_SIZES if quick else SIZES)
    have_torch = gloo_available() if gloo is None else gloo
    if have_torch and not gloo_available():
        raise ConfigError("the gloo anchor needs PyTorch: pip install 'zmqflow[torch]'")
    rows = []
    for n in ranks:
        out = spawn_queue()
        workers = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        run_to_end(_zf_rank, [(json.dumps({"worker": workers}), r, sizes, quick, out, ring_kwargs, device) for r in range(n)], 900)
        if have_torch:
            port = free_port()
            run_to_end(_gloo_rank, [(port, r, n, sizes, quick, out, device) for r in range(n)], 900)
        ps_spec = json.dumps({"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(n)]})
        if ps:
            ps_server = Procs()
            try:
                ps_server.start(zf_task_process, ps_spec, "ps:0")
                run_to_end(_ps_rank, [(ps_spec, r, sizes, quick, out) for r in range(n)], 900)
            finally:
                ps_server.close()
        got: dict[tuple[str, int], float] = {}
        while not out.empty():
            kind, size, seconds = out.get()
            got[(kind, size)] = seconds
        for size in sizes:
            factor = 2 * (n - 1) / n
            row: dict[str, Any] = {"ranks": n, "bytes": size, "device": device}
            for kind in ("zf", "gloo", "ps"):
                s = got.get((kind, size))
                row[f"{kind}_ms"] = None if s is None else s * 1e3
                row[f"{kind}_algbw"] = None if s is None else size / s / 1e9
                row[f"{kind}_busbw"] = None if s is None else size / s / 1e9 * factor
            row["memcpy_gbps"] = memcpy_gbps(size, copies=1, batches=10)
            row["busbw_vs_gloo"] = (row["zf_busbw"] / row["gloo_busbw"]) if row["gloo_busbw"] else None
            rows.append(row)
            echo(f"{n} ranks {_label(size)}: ring {row['zf_ms']:.2f} ms"
                 + (f", gloo {row['gloo_ms']:.2f} ms" if row["gloo_ms"] else "") + (f", ps {row['ps_ms']:.2f} ms" if row["ps_ms"] else ""))
    if json_out:
        write_jsonl(json_out, ({"bench": "allreduce", "cpus": os.cpu_count(), **row} for row in rows))
    return rows


def _label(size: int) -> str:
    return size_label(size, "KB", "MB")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["ranks", "size", "ring ms", "algbw", "busbw", "gloo ms", "busbw", "ring/gloo", "ps push+pull ms", "memcpy GB/s"]
    lines = [head]
    for r in rows:
        lines.append([
            str(r["ranks"]), _label(r["bytes"]), cell(r["zf_ms"], ".2f"), cell(r["zf_algbw"], ".3f"), cell(r["zf_busbw"], ".3f"),
            cell(r["gloo_ms"], ".2f"), cell(r["gloo_busbw"], ".3f"), cell(r["busbw_vs_gloo"], ".2f"),
            cell(r["ps_ms"], ".2f"), cell(r["memcpy_gbps"], ".1f"),
        ])
    out = align(lines)
    out.append("GB/s; busbw = algbw x 2(n-1)/n. targets: ring busbw >= 1.0x gloo at >= 16 MB on 2 ranks, >= 0.5x at 64 KB")
    return "\n".join(out)


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
