"""zmqflow's ps shards beside TensorFlow 1-style parameter servers, doing the same work in one run.

For 1 and 2 ps tasks (each a separate process on tcp loopback, for both systems) one worker does:

* ``assign_add``: scalar ``assign_add`` round trips, one in flight (a variable on ps 0);
* ``dense``: a model of ``nvars`` float32 variables (64 MB in all by default, placed round robin)
  pulled whole, then an SGD step pushed with a fed gradient for every variable (TF:
  ``apply_gradient_descent`` on the ps); the step is the pull and the push one after the other;
* ``embedding``: 4096 Zipf ids (dim 64) looked up in a table of one partition per ps (``mod``
  ids), then their SGD rows pushed (TF: ``tf.nn.embedding_lookup`` over a partitioned variable,
  the lookup's gradient applied with ``scatter_sub`` on each partition).

TF runs as deployed in TF1 between-graph replication (:mod:`.tf1_side`): a ``tf.distribute.Server``
per task, the worker's ``tf.compat.v1.Session`` on its own server. Medians of several repetitions;
ratio = zmqflow's throughput / TF's (above 1: zmqflow faster). Needs the ``[anchors]`` extra.

Run ``zmqflow bench ps --vs tf1 [--quick] [--shards N ...] [--model-mb MB ...] [--json FILE]``.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from ... import loop as zf_loop
from ...client.session import AsyncSession
from ...cluster import ClusterSpec
from ...ports import free_port
from ...state import init, optim
from ...transport.memory import keep_big_blocks
from ..embedding import BATCH, DIM, zipf_ids
from ..machine import OtherLoad
from ..procs import Procs, run_to_end, spawn_queue, zf_task_process
from ..ps import zf_model, zf_round_trips
from ..report import align, cell, write_jsonl
from ..stats import seconds_async
from .tf1_side import DENSE_LR, EMB_LR, tf_ps_process, tf_worker_process

__all__ = ["MISSING_TF", "format_table", "plan", "run", "tf_available"]

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
        "seed": 0,
    }


async def _zf_side(spec: ClusterSpec, p: dict[str, Any]) -> dict[str, Any]:
    """zmqflow's half: the same measures, in the same order, as :func:`.tf1_side.tf_worker_process`."""
    reps, trips = p["reps"], p["trips"]
    out: dict[str, Any] = {"dense": {}}
    async with AsyncSession(cluster=spec, task="ps:0", timeout=300) as sess:
        await sess.wait_for_cluster(30)
        await zf_round_trips(sess, trips)  # warm up
        out["scalar_per_s"] = [await zf_round_trips(sess, trips) for _ in range(reps)]
        for mb in p["model_mbs"]:
            per_var = int(mb * 1e6) // p["nvars"] // 4
            names = [f"d{mb:g}_{i}" for i in range(p["nvars"])]
            for name in names:
                await sess.variable(name, shape=(per_var,), optimizer=optim.SGD(DENSE_LR))
            grads = {name: np.full(per_var, 1e-3, np.float32) for name in names}
            await zf_model(sess, names, grads, 1)  # warm up
            pulls, pushes = await zf_model(sess, names, grads, reps)
            out["dense"][mb] = {"pull_s": pulls, "push_s": pushes}
        first = f"d{p['model_mbs'][0]:g}_0"
        out["check"] = float(np.mean((await sess.pull([first]))[first][:4]))
        emb = await sess.embedding("emb", p["rows"], DIM, initializer=init.normal(0.01), optimizer=optim.SGD(EMB_LR))
        rng = np.random.default_rng(p["seed"])
        batches = [zipf_ids(rng, BATCH, p["rows"]) for _ in range(p["batches"])]
        g = np.full((BATCH, DIM), 1e-3, np.float32)
        for ids in batches[:3]:  # warm up
            await emb.lookup(ids)
            await emb.push(ids, g)
        lookups, pushes = [], []
        for ids in batches:
            lookups.append(await seconds_async(lambda: emb.lookup(ids)))
            pushes.append(await seconds_async(lambda: emb.push(ids, g)))
        out["embedding"] = {"lookup_s": lookups, "push_s": pushes}
    return out


def _measure_zf(n_ps: int, p: dict[str, Any]) -> dict[str, Any]:
    procs = Procs()
    try:
        spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(n_ps)]})
        for t in spec.tasks:
            procs.start(zf_task_process, spec.to_json(), str(t))
        load = OtherLoad()
        res = zf_loop.run(_zf_side(spec, p))
        res["other_load_cpus"] = load.cpus()
        return res
    finally:
        procs.close()


def _measure_tf(n_ps: int, p: dict[str, Any]) -> dict[str, Any]:
    procs = Procs()
    try:
        spec_json = json.dumps({"ps": [f"127.0.0.1:{free_port()}" for _ in range(n_ps)],
                                "worker": [f"127.0.0.1:{free_port()}"]})
        for i in range(n_ps):
            procs.start(tf_ps_process, spec_json, i)
        out = spawn_queue()
        load = OtherLoad()
        run_to_end(tf_worker_process, [(spec_json, p, out)], 1800)
        _, res = out.get(timeout=60)
        res["other_load_cpus"] = load.cpus()
        return res
    finally:
        procs.close()


