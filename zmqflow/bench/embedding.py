"""Embedding benchmark: sharded lookups and sparse pushes, and the memory of a big table.

Batches of 4096 Zipf-distributed ids (dim 64, float32) are looked up in, and pushed to (SGD), a
static table spread over 1, 2 and 4 ps shards, each a separate process on tcp loopback, plaintext.
Beside it, in the same run: numpy ``take`` of the same ids from one in-process array of the same size,
the physical reference for a gather. Then a ``num_rows`` x 64 float32 table (10,000,000 rows,
2.56 GB, by default) is created over 4 shards and each shard's resident memory is compared with
the bytes it holds (target: within 1.3x; reported, never asserted), and the same for a dynamic
table filled with as many ids (target: within 1.1x). For memory the shards are what a deployment
runs, a ``zmqflow serve`` process each, and their RSS is read once each has made its idle heap
trim (``zmqflow.server.idle_trim``: after 1 s with no traffic, as ``zmqflow serve`` makes it),
waited for by polling their status, with a deadline.

A dynamic table's index, in process: new-id insertion per id (the index alone, and through the
table's lookup, rows created), a 4096-id Zipf lookup (the index alone, and the table's whole
lookup with its rows), and bytes of index per id (and per id pending admission), beside the dict-based index dynamic tables had before (``_DictTable``), in the same
run (targets: lookup >= 10x faster, <= 40 bytes per id).

Run ``zmqflow bench embedding [--quick] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import loop as zf_loop
from ..client.session import AsyncSession
from ..cluster import ClusterSpec
from ..errors import ClusterNotReady
from ..ports import free_port
from ..rpc.health import wait_for_tasks
from ..state import hash_index, init, optim
from ..state.hash_index import HashIndex
from ..state.tables import HashTable
from ..transport.memory import keep_big_blocks
from .machine import rss_bytes
from .procs import SECURITY, Procs, Served, plaintext, zf_task_process
from .report import align, script_main, write_jsonl
from .stats import seconds, seconds_async

__all__ = ["format_table", "run", "ps_cluster", "zipf_ids"]

DIM = 64
BATCH = 4096
FILL_BATCH = 1 << 16  # ids per lookup filling a dynamic table


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float = 1.2) -> np.ndarray:
    """Zipf-distributed ids: a few hot rows, a long tail, spread over the table by a permutation."""
    return (rng.zipf(a, n) - 1) % rows * 7919 % rows


def ps_cluster(shards: int, procs: Procs) -> ClusterSpec:
    """``shards`` ps task servers, each in its own process, on tcp loopback."""
    spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(shards)]})
    for t in spec.tasks:
        procs.start(zf_task_process, spec.to_json(), str(t))
    return spec


def _throughput(shards: int, rows: int, batches: int) -> dict[str, Any]:
    """Lookups and pushes of ``batches`` batches over ``shards`` shards, beside numpy ``take``."""
    procs = Procs()
    try:
        spec = ps_cluster(shards, procs)
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


def _memory(rows: int, shards: int = 4, dynamic: bool = False) -> dict[str, Any]:
    """Each shard's resident memory beside the bytes it holds, for a ``rows`` x DIM table: static,
    or dynamic and filled with ``rows`` ids. The held bytes are the rows with their bookkeeping;
    the id index and admission state are not among them, so they count as overhead. The
    shards are ``zmqflow serve`` processes, as deployed; RSS is read once each has gone quiet
    and handed its free heap back (its idle trim)."""
    spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(shards)]})
    served = Served(spec)
    try:
        async def main() -> tuple[list[int], list[int], list[int]]:
            async with AsyncSession(cluster=spec, task="ps:0", timeout=600) as sess:
                await _ready(sess, spec, served)
                base = [rss_bytes(pid) for pid in served.pids]
                emb = await sess.embedding("big", None if dynamic else rows, DIM, initializer=init.normal(0.01),
                                           optimizer=optim.SGD(0.1))
                for start in range(0, rows if dynamic else 0, FILL_BATCH):
                    await emb.lookup(np.arange(start, min(rows, start + FILL_BATCH)))
                rng = np.random.default_rng(2)
                for _ in range(5):
                    ids = zipf_ids(rng, BATCH, rows)
                    await emb.lookup(ids)
                    await emb.push(ids, np.ones((BATCH, DIM), np.float32))
                held = [s["bytes"] for s in await emb.stats()]
                await _trimmed(sess, spec)
                return base, held, [rss_bytes(pid) for pid in served.pids]

        base, held, rss = zf_loop.run(main())
        return {
            "kind": "dynamic" if dynamic else "static",
            "rows": rows,
            "table_gb": rows * DIM * 4 / 1e9,
            "shards": shards,
            "held_bytes": held,
            "rss_bytes": rss,
            "idle_rss_bytes": base,
            "rss_over_held": [r / h for r, h in zip(rss, held)],
            "growth_over_held": [(r - b) / h for r, b, h in zip(rss, base, held)],
        }
    finally:
        served.close()


async def _ready(sess: AsyncSession, spec: ClusterSpec, served: Served, timeout: float = 60.0) -> None:
    """Every task answers a ping (RuntimeError with its output if one exited first)."""
    deadline = time.monotonic() + timeout
    while True:
        served.check()
        try:
            await wait_for_tasks(sess.client, spec, 1.0, list(spec.tasks))
            return
        except ClusterNotReady:
            if time.monotonic() > deadline:
                raise


async def _trimmed(sess: AsyncSession, spec: ClusterSpec, timeout: float = 60.0) -> None:
    """Until each task has made an idle heap trim since now, polled (a status call is small: the
    tasks stay quiet). Called right after the last big message, so that trim is still to come
    (a task trims a whole quiet period after it at the earliest); TimeoutError past ``timeout``."""
    async def trims() -> list[int]:
        return [(await sess.status(str(t)))["counters"]["heap_trims"] for t in spec.tasks]

    before = await trims()
    deadline = time.monotonic() + timeout
    while any(n <= b for n, b in zip(await trims(), before)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shards made no idle heap trim within {timeout:g}s")
        await asyncio.sleep(0.2)


class _DictTable:
    """The baseline: dynamic tables as they were before their numpy index, a dict from id to
    slot, a list of free slots and a dict of pending counts over the same row arrays, with the
    same lookup (admission loop, then the found rows) and the same growth of the row arrays.
    Filled up to its capacity, no further: it has no eviction."""

    def __init__(self, capacity: int, min_frequency: int = 1):
        self.index: dict[int, int] = {}
        self.sightings: dict[int, int] = {}
        self.min_frequency = min_frequency
        self.capacity = capacity
        n = min(1024, capacity)
        self.ids = np.zeros(n, np.int64)
        self.values = np.zeros((n, DIM), np.float32)
        self.steps, self.last_used, self.updated_step = (np.zeros(n, np.int64) for _ in range(3))
        self.updated_time = np.zeros(n)
        self.free = list(range(n - 1, -1, -1))
        self.tick = 0

    def _grow(self) -> None:
        old = len(self.ids)
        new = min(old * 2, self.capacity)
        for name in ("ids", "values", "steps", "last_used", "updated_step", "updated_time"):
            arr = getattr(self, name)
            grown = np.zeros((new, *arr.shape[1:]), arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        self.free.extend(range(new - 1, old - 1, -1))

    def _create(self, new_ids: list[int]) -> None:
        while len(self.free) < len(new_ids):
            self._grow()
        slots = np.array([self.free.pop() for _ in new_ids], dtype=np.int64)
        for i, s in zip(new_ids, slots):
            self.index[i] = int(s)
            self.sightings.pop(i, None)
        self.ids[slots] = new_ids
        self.values[slots] = 0.0
        self.steps[slots] = 0
        self.last_used[slots] = self.tick
        self.updated_step[slots] = 0
        self.updated_time[slots] = time.time()

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        self.tick += 1
        keys = ids.tolist()
        unseen = []
        for i in keys:
            if i in self.index:
                continue
            seen = self.sightings.get(i, 0) + 1
            if seen >= self.min_frequency:
                unseen.append(i)
            else:
                self.sightings[i] = seen
        if unseen:
            self._create(unseen)
        out = np.zeros((len(keys), DIM), np.float32)
        found = [(k, self.index[i]) for k, i in enumerate(keys) if i in self.index]
        if found:
            pos = np.array([k for k, _ in found], dtype=np.int64)
            slots = np.array([s for _, s in found], dtype=np.int64)
            out[pos] = self.values[slots]
            self.last_used[slots] = self.tick
        return out

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The index alone: each id's slot, -1 where absent."""
        index = self.index
        return np.array([index.get(i, -1) for i in ids.tolist()], np.int64)


