"""Allreduce benchmark: zmqflow's ring beside torch.distributed's gloo, memcpy, and PS push/pull.

For 2 and 3 ranks (separate processes on tcp loopback) and float32 tensors from 1 KB to 64 MB:
the median time of an allreduce (sum), reported as nccl-tests does: algbw = bytes / time and
busbw = algbw x 2(n-1)/n, the bandwidth each link carries. Beside it in the same run: gloo's
allreduce when torch is installed (CPU wheel), numpy memcpy of the same bytes, and the PS
equivalent (every worker pushes its gradient to one ps shard and pulls the result), so users see
where each wins. Targets (reported, never asserted): ring busbw >= 1.0x gloo at 16 MB and up on
2 ranks, >= 0.5x at 64 KB.

Run ``zmqflow bench allreduce [--quick] [--json FILE]``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..ports import free_port
from ..transport.memory import keep_big_blocks
from .procs import align, script_main

__all__ = ["run", "format_table"]

KB, MB = 1 << 10, 1 << 20
SIZES = (KB, 64 * KB, MB, 16 * MB, 64 * MB)
QUICK_SIZES = (KB, 64 * KB, MB, 16 * MB)


def _reps(size: int, quick: bool) -> int:
    base = 20 if size <= MB else 6
    return max(3, base // (2 if quick else 1))


def _zf_rank(spec_json: str, rank: int, sizes: Sequence[int], quick: bool, out: Any) -> None:
    keep_big_blocks()
    from ..cluster import ClusterSpec
    from ..client.ring import Ring
    from ..server.task import Server

    with Server(ClusterSpec.from_json(spec_json), f"worker:{rank}") as server:
        ring = Ring(server, timeout=120)
        ring.barrier()
        for size in sizes:
            x = np.ones(size // 4, np.float32)
            ring.allreduce(x)  # warm up
            median = _median_time(lambda: ring.allreduce(x), ring.barrier, _reps(size, quick))
            if rank == 0:
                out.put(("zf", size, median))
        ring.barrier()


def _median_time(reduce: Any, barrier: Any, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``reduce``, every rank starting each from a barrier."""
    times = []
    for _ in range(reps):
        barrier()
        t = time.perf_counter()
        reduce()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _gloo_rank(port: int, rank: int, world: int, sizes: Sequence[int], quick: bool, out: Any) -> None:
    keep_big_blocks()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32)
        dist.all_reduce(x)  # warm up
        median = _median_time(lambda: dist.all_reduce(x), dist.barrier, _reps(size, quick))
        if rank == 0:
            out.put(("gloo", size, median))
    dist.barrier()
    dist.destroy_process_group()


def _ps_rank(spec_json: str, rank: int, sizes: Sequence[int], quick: bool, out: Any) -> None:
    """The PS way to the same result: push the gradient, pull the variable (sync, all workers)."""
    keep_big_blocks()
    from ..cluster import ClusterSpec
    from ..state.optim import SGD, SyncReplicas
    from ..client.ring import Ring
    from ..server.task import Server
    from ..client.blocking import Session

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
            var.push(g)
            var.read()
            times = []
            for _ in range(_reps(size, quick)):
                ring.barrier()
                t = time.perf_counter()
                var.push(g)
                var.read()
                times.append(time.perf_counter() - t)
            if rank == 0:
                out.put(("ps", size, statistics.median(times)))
        ring.barrier()


def _spawn(ctx: Any, target: Any, argsets: list[tuple], timeout: float) -> None:
    procs = [ctx.Process(target=target, args=a, daemon=True) for a in argsets]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a benchmark rank failed (exit codes {bad})")


def _memcpy_s(size: int) -> float:
    a = np.ones(size // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(quick: bool = False, ranks: Sequence[int] = (2, 3), json_out: str | None = None, echo: Any = print) -> list[dict[str, Any]]:
    keep_big_blocks()
    sizes = QUICK_SIZES if quick else SIZES
    ctx = multiprocessing.get_context("spawn")
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    rows = []
    for n in ranks:
        out = ctx.Queue()
        workers = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        _spawn(ctx, _zf_rank, [(json.dumps({"worker": workers}), r, sizes, quick, out) for r in range(n)], 900)
        if have_torch:
            port = free_port()
            _spawn(ctx, _gloo_rank, [(port, r, n, sizes, quick, out) for r in range(n)], 900)
        ps_spec = json.dumps({"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(n)]})
        ps_server = ctx.Process(target=_ps_server, args=(ps_spec,), daemon=True)
        ps_server.start()
        try:
            _spawn(ctx, _ps_rank, [(ps_spec, r, sizes, quick, out) for r in range(n)], 900)
        finally:
            ps_server.kill()
            ps_server.join()
        got: dict[tuple[str, int], float] = {}
        while not out.empty():
            kind, size, seconds = out.get()
            got[(kind, size)] = seconds
        for size in sizes:
            factor = 2 * (n - 1) / n
            row: dict[str, Any] = {"ranks": n, "bytes": size}
            for kind in ("zf", "gloo", "ps"):
                s = got.get((kind, size))
                row[f"{kind}_ms"] = None if s is None else s * 1e3
                row[f"{kind}_algbw"] = None if s is None else size / s / 1e9
                row[f"{kind}_busbw"] = None if s is None else size / s / 1e9 * factor
            row["memcpy_gbps"] = size / _memcpy_s(size) / 1e9
            row["busbw_vs_gloo"] = (row["zf_busbw"] / row["gloo_busbw"]) if row["gloo_busbw"] else None
            rows.append(row)
            echo(f"{n} ranks {_label(size)}: ring {row['zf_ms']:.2f} ms"
                 + (f", gloo {row['gloo_ms']:.2f} ms" if row["gloo_ms"] else "") + f", ps {row['ps_ms']:.2f} ms")
    if json_out:
        with open(json_out, "a") as fh:
            for row in rows:
                fh.write(json.dumps({"bench": "allreduce", "cpus": os.cpu_count(), **row}) + "\n")
    return rows


def _ps_server(spec_json: str) -> None:
    keep_big_blocks()

    from .. import loop as zf_loop
    from ..cluster import ClusterSpec
    from ..server.task import AsyncServer

    async def main() -> None:
        async with AsyncServer(ClusterSpec.from_json(spec_json), "ps:0") as s:
            await s.join()

    zf_loop.run(main())


def _label(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["ranks", "size", "ring ms", "algbw", "busbw", "gloo ms", "busbw", "ring/gloo", "ps push+pull ms", "memcpy GB/s"]
    lines = [head]
    for r in rows:
        lines.append([
            str(r["ranks"]), _label(r["bytes"]), _fmt(r["zf_ms"], ".2f"), _fmt(r["zf_algbw"], ".3f"), _fmt(r["zf_busbw"], ".3f"),
            _fmt(r["gloo_ms"], ".2f"), _fmt(r["gloo_busbw"], ".3f"), _fmt(r["busbw_vs_gloo"], ".2f"),
            _fmt(r["ps_ms"], ".2f"), _fmt(r["memcpy_gbps"], ".1f"),
        ])
    out = align(lines)
    out.append("GB/s; busbw = algbw x 2(n-1)/n. targets: ring busbw >= 1.0x gloo at >= 16 MB on 2 ranks, >= 0.5x at 64 KB")
    return "\n".join(out)


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
