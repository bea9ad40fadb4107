"""zmqflow's ps shards beside TensorFlow 1-style parameter servers, doing the same work in one run.

For 1 and 2 ps tasks (each a separate process on tcp loopback, for both systems) one worker does:

* ``assign_add``: scalar ``assign_add`` round trips, one in flight (a variable on ps 0);
* ``dense``: a model of ``nvars`` float32 variables (64 MB in all by default, placed round robin)
  pulled whole, then an SGD step pushed with a fed gradient for every variable (TF:
  ``apply_gradient_descent`` on the ps); the step is the pull and the push one after the other.
  TF's ``sess.run`` returns fresh arrays, so ``dense pull`` and the step time zmqflow's pull
  without ``out=`` (fresh arrays too); ``dense pull out=`` is zmqflow's pull into the same arrays
  each time, which TF's session cannot do, against the same TF pull. Beside each repetition (first
  in odd ones, last in even ones) raw pyzmq moves the same bytes between processes of its own
  (pull then push, 4 MiB slices all in flight, over as many connections as zmqflow's streams:
  :class:`zmqflow.bench.ps.RawWire`): the wire's own time, which the step is also reported against;
* ``embedding``: 4096 Zipf ids (dim 64) looked up in a table of one partition per ps (``mod``
  ids), then their SGD rows pushed. Both sides move each batch's unique ids' rows only (about a
  third of the ids): zmqflow's client dedups them; TF takes ``tf.unique`` of the ids, looks those
  up (``tf.nn.embedding_lookup`` over a partitioned variable) and gathers back by the inverse
  index, and sums repeated ids' gradients (``unsorted_segment_sum``) before ``scatter_sub`` on
  each partition: the same SGD result.
* ``8 tables``: a model's many small tables, 8 of them (dim 16, together as many rows as the one
  table above), each batch 512 Zipf ids a table: zmqflow's ``lookup_many`` then ``push_many`` (one
  request a shard each), TF's lookups of every table in one ``sess.run`` and their pushes in
  another (one graph step each), each table as the one above.

TF runs as deployed in TF1 between-graph replication (:mod:`.tf1_side`): a ``tf.distribute.Server``
per task, the worker's ``tf.compat.v1.Session`` on its own server. Both sides plaintext (no
``ZMQFLOW_KEYS`` for zmqflow's processes or client). Medians of several repetitions; ratio =
zmqflow's throughput / TF's (above 1: zmqflow faster). Needs the ``[anchors]`` extra.

Run ``zmqflow bench ps --vs tf1 [--quick] [--shards N ...] [--model-mb MB ...] [--vars N] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from ... import loop as zf_loop
from ...client.session import AsyncSession
from ...cluster import ClusterSpec
from ...ports import free_port
from ...state import init, optim
from ...transport.memory import keep_big_blocks
from ..embedding import BATCH, DIM
from ..machine import OtherLoad
from ..procs import SECURITY, Procs, plaintext, zf_task_process
from ..ps import RawWire, zf_round_trips
from ..report import align, cell, write_jsonl
from ..stats import seconds_async
from .tf1_side import (DENSE_LR, EMB_LR, TABLE_BATCH, TABLE_DIM, TABLES, id_batches, table_batches, tf_ps_process,
                       tf_worker_process)

__all__ = ["MISSING_TF", "format_table", "plan", "run", "tf_available"]

WIRE_TARGET = 1.5  # the dense step within this factor of raw pyzmq moving the same bytes (reported only)
MISSING_TF = "zmqflow bench ps --vs tf1 needs TensorFlow: pip install 'zmqflow[anchors]' (tensorflow-cpu)"


def tf_available() -> bool:
    """Whether tensorflow can be found, without importing it (a heavy import, done by the TF processes)."""
    return importlib.util.find_spec("tensorflow") is not None


def plan(quick: bool = False, model_mbs: Sequence[float] = (64,), nvars: int = 10, reps: int | None = None,
         trips: int | None = None, rows: int | None = None, batches: int | None = None) -> dict[str, Any]:
    """What both sides do: model sizes, repetitions, scalar round trips per repetition, the table's
    rows and the number of id batches (defaults by ``quick``; any may be given, e.g. a tiny run)."""
    return {
        "model_mbs": [float(m) for m in model_mbs],
        "nvars": nvars,
        "reps": reps or (3 if quick else 7),
        "trips": trips or (300 if quick else 2000),
        "rows": rows or (200_000 if quick else 1_000_000),
        "batches": batches or (10 if quick else 30),
        "table_rows": (rows or (200_000 if quick else 1_000_000)) // TABLES,  # as many rows as the one table
        "seed": 0,
    }


class _TfWorker:
    """The TF worker process: one repetition of a measure per call, run while zmqflow's side waits."""

    def __init__(self, conn: Any):
        self.conn = conn

    def call(self, kind: str, arg: Any = None) -> Any:
        self.conn.send((kind, arg))
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"the TF worker failed: {value}")
        return value


