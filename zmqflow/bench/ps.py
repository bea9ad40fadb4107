"""Parameter-server benchmark: pull and push of a whole model, and scalar update round trips.

A model of ``nvars`` float32 variables (100 MB in all by default, 20 MB with ``--quick``) lives
on 1, 2 and 4 ps shards, each a separate process on tcp loopback; one client pulls every variable
and pushes a gradient for every variable (no optimizer: the shard adds it in place). Beside it,
in the same run, raw pyzmq moves the same bytes between the same number of processes: a DEALER
per shard asking for (or sending) the same ``SLICE_BYTES`` (4 MiB) slices, all in flight at
once, to a ROUTER that answers each with a ready buffer (or an ack); the two alternate
repetition by repetition. zmqflow's pull is timed twice: into the same ``out=`` arrays each time,
and without ``out=`` (the received frames themselves, which is what raw keeps). Then scalar
``assign_add`` round trips per second against a raw pyzmq request/reply of a few bytes, in
alternating halves. Reported as ratios;
targets: pull >= 0.9x and push >= 0.8x raw GB/s, scalar updates >= 0.7x raw round trips
(reported, never asserted).

Run ``zmqflow bench ps [--quick] [--shards N ...] [--json FILE]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from .. import loop as zf_loop
from ..client.session import AsyncSession
from ..client.variables import SLICE_BYTES
from ..cluster import ClusterSpec
from ..ports import free_port
from ..transport.memory import keep_big_blocks
from .procs import Procs, zf_task_process
from .report import align, script_main, write_jsonl
from .stats import seconds, seconds_async

__all__ = ["RawWire", "format_table", "run", "zf_model", "zf_round_trips"]

MB = 1e6
PULL_TARGET, PUSH_TARGET, SCALAR_TARGET = 0.9, 0.8, 0.7  # zmqflow / raw: reported, never asserted


def _raw_ps_process(port: int, nbytes: int, conn: Any) -> None:
    """Process entry (see :mod:`zmqflow.bench.procs`): a ROUTER that answers b"pull a,b" with
    those bytes of its buffer, anything else (a pushed slice) with an ack."""
    keep_big_blocks()  # the same allocator as the zmqflow side
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    buf = np.ones(max(nbytes, SLICE_BYTES) // 4, np.float32)
    view = buf.view(np.uint8)
    conn.send(("ready", port))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not conn.poll():  # a stop message or EOF (parent gone)
        if not poller.poll(100):
            continue
        ident, head, *rest = sock.recv_multipart(copy=False)
        if head.bytes[:4] == b"pull":
            start, stop_ = (int(x) for x in head.bytes[5:].split(b","))
            sock.send_multipart([ident, b"ok", view[start:stop_]], copy=False)
        else:
            sock.send_multipart([ident, b"ok"])
    sock.close(0)
    ctx.term()


def _pull_push(socks: list[zmq.Socket], plan: list[list[tuple[int, int]]], payload: np.ndarray) -> tuple[float, float]:
    """Seconds to pull every shard's slices, then to push them, each time all in flight at once."""
    view = payload.view(np.uint8)
    start = time.perf_counter()
    for sock, ranges in zip(socks, plan):
        for a, b in ranges:
            sock.send(b"pull %d,%d" % (a, b))
    got = 0
    for sock, ranges in zip(socks, plan):
        for _ in ranges:
            got += len(sock.recv_multipart(copy=False)[1])
    pull_s = time.perf_counter() - start
    start = time.perf_counter()
    for sock, ranges in zip(socks, plan):
        for a, b in ranges:
            sock.send_multipart([b"push", view[a:b]], copy=False)
    for sock, ranges in zip(socks, plan):
        for _ in ranges:
            sock.recv_multipart()
    return pull_s, time.perf_counter() - start


def _round_trips(sock: zmq.Socket, n: int) -> float:
    """Request/reply round trips per second of a few bytes, one in flight."""

    def trips() -> None:
        for _ in range(n):
            sock.send(b"add 1")
            sock.recv_multipart()

    return n / seconds(trips)


def _slices(total: int, shards: int) -> list[list[tuple[int, int]]]:
    """Each shard's byte ranges of SLICE_BYTES, for a model of ``total`` bytes split evenly."""
    per = total // shards
    return [[(a, min(a + SLICE_BYTES, per)) for a in range(0, per, SLICE_BYTES)] for _ in range(shards)]


