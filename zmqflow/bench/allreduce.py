"""Allreduce benchmark: zmqflow's ring beside torch.distributed's gloo, memcpy, and PS push/pull.

For 2 and 3 ranks (separate processes on this host) and float32 tensors from 1 KB to 64 MB: the
median time of an allreduce (sum), reported as nccl-tests does: algbw = bytes / time and busbw =
algbw x 2(n-1)/n, the bandwidth each link carries. Beside it, side by side in the same processes:
gloo's allreduce when torch is installed (CPU wheel); each rank keeps both groups up, and for each
size each repetition times one call of each, the order flipped every repetition and every size,
so both see the same machine; each side's figure is the median of its repetitions (rank 0's
time, from its side's barrier), and ring/gloo is the ratio of the medians. The paths differ by
design: the ring's ranks, all on one host, reduce through its same-host shared-memory path
(:mod:`zmqflow.client.ring_shm`; their task servers speak tcp loopback to set it up;
``ring_kwargs={"shm": False}`` keeps the data on tcp loopback too), gloo's over tcp loopback.
Then numpy memcpy of the same bytes (batches of copies, as the transport benchmark times it) and
the PS equivalent (every worker pushes its gradient to one ps shard over tcp loopback and pulls
the result), so users see where each wins. Both sides plaintext. Targets (reported, never
asserted): ring busbw >= 1.0x gloo at 16 MB and up on 2 ranks, >= 0.5x at 64 KB. With
``device="cuda"`` both sides reduce GPU buffers (cupy arrays for the ring, staged through the
host's shared memory; CUDA tensors for gloo; every rank on the one visible GPU) and the PS
columns are left out.

Run ``zmqflow bench allreduce [--quick] [--vs gloo] [--device cuda] [--json FILE] [--plot FILE]``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..ports import free_port
from ..transport.memory import keep_big_blocks
from .procs import Procs, plaintext, run_to_end, spawn_queue, zf_task_process
from .report import KiB, MiB, align, cell, script_main, size_label, write_jsonl
from .stats import clamp, memcpy_gbps, seconds

__all__ = ["format_table", "gloo_available", "run"]

SIZES = (KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES = (KiB, 64 * KiB, MiB, 16 * MiB)
DEVICES = ("cpu", "cuda")
MEMCPY_BATCHES = 5
SHM_PATH = "same-host shared memory"  # the ring's data path unless ring_kwargs say shm=False


def _reps(size: int, quick: bool) -> int:
    """Timed calls per size: 20 up to 1 MB, 6 above (halved with --quick, 3 at least)."""
    base = 20 if size <= MiB else 6
    return max(3, base // (2 if quick else 1))


def _check_sum(result: Any, ranks: int, who: str) -> None:
    """A warm-up's result must be every rank's ones summed: a fast wrong answer is no result."""
    ends = [float(result[0]), float(result[-1])]
    if ends != [float(ranks)] * 2:
        raise AssertionError(f"{who}: allreduce of ones over {ranks} ranks gave {ends} at its ends")


def _times(call: Callable[[], Any], reps: int, before: Callable[[], Any]) -> list[float]:
    """Seconds of each of ``reps`` calls, ``before`` (a barrier) untimed ahead of each."""
    out = []
    for _ in range(reps):
        before()
        out.append(seconds(call))
    return out


def _gloo_group(port: int, rank: int, world: int, device: str) -> tuple[Any, Callable[[int], Callable[[], Any]]]:
    """torch.distributed's gloo group of this rank, and for a size the call that allreduces a
    tensor of ones of that many bytes (waiting for the device on ``cuda``, as the ring's does),
    checked once."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    done = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def for_size(size: int) -> Callable[[], Any]:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)

        def call() -> None:
            dist.all_reduce(x)
            done()

        call()
        _check_sum(x, world, "gloo")  # also the warm-up
        return call

    return dist, for_size


def _rank(spec_json: str, port: int, rank: int, sizes: Sequence[int], quick: bool, out: Any,
          ring_kwargs: dict[str, Any] | None = None, device: str = "cpu", gloo: bool = False) -> None:
    """Process entry: one rank of zmqflow's ring and, with ``gloo``, of gloo's group too, both up
    side by side in this process. For each size both warm up (checked), then each repetition
    times one call of each after its own barrier, the order flipped every repetition and every
    size, so drift falls on both alike; rank 0 puts ("zf"|"gloo", size, seconds of each
    repetition) on ``out``. ``ring_kwargs`` (e.g. ``chunk_bytes``) go to the Ring, to tune it;
    ``device="cuda"`` reduces cupy arrays on the ring and CUDA tensors on gloo."""
    keep_big_blocks()
    from ..client.ring_blocking import Ring
    from ..cluster import ClusterSpec
    from ..server.task import Server

    xp: Any = np
    if device == "cuda":
        import cupy as xp  # type: ignore[import-not-found,no-redef]
    spec = ClusterSpec.from_json(spec_json)
    world = spec.num_tasks("worker")
    with Server(spec, f"worker:{rank}") as server:
        ring = Ring(server, timeout=120, **(ring_kwargs or {}))
        ring.barrier()
        dist, gloo_call = _gloo_group(port, rank, world, device) if gloo else (None, None)
        for k, size in enumerate(sizes):
            x = xp.ones(size // 4, np.float32)
            _check_sum(ring.allreduce(x), ring.size, "zmqflow's ring")  # also the warm-up
            sides: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
                "zf": (lambda x=x: ring.allreduce(x), ring.barrier)}
            if dist is not None and gloo_call is not None:
                sides["gloo"] = (gloo_call(size), dist.barrier)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(_reps(size, quick)):
                for name in list(sides)[::1 if (k + r) % 2 == 0 else -1]:
                    call, barrier = sides[name]
                    barrier()
                    times[name].append(seconds(call))
            if rank == 0:
                for name, took in times.items():
                    out.put((name, size, took))
        ring.barrier()
        ring.leave()  # a rank done first must not look dead to one still finishing the last barrier
        if dist is not None:
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
            took = _times(push_pull, _reps(size, quick), ring.barrier)
            if rank == 0:
                out.put(("ps", size, took))
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
    memcpy = {size: memcpy_gbps(size, _memcpy_copies(size, quick), MEMCPY_BATCHES) for size in sizes}
    rows = []
    for n in ranks:
        with plaintext() as security:
            got = _measure(n, sizes, quick, have_torch, ps, ring_kwargs, device)
        for size in sizes:
            factor = 2 * (n - 1) / n
            row: dict[str, Any] = {"ranks": n, "bytes": size, "device": device, "security": security,
                                   "ring_path": "tcp loopback" if (ring_kwargs or {}).get("shm") is False else SHM_PATH}
            for kind in ("zf", "gloo", "ps"):
                took = got.get((kind, size))
                s = None if took is None else statistics.median(took)
                row[f"{kind}_ms"] = None if s is None else s * 1e3
                row[f"{kind}_algbw"] = None if s is None else size / s / 1e9
                row[f"{kind}_busbw"] = None if s is None else size / s / 1e9 * factor
                row[f"{kind}_ms_reps"] = None if took is None else [t * 1e3 for t in took]
            row["memcpy_gbps"] = memcpy[size]
            # = gloo's median time / the ring's: the ratio of the medians
            row["busbw_vs_gloo"] = (row["zf_busbw"] / row["gloo_busbw"]) if row["gloo_busbw"] else None
            rows.append(row)
            echo(f"{n} ranks {_label(size)}: ring {row['zf_ms']:.2f} ms"
                 + (f", gloo {row['gloo_ms']:.2f} ms" if row["gloo_ms"] else "") + (f", ps {row['ps_ms']:.2f} ms" if row["ps_ms"] else ""))
    if json_out:
        write_jsonl(json_out, ({"bench": "allreduce", "cpus": os.cpu_count(), **row} for row in rows))
    return rows


def _memcpy_copies(size: int, quick: bool) -> int:
    """Copies per timed memcpy batch, as the transport benchmark's: its bytes over all batches,
    3..20000 a batch, so a small size is not one copy inside the timer's own cost."""
    return clamp((64 if quick else 512) * MiB // (size * MEMCPY_BATCHES), 3, 20000)


def _measure(n: int, sizes: Sequence[int], quick: bool, gloo: bool, ps: bool, ring_kwargs: dict[str, Any] | None,
             device: str) -> dict[tuple[str, int], list[float]]:
    """Seconds of each repetition, by (side, size), on ``n`` ranks: the ring and gloo side by side
    in the same processes, then the PS way."""
    out = spawn_queue()
    workers = json.dumps({"worker": [f"127.0.0.1:{free_port()}" for _ in range(n)]})
    port = free_port()  # gloo's rendezvous
    run_to_end(_rank, [(workers, port, r, sizes, quick, out, ring_kwargs, device, gloo) for r in range(n)], 900)
    if ps:
        ps_spec = json.dumps({"ps": [f"127.0.0.1:{free_port()}"],
                              "worker": [f"127.0.0.1:{free_port()}" for _ in range(n)]})
        ps_server = Procs()
        try:
            ps_server.start(zf_task_process, ps_spec, "ps:0")
            run_to_end(_ps_rank, [(ps_spec, r, sizes, quick, out) for r in range(n)], 900)
        finally:
            ps_server.close()
    got: dict[tuple[str, int], list[float]] = {}
    while not out.empty():
        kind, size, took = out.get()
        got[(kind, size)] = took
    return got


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
    paths = sorted({r.get("ring_path", SHM_PATH) for r in rows})
    out.append("ring and gloo side by side in the same processes, alternating, medians of their repetitions; "
               f"the ring over {' / '.join(paths)}, gloo over tcp loopback")
    return "\n".join(out)


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
