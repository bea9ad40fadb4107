"""A model's tables benchmark: the lookups and pushes of many small tables, table by table against
one request a shard (``AsyncSession.lookup_many`` and ``push_many``).

A recommendation model has a table a categorical feature (DLRM: 26 for Criteo) and reads a
batch's ids from each. Here ``tables`` static tables (dim 16, float32, Adagrad) of ``rows`` rows
each live on ``shards`` ps shards, each a separate process on tcp loopback, plaintext; a step
looks up ``batch`` Zipf ids in every table, then pushes a gradient for them to every table. Two
ways, alternating step by step: table by table (every table's call in flight at once, with
``asyncio.gather``; a request per table per shard) and grouped (one request a shard for the
lookups, one for the pushes). Beside them, the same number of ids in one table of ``tables``
times the rows: what the step would cost without a table's own costs. Medians over the steps
after a warm-up. Messages are counted where the shards receive them: requests bound for one shard
in one loop tick travel in one message (``rpc.coalesce``), so table by table sends fewer
messages than requests, and each request still costs its own decoding, dispatch and reply.

Run ``zmqflow bench tables [--quick] [--tables N] [--batch N] [--shards N] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .. import loop as zf_loop
from ..client.session import AsyncSession
from ..state import init, optim
from ..transport.memory import keep_big_blocks
from .embedding import ps_cluster, zipf_ids
from .procs import SECURITY, Procs, plaintext
from .report import align, script_main, write_jsonl

__all__ = ["run", "format_table"]

DIM = 16
WARM = 5  # steps of each way before the timed ones


def run(quick: bool = False, tables: int = 8, batch: int = 512, shards: int = 2, rows: int = 100_000,
        json_out: str | None = None, steps: int | None = None) -> dict[str, Any]:
    """ms per step of each way, their ratio, and the messages a step makes each way; ``steps``
    timed (40 with ``quick``, else 150)."""
    keep_big_blocks()
    steps = steps or (40 if quick else 150)
    with plaintext():
        procs = Procs()
        try:
            spec = ps_cluster(shards, procs)
            result = zf_loop.run(_measure(spec, tables, batch, rows, steps))
        finally:
            procs.close()
    result.update(tables=tables, batch=batch, shards=shards, rows=rows, steps=steps, dim=DIM, security=SECURITY)
    result["speedup"] = result["separate_ms"] / result["grouped_ms"]
    if json_out:
        write_jsonl(json_out, [{"bench": "embedding_tables", **result}])
    return result


async def _measure(spec: Any, n: int, batch: int, rows: int, steps: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    ids = [[zipf_ids(rng, batch, rows) for _ in range(n)] for _ in range(steps + WARM)]
    grads = [np.full((batch, DIM), 1e-3, np.float32)] * n
    opt, ini = optim.Adagrad(0.05), init.normal(0.01)
    async with AsyncSession(cluster=spec, task="ps:0", timeout=300) as sess:
        embs = [await sess.embedding(f"table{k}", rows, DIM, initializer=ini, optimizer=opt) for k in range(n)]
        one = await sess.embedding("one", rows * n, DIM, initializer=ini, optimizer=opt)

        async def separate(x: list[np.ndarray]) -> None:
            await asyncio.gather(*(e.lookup(i) for e, i in zip(embs, x)))
            await asyncio.gather(*(e.push(i, g) for e, i, g in zip(embs, x, grads)))

        async def grouped(x: list[np.ndarray]) -> None:
            await sess.lookup_many(embs, x)
            await sess.push_many(embs, x, grads)

        async def single(x: list[np.ndarray]) -> None:
            flat = np.concatenate([i + k * rows for k, i in enumerate(x)])
            await one.lookup(flat)
            await one.push(flat, np.concatenate(grads))

        ways: dict[str, Callable[[list[np.ndarray]], Awaitable[None]]] = {
            "separate": separate, "grouped": grouped, "one_table": single}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for s, x in enumerate(ids):
            order = list(ways) if s % 2 else list(ways)[::-1]
            for way in order:
                began = time.perf_counter()
                await ways[way](x)
                if s >= WARM:
                    times[way].append(time.perf_counter() - began)
        messages = {way: await _messages(sess, spec, lambda w=way: ways[w](ids[0])) for way in ways}
    out: dict[str, Any] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
    out.update({f"{k}_messages": v for k, v in messages.items()})
    return out


async def _messages(sess: AsyncSession, spec: Any, step: Callable[[], Awaitable[None]]) -> int:
    """The messages the shards received for one step."""
    async def received() -> int:
        stats = [await sess.status(t) for t in spec.tasks]
        return sum(int(s["counters"]["msgs_in"]) for s in stats)

    before = await received()
    await step()
    return await received() - before - len(spec.tasks)  # less the status requests that counted


def format_table(r: dict[str, Any]) -> str:
    lines = [["way", "ms/step", "messages/step", "x table by table"]]
    for way, label in (("separate", "table by table"), ("grouped", "grouped (lookup_many, push_many)"),
                       ("one_table", "one table of all the ids")):
        lines.append([label, f"{r[f'{way}_ms']:.2f}", str(r[f"{way}_messages"]),
                      f"{r['separate_ms'] / r[f'{way}_ms']:.2f}x"])
    return (f"{r['tables']} tables x {r['batch']} Zipf ids (dim {r['dim']}, {r['rows']:,} rows each) on "
            f"{r['shards']} shard(s), lookup then push, medians of {r['steps']} steps:\n" + "\n".join(align(lines)))


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