class RawWire:
    """The baseline: ``shards`` raw ROUTER processes (started in ``procs``, which stops them) and
    a DEALER to each, moving up to ``max_bytes`` of model in SLICE_BYTES slices, all in flight."""

    def __init__(self, procs: Procs, shards: int, max_bytes: int):
        self.shards = shards
        self._ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        ports = [free_port() for _ in range(shards)]
        for port in ports:
            procs.start(_raw_ps_process, port, max_bytes // shards)
        for port in ports:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
        self._payload = np.ones(max(max_bytes // shards, SLICE_BYTES) // 4, np.float32)

    def nbytes(self, model_bytes: int) -> int:
        """The bytes one move of a ``model_bytes`` model carries each way (split evenly)."""
        return model_bytes // self.shards * self.shards

    def move(self, model_bytes: int) -> tuple[float, float]:
        """Seconds to pull every shard's slices of the model, then to push them."""
        return _pull_push(self.socks, _slices(model_bytes, self.shards), self._payload)

    def round_trips(self, n: int) -> float:
        """Request/reply round trips per second of a few bytes, one in flight, to the first shard."""
        return _round_trips(self.socks[0], n)

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self._ctx.term()


async def zf_model(sess: AsyncSession, names: list[str], grads: dict[str, np.ndarray], reps: int,
                   fresh: list[float] | None = None, beside: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of each pull of every variable (into the same arrays each time, as a training
    loop reading its model every step would) and of each push of a gradient for every variable.
    ``fresh``, when given, gets the seconds of a pull without ``out=`` in each repetition too:
    the received frames themselves, as raw pyzmq keeps them. ``beside`` (the baseline) runs
    before each odd repetition's and after each even one's, so drift falls on both alike."""
    pulls, pushes = [], []
    out = {n: np.empty_like(g) for n, g in grads.items()}
    for rep in range(reps):
        if beside is not None and rep % 2:
            beside()
        pulls.append(await seconds_async(lambda: sess.pull(names, out=out)))
        if fresh is not None:
            fresh.append(await seconds_async(lambda: sess.pull(names)))
        pushes.append(await seconds_async(lambda: sess.push(grads)))
        if beside is not None and not rep % 2:
            beside()
    return pulls, pushes


async def zf_round_trips(sess: AsyncSession, n: int) -> float:
    """Scalar ``assign_add`` calls per second, one in flight."""
    var = await sess.variable("scalar", 0.0)

    async def trips() -> None:
        for _ in range(n):
            await var.assign_add(1.0)

    return n / await seconds_async(trips)


def _measure(shards: int, model_bytes: int, nvars: int, reps: int, trips: int) -> dict[str, Any]:
    """One row: zmqflow and raw pyzmq on ``shards`` server processes each, medians of ``reps``."""
    procs = Procs()
    wire: RawWire | None = None
    try:
        spec = ClusterSpec({"ps": [f"127.0.0.1:{free_port()}" for _ in range(shards)]})
        for t in spec.tasks:
            procs.start(zf_task_process, spec.to_json(), str(t))
        wire = RawWire(procs, shards, model_bytes)
        per_var = model_bytes // nvars // 4
        names = [f"v{i}" for i in range(nvars)]
        grads = {n: np.ones(per_var, np.float32) for n in names}
        raw: list[tuple[float, float]] = []
        raw_rates: list[float] = []
        fresh: list[float] = []

        async def zf_all(wire: RawWire) -> tuple[list[float], list[float], float]:
            async with AsyncSession(cluster=spec, task="ps:0", timeout=120) as sess:
                await sess.wait_for_cluster(30)
                for n in names:
                    await sess.variable(n, shape=(per_var,))
                await zf_model(sess, names, grads, 1)  # warm up connections and pages
                pulls, pushes = await zf_model(sess, names, grads, reps, fresh, lambda: raw.append(wire.move(model_bytes)))
                zf_rates = []
                for _ in range(2):  # alternating halves, as above
                    raw_rates.append(wire.round_trips(trips // 2))
                    zf_rates.append(await zf_round_trips(sess, trips // 2))
                return pulls, pushes, statistics.mean(zf_rates)

        wire.move(model_bytes)  # warm up
        zf_pulls, zf_pushes, zf_trips = zf_loop.run(zf_all(wire))
        raw_trips = statistics.mean(raw_rates)
        gb, raw_gb = per_var * 4 * nvars / 1e9, wire.nbytes(model_bytes) / 1e9
        row = {
            "shards": shards,
            "model_mb": round(per_var * 4 * nvars / MB, 1),
            "zf_pull_gbps": gb / statistics.median(zf_pulls),
            "raw_pull_gbps": raw_gb / statistics.median(r[0] for r in raw),
            "zf_pull_fresh_gbps": gb / statistics.median(fresh),
            "zf_push_gbps": gb / statistics.median(zf_pushes),
            "raw_push_gbps": raw_gb / statistics.median(r[1] for r in raw),
            "zf_assign_add_per_s": zf_trips,
            "raw_rtt_per_s": raw_trips,
        }
        row["pull_ratio"] = row["zf_pull_gbps"] / row["raw_pull_gbps"]
        row["pull_fresh_ratio"] = row["zf_pull_fresh_gbps"] / row["raw_pull_gbps"]
        row["push_ratio"] = row["zf_push_gbps"] / row["raw_push_gbps"]
        row["scalar_ratio"] = zf_trips / raw_trips
        return row
    finally:
        if wire is not None:
            wire.close()
        procs.close()


def run(quick: bool = False, shards: Sequence[int] = (1, 2, 4), model_mb: int | None = None, nvars: int = 10,
        json_out: str | None = None, echo: Any = print) -> list[dict[str, Any]]:
    """One row per shard count (each appended to ``json_out`` as it is measured)."""
    keep_big_blocks()  # for both clients, raw and zmqflow, in this process
    model_bytes = int((model_mb or (20 if quick else 100)) * MB)
    reps, trips = (3, 500) if quick else (5, 3000)
    rows = []
    for n in shards:
        row = _measure(n, model_bytes, nvars, reps, trips)
        echo(f"measured {n} shard(s): pull {row['pull_ratio']:.2f}x (no out= {row['pull_fresh_ratio']:.2f}x) push {row['push_ratio']:.2f}x scalar {row['scalar_ratio']:.2f}x raw")
        rows.append(row)
        if json_out:
            write_jsonl(json_out, [{"bench": "ps", **row}])
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["shards", "model", "pull GB/s", "raw", "ratio", "no out=", "ratio", "push GB/s", "raw", "ratio", "assign_add/s", "raw rtt/s", "ratio"]
    lines = [head]
    for r in rows:
        lines.append([
            str(r["shards"]), f"{r['model_mb']:.0f} MB",
            f"{r['zf_pull_gbps']:.2f}", f"{r['raw_pull_gbps']:.2f}", f"{r['pull_ratio']:.2f}x",
            f"{r['zf_pull_fresh_gbps']:.2f}", f"{r['pull_fresh_ratio']:.2f}x",
            f"{r['zf_push_gbps']:.2f}", f"{r['raw_push_gbps']:.2f}", f"{r['push_ratio']:.2f}x",
            f"{r['zf_assign_add_per_s']:.0f}", f"{r['raw_rtt_per_s']:.0f}", f"{r['scalar_ratio']:.2f}x",
        ])
    out = align(lines)
    out.append("pull: into the same out= arrays each time; no out=: the received frames themselves")
    out.append(f"targets: pull >= {PULL_TARGET:.2f}x and push >= {PUSH_TARGET:.2f}x raw GB/s; "
               f"scalar assign_add >= {SCALAR_TARGET:.2f}x raw round trips/s")
    for r in rows:
        missed = [f"{what} x{r[key]:.2f}" for what, key, target in
                  (("pull", "pull_ratio", PULL_TARGET), ("pull without out=", "pull_fresh_ratio", PULL_TARGET),
                   ("push", "push_ratio", PUSH_TARGET),
                   ("scalar", "scalar_ratio", SCALAR_TARGET)) if r[key] < target]
        out.append(f"  {r['shards']} shard(s): " + (f"missed {', '.join(missed)}" if missed else "all met"))
    return "\n".join(out)


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
