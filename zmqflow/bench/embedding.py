"""Embedding benchmark: sharded lookups and sparse pushes, and the memory of a big table.

Batches of 4096 Zipf-distributed ids (dim 64, float32) are looked up in, and pushed to (SGD), a
static table spread over 1, 2 and 4 ps shards, each a separate process on tcp loopback. Beside
it, in the same run: numpy ``take`` of the same ids from one in-process array of the same size,
the physical reference for a gather. Then a ``num_rows`` x 64 float32 table (10,000,000 rows,
2.56 GB, by default) is created over 4 shards and each shard's resident memory is compared with
the bytes it holds (target: within 1.3x; reported, never asserted).

Run ``zmqflow bench embedding [--quick] [--json FILE]``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import loop as zf_loop
from ..client.session import AsyncSession
from ..cluster import ClusterSpec
from ..ports import free_port
from ..state import init, optim
from ..transport.memory import keep_big_blocks
from .machine import rss_bytes
from .procs import Procs, zf_task_process
from .report import align, script_main, write_jsonl
from .stats import seconds, seconds_async

__all__ = ["format_table", "run"]

DIM = 64
BATCH = 4096


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float = 1.2) -> np.ndarray:
    """Zipf-distributed ids: a few hot rows, a long tail, spread over the table by a permutation."""
    return (rng.zipf(a, n) - 1) % rows * 7919 % rows


def _cluster(shards: int, procs: Procs) -> ClusterSpec:
    """``shards`` ps task servers, each in its own process, on tcp loopback."""
    spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(shards)]})
    for t in spec.tasks:
        procs.start(zf_task_process, spec.to_json(), str(t))
    return spec


def _throughput(shards: int, rows: int, batches: int) -> dict[str, Any]:
    """Lookups and pushes of ``batches`` batches over ``shards`` shards, beside numpy ``take``."""
    procs = Procs()
    try:
        spec = _cluster(shards, procs)
        rng = np.random.default_rng(0)
        id_batches = [zipf_ids(rng, BATCH, rows) for _ in range(batches)]
        grads = np.full((BATCH, DIM), 1e-3, np.float32)

        async def main() -> tuple[list[float], list[float]]:
            async with AsyncSession(cluster=spec, task="ps:0", timeout=300) as sess:
                emb = await sess.embedding("bench", rows, DIM, initializer=init.normal(0.01), optimizer=optim.SGD(0.1))
                for ids in id_batches[:3]:  # warm up
                    await emb.lookup(ids)
                    await emb.push(ids, grads)
                lookups, pushes = [], []
                for ids in id_batches:
                    lookups.append(await seconds_async(lambda: emb.lookup(ids)))
                    pushes.append(await seconds_async(lambda: emb.push(ids, grads)))
                return lookups, pushes

        lookups, pushes = zf_loop.run(main())
        table = np.random.default_rng(1).standard_normal((rows, DIM), dtype=np.float32)
        takes = [seconds(lambda: np.take(table, ids, axis=0)) for ids in id_batches]
        row = {
            "shards": shards,
            "rows": rows,
            "unique_ids_per_batch": float(np.mean([len(np.unique(b)) for b in id_batches])),
            "lookup_rows_per_s": BATCH / statistics.median(lookups),
            "push_rows_per_s": BATCH / statistics.median(pushes),
            "numpy_take_rows_per_s": BATCH / statistics.median(takes),
            "lookup_p50_ms": statistics.median(lookups) * 1e3,
            "push_p50_ms": statistics.median(pushes) * 1e3,
        }
        row["lookup_ratio"] = row["lookup_rows_per_s"] / row["numpy_take_rows_per_s"]
        return row
    finally:
        procs.close()


def _memory(rows: int, shards: int = 4) -> dict[str, Any]:
    """Each shard's resident memory beside the bytes it holds, for a ``rows`` x DIM table."""
    procs = Procs()
    try:
        spec = _cluster(shards, procs)
        base = [rss_bytes(pid) for pid in procs.pids]

        async def main() -> list[int]:
            async with AsyncSession(cluster=spec, task="ps:0", timeout=600) as sess:
                emb = await sess.embedding("big", rows, DIM, initializer=init.normal(0.01), optimizer=optim.SGD(0.1))
                rng = np.random.default_rng(2)
                for _ in range(5):
                    ids = zipf_ids(rng, BATCH, rows)
                    await emb.lookup(ids)
                    await emb.push(ids, np.ones((BATCH, DIM), np.float32))
                return [s["bytes"] for s in await emb.stats()]

        held = zf_loop.run(main())
        rss = [rss_bytes(pid) for pid in procs.pids]
        return {
            "rows": rows,
            "table_gb": rows * DIM * 4 / 1e9,
            "shards": shards,
            "held_bytes": held,
            "rss_bytes": rss,
            "idle_rss_bytes": base,
            "rss_over_held": [r / h for r, h in zip(rss, held)],
        }
    finally:
        procs.close()


def run(quick: bool = False, shards: Sequence[int] = (1, 2, 4), json_out: str | None = None,
        memory_rows: int | None = None, echo: Any = print) -> dict[str, Any]:
    """``{"throughput": [one row per shard count], "memory": {...}}``, appended to ``json_out``."""
    keep_big_blocks()
    rows, batches = (200_000, 20) if quick else (1_000_000, 50)
    out: dict[str, Any] = {"throughput": [], "memory": None}
    for n in shards:
        row = _throughput(n, rows, batches)
        echo(f"{n} shard(s): lookup {row['lookup_rows_per_s']:,.0f} rows/s, push {row['push_rows_per_s']:,.0f} rows/s")
        out["throughput"].append(row)
    mem_rows = memory_rows or (1_000_000 if quick else 10_000_000)
    out["memory"] = _memory(mem_rows)
    echo(f"memory: {mem_rows:,} x {DIM} float32 over 4 shards measured")
    if json_out:
        write_jsonl(json_out, [*({"bench": "embedding", **row} for row in out["throughput"]),
                               {"bench": "embedding_memory", **out["memory"]}])
    return out


def format_table(result: dict[str, Any]) -> str:
    head = ["shards", "rows", "uniq/batch", "lookup rows/s", "p50 ms", "push rows/s", "p50 ms", "numpy take rows/s", "lookup/take"]
    lines = [head]
    for r in result["throughput"]:
        lines.append([
            str(r["shards"]), f"{r['rows']:,}", f"{r['unique_ids_per_batch']:.0f}", f"{r['lookup_rows_per_s']:,.0f}",
            f"{r['lookup_p50_ms']:.2f}", f"{r['push_rows_per_s']:,.0f}", f"{r['push_p50_ms']:.2f}",
            f"{r['numpy_take_rows_per_s']:,.0f}", f"{r['lookup_ratio']:.3f}x",
        ])
    out = align(lines)
    m = result.get("memory")
    if m:
        out.append(f"\n{m['rows']:,} x {DIM} float32 table ({m['table_gb']:.2f} GB) over {m['shards']} shards:")
        for i, (held, rss, ratio) in enumerate(zip(m["held_bytes"], m["rss_bytes"], m["rss_over_held"])):
            out.append(f"  ps:{i}  holds {held / 1e9:.3f} GB  resident {rss / 1e9:.3f} GB  ({ratio:.2f}x; target <= 1.30x)")
    return "\n".join(out)


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