async def _pair(zf_rep: Callable[[], Awaitable[Any]], tf: _TfWorker | None, kind: str, arg: Any, i: int,
                zf_out: list[Any], tf_out: list[Any]) -> None:
    """One repetition on each side, who goes first alternating with ``i``: both see the same load
    (the machine may be shared), neither always runs just after the other."""
    async def theirs() -> None:
        if tf is not None:
            tf_out.append(await asyncio.to_thread(tf.call, kind, arg))

    if i % 2:
        await theirs()
    zf_out.append(await zf_rep())
    if not i % 2:
        await theirs()


async def _lockstep(spec: ClusterSpec, p: dict[str, Any], tf: _TfWorker | None,
                    wire: RawWire) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every measure on both sides, repetition by repetition; TF's results empty without ``tf``.
    After each dense repetition ``wire`` moves the same bytes in raw pyzmq (``zf["wire"]``)."""
    reps, trips = p["reps"], p["trips"]
    zf: dict[str, Any] = {"scalar_s": [], "dense": {}, "embedding": [], "tables": [], "wire": {}}
    theirs: dict[str, Any] = {"scalar_s": [], "dense": {}, "embedding": [], "tables": []}
    async with AsyncSession(cluster=spec, task="ps:0", timeout=300) as sess:
        await sess.wait_for_cluster(30)

        async def scalar() -> float:
            return trips / await zf_round_trips(sess, trips)

        for i in range(reps + 1):  # the first of each is a warm-up
            await _pair(scalar, tf, "scalar", None, i, zf["scalar_s"], theirs["scalar_s"])
        for mb in p["model_mbs"]:
            per_var = int(mb * 1e6) // p["nvars"] // 4
            names = [f"d{mb:g}_{i}" for i in range(p["nvars"])]
            for name in names:
                await sess.variable(name, shape=(per_var,), optimizer=optim.SGD(DENSE_LR))
            grads = {name: np.full(per_var, 1e-3, np.float32) for name in names}
            out = {name: np.empty_like(g) for name, g in grads.items()}

            async def dense() -> list[float]:  # [pull, push, pull into out=]: TF's session has no out=
                into = await seconds_async(lambda: sess.pull(names, out=out))
                fresh = await seconds_async(lambda: sess.pull(names))
                return [fresh, await seconds_async(lambda: sess.push(grads)), into]

            zf["dense"][mb], theirs["dense"][mb], zf["wire"][mb] = [], [], []
            for i in range(reps + 1):  # the wire first in odd repetitions, last in even ones
                if i % 2:
                    zf["wire"][mb].append(sum(wire.move(per_var * 4 * p["nvars"])))
                await _pair(dense, tf, "dense", mb, i, zf["dense"][mb], theirs["dense"][mb])
                if not i % 2:
                    zf["wire"][mb].append(sum(wire.move(per_var * 4 * p["nvars"])))
        first = f"d{p['model_mbs'][0]:g}_0"
        zf["check"] = float(np.mean((await sess.pull([first]))[first][:4]))
        theirs["check"] = None if tf is None else tf.call("check", p["model_mbs"][0])
        emb = await sess.embedding("emb", p["rows"], DIM, initializer=init.normal(0.01), optimizer=optim.SGD(EMB_LR))
        batches = id_batches(p)
        g = np.full((BATCH, DIM), 1e-3, np.float32)
        warm = min(3, len(batches))
        for i, ids in enumerate([*batches[:warm], *batches]):  # the first few again, as warm-ups

            async def step(ids: np.ndarray = ids) -> list[float]:
                return [await seconds_async(lambda: emb.lookup(ids)), await seconds_async(lambda: emb.push(ids, g))]

            await _pair(step, tf, "embedding", i - warm if i >= warm else i, i, zf["embedding"], theirs["embedding"])
        await _tables(sess, p, tf, warm, zf["tables"], theirs["tables"])
    for side in (zf, theirs):  # drop the warm-ups
        side["scalar_s"] = side["scalar_s"][1:]
        side["dense"] = {mb: v[1:] for mb, v in side["dense"].items()}
        side["embedding"] = side["embedding"][warm:]
        side["tables"] = side["tables"][warm:]
    zf["wire"] = {mb: v[1:] for mb, v in zf["wire"].items()}
    return zf, theirs


async def _tables(sess: AsyncSession, p: dict[str, Any], tf: _TfWorker | None, warm: int, zf_out: list[Any],
                  tf_out: list[Any]) -> None:
    """A model's many tables: each batch's lookups of every table, then their SGD pushes, in one
    request a shard each (``lookup_many``, ``push_many``); TF's in one ``sess.run`` each."""
    opt, ini = optim.SGD(EMB_LR), init.normal(0.01)
    tables = [await sess.embedding(f"table{k}", p["table_rows"], TABLE_DIM, initializer=ini, optimizer=opt)
              for k in range(TABLES)]
    grads = [np.full((TABLE_BATCH, TABLE_DIM), 1e-3, np.float32)] * TABLES
    batches = table_batches(p)
    for i, ids in enumerate([*batches[:warm], *batches]):

        async def step(ids: list[np.ndarray] = ids) -> list[float]:
            return [await seconds_async(lambda: sess.lookup_many(tables, ids)),
                    await seconds_async(lambda: sess.push_many(tables, ids, grads))]

        await _pair(step, tf, "tables", i - warm if i >= warm else i, i, zf_out, tf_out)