def _traced_bytes(build: Any) -> tuple[Any, int]:
    """What ``build()`` returns, and the bytes of Python objects it left allocated."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        made = build()
        return made, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _dict_of(ids: np.ndarray, value: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for start in range(0, len(ids), FILL_BATCH):
        for k, i in enumerate(ids[start:start + FILL_BATCH].tolist()):
            out[i] = value(start + k)
    return out


def _dynamic_index(rows: int, batches: int) -> dict[str, Any]:
    """A dynamic table part's index beside the dict-based baseline, in this process: ``rows``
    random int64 ids inserted 4096 at a time through lookups (the best of three fills), then
    ``batches`` Zipf lookups (medians)."""
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, rows + rows // 100))[:rows]
    ids = ids[rng.permutation(len(ids))]
    fill = {"index": float("inf"), "dict": float("inf")}
    for rep in range(3):  # fresh tables each time, in turns: the first to fault in fresh pages alternates
        table, base = HashTable(DIM, np.dtype(np.float32), capacity=rows), _DictTable(rows)
        for name in ("index", "dict") if rep % 2 == 0 else ("dict", "index"):
            lookup = table.lookup if name == "index" else base.lookup
            took = sum(seconds(lambda: lookup(ids[start:start + BATCH])) for start in range(0, rows, BATCH))
            fill[name] = min(fill[name], took)
    index_fill = {"index": float("inf"), "dict": float("inf")}
    for _ in range(3):  # the index alone: a HashIndex over ``ids`` (slot k holds ids[k]), and a dict
        index, slots, plain = HashIndex(np.int32), np.arange(rows), {}
        index_fill["index"] = min(index_fill["index"], sum(
            seconds(lambda: index.insert(ids[start:start + BATCH], slots[start:start + BATCH], ids))
            for start in range(0, rows, BATCH)))
        index_fill["dict"] = min(index_fill["dict"], sum(
            seconds(lambda: plain.update(zip(ids[start:start + BATCH].tolist(), range(start, start + BATCH))))
            for start in range(0, rows, BATCH)))
    queries = [ids[zipf_ids(rng, BATCH, rows)] for _ in range(batches)]
    calls = {"find": lambda q: table.index.find(q, table.ids), "dict_find": base.find,
             "lookup": table.lookup, "dict_lookup": base.lookup}
    compiled = hash_index.compiled()
    if compiled:  # the numpy rounds beside the C probe, in the same turns
        calls["numpy_find"] = _numpy_rounds(calls["find"])
        calls["numpy_lookup"] = _numpy_rounds(table.lookup)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(3):  # each in turn over every batch, three times, so that all see the same machine
        for name, call in calls.items():
            times[name] += [seconds(lambda: call(q)) for q in queries]
    p50 = {k: statistics.median(v) for k, v in times.items()}
    _, dict_bytes = _traced_bytes(lambda: _dict_of(ids, lambda k: k + 1000))  # slots are ints past the cache
    pending = HashTable(DIM, np.dtype(np.float32), capacity=rows, min_frequency=2, max_pending=rows + 1)
    for start in range(0, rows, BATCH):
        pending.lookup(ids[start:start + BATCH])
    _, dict_pending = _traced_bytes(lambda: _dict_of(ids, lambda k: 1))
    out = {
        "rows": rows,
        "insert_ns_per_id": fill["index"] / rows * 1e9,
        "index_insert_ns_per_id": index_fill["index"] / rows * 1e9,
        "dict_index_insert_ns_per_id": index_fill["dict"] / rows * 1e9,
        "dict_insert_ns_per_id": fill["dict"] / rows * 1e9,
        "find_p50_us": p50["find"] * 1e6,
        "dict_find_p50_us": p50["dict_find"] * 1e6,
        "lookup_p50_us": p50["lookup"] * 1e6,
        "dict_lookup_p50_us": p50["dict_lookup"] * 1e6,
        "index_bytes_per_id": table.index.nbytes / len(table),
        "dict_bytes_per_id": dict_bytes / rows,
        "pending_bytes_per_id": pending.sightings.nbytes / len(pending.sightings),
        "dict_pending_bytes_per_id": dict_pending / rows,
        "index_load": len(table) / table.index.buckets,
        "probe": "C" if compiled else "numpy",
    }
    if compiled:
        out["numpy_find_p50_us"], out["numpy_lookup_p50_us"] = p50["numpy_find"] * 1e6, p50["numpy_lookup"] * 1e6
    out["find_speedup"] = out["dict_find_p50_us"] / out["find_p50_us"]
    out["lookup_speedup"] = out["dict_lookup_p50_us"] / out["lookup_p50_us"]
    out["insert_speedup"] = out["dict_insert_ns_per_id"] / out["insert_ns_per_id"]
    out["index_insert_speedup"] = out["dict_index_insert_ns_per_id"] / out["index_insert_ns_per_id"]
    return out


def _numpy_rounds(call: Any) -> Any:
    """``call`` with the index's C probe turned off (the numpy rounds), and back on after."""
    def run_numpy(q: np.ndarray) -> Any:
        before = hash_index.use_compiled(False)
        try:
            return call(q)
        finally:
            hash_index.use_compiled(before)
    return run_numpy