def _row(measure: str, n_ps: int, size: str, size_bytes: int, unit: str, work: float,
         zf_s: Sequence[float], tf_s: Sequence[float] | None) -> dict[str, Any]:
    """One measure's medians: ``work`` (bytes, rows or calls) per timed repetition, as throughput."""
    zf_med = statistics.median(zf_s)
    tf_med = statistics.median(tf_s) if tf_s else None
    return {
        "bench": "ps_vs_tf1", "measure": measure, "ps": n_ps, "size": size, "size_bytes": size_bytes, "unit": unit,
        "zmqflow": work / zf_med, "tf1": None if tf_med is None else work / tf_med,
        "zmqflow_ms": zf_med * 1e3, "tf1_ms": None if tf_med is None else tf_med * 1e3,
        "ratio": None if tf_med is None else tf_med / zf_med, "reps": len(zf_s),
    }


def _rows(n_ps: int, p: dict[str, Any], zf: dict[str, Any], tf: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The table's rows for ``n_ps`` ps tasks; TF's columns are ``None`` where TF did not run."""
    def secs(side: dict[str, Any] | None, *path: Any) -> Any:
        for key in path:
            if side is None:
                return None
            side = side[key]
        return side

    def step(side: dict[str, Any] | None, part: str, a: str, b: str) -> list[float] | None:
        got = secs(side, part)
        return None if got is None else [x + y for x, y in zip(got[a], got[b])]

    rows = [_row("assign_add", n_ps, "4 B", 4, "calls/s", 1.0, [1 / r for r in zf["scalar_per_s"]],
                 None if tf is None else [1 / r for r in tf["scalar_per_s"]])]
    for mb in p["model_mbs"]:
        nbytes = int(mb * 1e6) // p["nvars"] // 4 * 4 * p["nvars"]
        size = f"{mb:g} MB"
        for what in ("pull", "push"):
            rows.append(_row(f"dense {what}", n_ps, size, nbytes, "GB/s", nbytes / 1e9, zf["dense"][mb][f"{what}_s"],
                             secs(tf, "dense", mb, f"{what}_s")))
        rows.append(_row("dense step", n_ps, size, nbytes, "GB/s", 2 * nbytes / 1e9,
                         step(zf["dense"], mb, "pull_s", "push_s"), step(secs(tf, "dense"), mb, "pull_s", "push_s")))
        rows[-1]["final_value"] = {"zmqflow": zf["check"], "tf1": secs(tf, "check")}
    ids = f"{BATCH} ids"
    for what in ("lookup", "push"):
        rows.append(_row(f"embedding {what}", n_ps, ids, BATCH * DIM * 4, "rows/s", BATCH, zf["embedding"][f"{what}_s"],
                         secs(tf, "embedding", f"{what}_s")))
    rows.append(_row("embedding step", n_ps, ids, BATCH * DIM * 4, "rows/s", BATCH,
                     step(zf, "embedding", "lookup_s", "push_s"), step(tf, "embedding", "lookup_s", "push_s")))
    for r in rows:
        r["table_rows"] = p["rows"] if r["measure"].startswith("embedding") else None
        r["other_load_cpus"] = {"zmqflow": zf["other_load_cpus"], "tf1": secs(tf, "other_load_cpus")}
    return rows


def run(quick: bool = False, shards: Sequence[int] = (1, 2), model_mbs: Sequence[float] = (64,),
        json_out: str | None = None, echo: Any = print, tf: bool = True, **sizes: Any) -> list[dict[str, Any]]:
    """The rows of every measure for each ps count, appended to ``json_out`` as each count is done.
    ``tf=False`` measures zmqflow's side only (TF's columns ``None``); ``sizes`` go to :func:`plan`."""
    keep_big_blocks()
    p = plan(quick, model_mbs, **sizes)
    out: list[dict[str, Any]] = []
    for n in shards:
        zf = _measure_zf(n, p)
        theirs = _measure_tf(n, p) if tf else None
        rows = _rows(n, p, zf, theirs)
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
    reps = sorted({r["reps"] for r in rows})
    out.append(f"medians of {'/'.join(map(str, reps))} repetitions; ratio = zmqflow throughput / tf1 throughput "
               "(above 1: zmqflow faster); dense step GB/s counts the bytes pulled and pushed")
    loads = {(r["ps"], side): v for r in rows for side, v in r["other_load_cpus"].items() if v is not None}
    if loads:
        out.append("CPUs kept busy by other processes meanwhile: "
                   + ", ".join(f"{side} {n} ps {v:.2f}" for (n, side), v in sorted(loads.items())))
    return "\n".join(out)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3f}"