def _measure(n_ps: int, p: dict[str, Any], with_tf: bool) -> tuple[dict[str, Any], dict[str, Any] | None, float | None]:
    """Both systems' clusters up side by side (idle while the other measures), then the lock-step run;
    also the CPUs other processes used meanwhile."""
    procs = Procs()
    wire: RawWire | None = None
    try:
        spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(n_ps)]})
        for t in spec.tasks:
            procs.start(zf_task_process, spec.to_json(), str(t))
        wire = RawWire(procs, n_ps, int(max(p["model_mbs"]) * 1e6))
        tf = None
        if with_tf:
            spec_json = json.dumps({"ps": [f"127.0.0.1:{free_port()}" for _ in range(n_ps)],
                                    "worker": [f"127.0.0.1:{free_port()}"]})
            for i in range(n_ps):
                procs.start(tf_ps_process, spec_json, i)
            procs.start(tf_worker_process, spec_json, p)
            tf = _TfWorker(procs.children[-1].conn)
        load = OtherLoad()
        zf, theirs = zf_loop.run(_lockstep(spec, p, tf, wire))
        return zf, theirs if with_tf else None, load.cpus()
    finally:
        if wire is not None:
            wire.close()
        procs.close()


def _row(measure: str, n_ps: int, size: str, size_bytes: int, unit: str, work: float,
         zf_s: Sequence[float], tf_s: Sequence[float] | None, calls: int = 1) -> dict[str, Any]:
    """One measure's medians: ``work`` (bytes, rows or calls) per timed repetition, as throughput;
    milliseconds per call (a repetition of ``calls`` calls)."""
    zf_med = statistics.median(zf_s)
    tf_med = statistics.median(tf_s) if tf_s else None
    return {
        "bench": "ps_vs_tf1", "measure": measure, "ps": n_ps, "size": size, "size_bytes": size_bytes, "unit": unit,
        "zmqflow": work / zf_med, "tf1": None if tf_med is None else work / tf_med,
        "zmqflow_ms": zf_med / calls * 1e3, "tf1_ms": None if tf_med is None else tf_med / calls * 1e3,
        "ratio": None if tf_med is None else tf_med / zf_med, "reps": len(zf_s),
    }