PARTS = ("throughput", "memory", "dynamic", "dynamic_memory")


def run(quick: bool = False, shards: Sequence[int] = (1, 2, 4), json_out: str | None = None,
        memory_rows: int | None = None, echo: Any = print, parts: Sequence[str] = PARTS) -> dict[str, Any]:
    """``{"throughput": [one row per shard count], "memory": {...}, "dynamic": {...},
    "dynamic_memory": {...}}`` (the ``parts`` asked for), appended to ``json_out``."""
    keep_big_blocks()
    with plaintext():  # the shards and this process's sessions: no keys, as numpy's side has none
        return _run(quick, shards, json_out, memory_rows, echo, parts)


def _run(quick: bool, shards: Sequence[int], json_out: str | None, memory_rows: int | None, echo: Any,
         parts: Sequence[str]) -> dict[str, Any]:
    rows, batches = (200_000, 20) if quick else (1_000_000, 50)
    out: dict[str, Any] = {"throughput": [], "memory": None, "dynamic": None, "dynamic_memory": None}
    for n in shards if "throughput" in parts else ():
        row = {**_throughput(n, rows, batches), "security": SECURITY}
        echo(f"{n} shard(s): lookup {row['lookup_rows_per_s']:,.0f} rows/s, push {row['push_rows_per_s']:,.0f} rows/s")
        out["throughput"].append(row)
    mem_rows = memory_rows or (1_000_000 if quick else 10_000_000)
    if "memory" in parts:
        out["memory"] = _memory(mem_rows)
        echo(f"memory: {mem_rows:,} x {DIM} float32 over 4 shards measured")
    if "dynamic" in parts:
        out["dynamic"] = _dynamic_index(rows, batches * 2)
        echo(f"dynamic index: {rows:,} ids measured beside a dict")
    if "dynamic_memory" in parts:
        out["dynamic_memory"] = _memory(mem_rows, dynamic=True)
        echo(f"memory: dynamic table of {mem_rows:,} ids x {DIM} float32 over 4 shards measured")
    if json_out:
        records = [{"bench": "embedding", **row} for row in out["throughput"]]
        records += [{"bench": f"embedding_{k}", **out[k]} for k in ("memory", "dynamic", "dynamic_memory") if out[k]]
        write_jsonl(json_out, records)
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
    out = align(lines) if result["throughput"] else []
    for m in (result.get("memory"), result.get("dynamic_memory")):
        if m:
            out.append(f"\n{m['rows']:,} x {DIM} float32 {m['kind']} table ({m['table_gb']:.2f} GB) over {m['shards']} shards:")
            for i, (held, rss, ratio, grew) in enumerate(zip(m["held_bytes"], m["rss_bytes"], m["rss_over_held"],
                                                             m["growth_over_held"])):
                out.append(f"  ps:{i}  holds {held / 1e9:.3f} GB  resident {rss / 1e9:.3f} GB  ({ratio:.3f}x; "
                           f"{grew:.3f}x less the idle process; target <= 1.30x static, 1.10x dynamic)")
    d = result.get("dynamic")
    if d:
        probe = d.get("probe", "numpy")
        out.append(f"\ndynamic table index, {d['rows']:,} ids (load {d['index_load']:.2f}), probe in {probe}, "
                   "beside a dict:")
        out += align([
            ["", f"index ({probe})", "dict", "speedup"],
            ["4096-id Zipf lookup, index (us)", f"{d['find_p50_us']:.0f}", f"{d['dict_find_p50_us']:.0f}",
             f"{d['find_speedup']:.1f}x"],
            ["4096-id Zipf lookup, with rows (us)", f"{d['lookup_p50_us']:.0f}", f"{d['dict_lookup_p50_us']:.0f}",
             f"{d['lookup_speedup']:.1f}x"],
            ["new id, index alone (ns/id)", f"{d['index_insert_ns_per_id']:.0f}",
             f"{d['dict_index_insert_ns_per_id']:.0f}", f"{d['index_insert_speedup']:.1f}x"],
            ["new id, through the table's lookup (ns/id)", f"{d['insert_ns_per_id']:.0f}", f"{d['dict_insert_ns_per_id']:.0f}",
             f"{d['insert_speedup']:.1f}x"],
            ["index bytes per id", f"{d['index_bytes_per_id']:.1f}", f"{d['dict_bytes_per_id']:.1f}", ""],
            ["bytes per id pending admission", f"{d['pending_bytes_per_id']:.1f}", f"{d['dict_pending_bytes_per_id']:.1f}", ""],
        ])
        if "numpy_lookup_p50_us" in d:
            out.append(f"  the numpy rounds in the same run: index {d['numpy_find_p50_us']:.0f} us, "
                       f"with rows {d['numpy_lookup_p50_us']:.0f} us")
        out.append("  targets: lookup >= 10x the dict, <= 40 bytes per id")
    return "\n".join(out)


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