def _rows(n_ps: int, p: dict[str, Any], zf: dict[str, Any], tf: dict[str, Any] | None,
          load: float | None) -> list[dict[str, Any]]:
    """The table's rows for ``n_ps`` ps tasks; TF's columns are ``None`` where TF did not run."""
    def col(side: dict[str, Any] | None, key: Any, sub: Any = None, j: int | None = None) -> list[float] | None:
        """A side's seconds per repetition: all of them, the ``j``-th of each, or (``j=-1``) a
        step's, the first two (pull and push, lookup and push) added."""
        if side is None:
            return None
        got = side[key] if sub is None else side[key][sub]
        return got if j is None else [x[j] if j >= 0 else x[0] + x[1] for x in got]

    rows = [_row("assign_add", n_ps, "4 B", 4, "calls/s", p["trips"], zf["scalar_s"], col(tf, "scalar_s"),
                 calls=p["trips"])]
    for mb in p["model_mbs"]:
        nbytes = int(mb * 1e6) // p["nvars"] // 4 * 4 * p["nvars"]
        size = f"{mb:g} MB / {p['nvars']} vars"
        for what, j, k in (("pull", 0, 0), ("pull out=", 2, 0), ("push", 1, 1)):  # zmqflow's j-th, TF's k-th
            rows.append(_row(f"dense {what}", n_ps, size, nbytes, "GB/s", nbytes / 1e9, col(zf, "dense", mb, j),
                             col(tf, "dense", mb, k)))
        rows.append(_row("dense step", n_ps, size, nbytes, "GB/s", 2 * nbytes / 1e9, col(zf, "dense", mb, -1),
                         col(tf, "dense", mb, -1)))
        wire_s = statistics.median(zf["wire"][mb])  # raw pyzmq pulling and pushing the same bytes
        rows[-1]["wire_ms"] = wire_s * 1e3
        rows[-1]["over_wire"] = rows[-1]["zmqflow_ms"] / rows[-1]["wire_ms"]
        if mb == p["model_mbs"][0]:
            rows[-1]["final_value"] = {"zmqflow": zf["check"], "tf1": None if tf is None else tf["check"]}
    for j, what in enumerate(("lookup", "push", "step")):
        rows.append(_row(f"embedding {what}", n_ps, f"{BATCH} ids", BATCH * DIM * 4, "rows/s", BATCH,
                         col(zf, "embedding", None, j if j < 2 else -1), col(tf, "embedding", None, j if j < 2 else -1)))
    for j, what in enumerate(("lookup", "push", "step")):
        ids = TABLES * TABLE_BATCH
        rows.append(_row(f"{TABLES} tables {what}", n_ps, f"{TABLES} x {TABLE_BATCH} ids", ids * TABLE_DIM * 4,
                         "rows/s", ids, col(zf, "tables", None, j if j < 2 else -1),
                         col(tf, "tables", None, j if j < 2 else -1)))
    for r in rows:
        r["table_rows"] = (p["rows"] if r["measure"].startswith("embedding") else
                           p["table_rows"] if r["measure"].startswith(f"{TABLES} tables") else None)
        r["other_load_cpus"] = load
        r["security"] = SECURITY
    return rows


def run(quick: bool = False, shards: Sequence[int] = (1, 2), model_mbs: Sequence[float] = (64,),
        json_out: str | None = None, echo: Any = print, tf: bool = True, **sizes: Any) -> list[dict[str, Any]]:
    """The rows of every measure for each ps count, appended to ``json_out`` as each count is done.
    ``tf=False`` measures zmqflow's side only (TF's columns ``None``); ``sizes`` go to :func:`plan`."""
    keep_big_blocks()
    p = plan(quick, model_mbs, **sizes)
    out: list[dict[str, Any]] = []
    for n in shards:
        with plaintext():
            rows = _rows(n, p, *_measure(n, p, tf))
        step = next(r for r in rows if r["measure"] == "dense step")
        echo(f"measured {n} ps: dense step {step['zmqflow_ms']:.1f} ms"
             + (f" vs tf1 {step['tf1_ms']:.1f} ms" if step["tf1_ms"] is not None else ""))
        out += rows
        if json_out:
            write_jsonl(json_out, rows)
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["measure", "ps", "size", "unit", "zmqflow", "tf1", "zmqflow ms", "tf1 ms", "ratio"]
    lines = [head]
    for r in rows:
        lines.append([
            r["measure"], str(r["ps"]), r["size"], r["unit"], _num(r["zmqflow"]), _num(r["tf1"]),
            cell(r["zmqflow_ms"], ".2f"), cell(r["tf1_ms"], ".2f"), cell(r["ratio"], ".2f") + ("x" if r["ratio"] else ""),
        ])
    out = align(lines)
    reps = {r["reps"] for r in rows if r["table_rows"] is None}
    batches = {r["reps"] for r in rows if r["table_rows"] is not None}
    out.append(f"medians of {'/'.join(map(str, sorted(reps)))} repetitions (embedding: of "
               f"{'/'.join(map(str, sorted(batches)))} id batches); ratio = zmqflow throughput / tf1 throughput "
               "(above 1: zmqflow faster); dense step GB/s counts the bytes pulled and pushed")
    out.append("dense pull and step: zmqflow's pull into fresh arrays, as TF's sess.run returns them; "
               "dense pull out=: into the same arrays each time (TF's session has no out=)")
    for r in rows:
        if r.get("wire_ms") is not None:
            out.append(f"dense step, {r['ps']} ps, {r['size']}: {r['zmqflow_ms']:.1f} ms against {r['wire_ms']:.1f} ms "
                       f"for raw pyzmq to move the same bytes in this run: {r['over_wire']:.2f}x the wire "
                       f"(moonshot: within {WIRE_TARGET:g}x)")
    loads = {r["ps"]: r["other_load_cpus"] for r in rows if r["other_load_cpus"] is not None}
    if loads:
        out.append("CPUs kept busy by other processes meanwhile: "
                   + ", ".join(f"{v:.2f} ({n} ps)" for n, v in sorted(loads.items())))
    return "\n".join(out)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3f}"
