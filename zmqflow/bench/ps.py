"""Parameter-server benchmark: pull and push of a whole model, and scalar update round trips.

A model of ``nvars`` float32 variables (100 MB in all by default, 20 MB with ``--quick``) lives
on 1, 2 and 4 ps shards, each a separate process on tcp loopback; one client pulls every variable
and pushes a gradient for every variable (no optimizer: the shard adds it in place). Beside it,
in the same run, raw pyzmq moves the same bytes between the same number of processes, over as
many connections as zmqflow opens (:class:`RawWire`): zmqflow pulls a large share over plain-TCP
bulk streams, ``ZMQFLOW_BULK_LANES`` (2) in all (so 2 to one shard, 1 to each of 2 or 4), each
stream's ends on threads of their own, and pushes over one more stream a shard; raw gets a
DEALER per pull stream and one for the push, to a ROUTER per shard, with one ZeroMQ I/O thread
per connection at each end, and asks for (or sends) the same ``SLICE_BYTES`` (4 MiB) slices,
all in flight at once, dealt in turn to a shard's pull connections; the ROUTER answers each with
a ready buffer (or an ack). The two alternate repetition by repetition. zmqflow's pull is timed
twice: into the same ``out=`` arrays each time, and without ``out=`` (the received frames
themselves, which is what raw keeps). Then scalar ``assign_add`` round trips per second against
a raw pyzmq request/reply of a few bytes, and the same raw request/reply awaited on the asyncio
loop (:mod:`.loop_floor`): the floor of any loop-driven client, which the scalar ratio is read
against; in quarters, the order reversed each quarter. Both sides plaintext. Reported as ratios,
with the CPU seconds each side spent per GB (every thread of the client process and of the
servers: :class:`Phases`), which is what bounds a ratio where every core is busy; targets: pull
>= 0.9x and push >= 0.8x raw GB/s, scalar updates >= 0.7x raw round trips (reported, never
asserted).

Run ``zmqflow bench ps [--quick] [--shards N ...] [--json FILE]``.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import zmq

from .. import loop as zf_loop
from ..client.bulk_lanes import LANE_BYTES, lanes
from ..client.bulk_pull import BULK_FROM
from ..client.session import AsyncSession
from ..client.variables import SLICE_BYTES
from ..cluster import ClusterSpec
from ..ports import free_port
from ..transport.bulk import bulk_enabled
from ..transport.memory import keep_big_blocks
from .loop_floor import awaited_round_trips
from .machine import cpu_seconds
from .procs import SECURITY, Procs, plaintext, zf_task_process
from .report import align, cell, script_main, write_jsonl
from .stats import seconds, seconds_async

__all__ = ["RawWire", "format_table", "run", "zf_model", "zf_round_trips", "zf_streams"]

MB = 1e6
SCALAR_ROUNDS = 4  # the scalar round trips alternate raw and zmqflow this many times each
# (what, zmqflow's phase, raw's phase): the ratios of GB/s and of CPU seconds per GB
_RATIOS = (("pull", "zf_pull", "raw_pull"), ("pull_fresh", "zf_fresh", "raw_pull"), ("push", "zf_push", "raw_push"))
PULL_TARGET, PUSH_TARGET, SCALAR_TARGET = 0.9, 0.8, 0.7  # zmqflow / raw: reported, never asserted


def zf_streams(shards: int, model_bytes: int) -> list[int]:
    """The bulk pull streams zmqflow's session opens to each of ``shards`` shards for a model of
    ``model_bytes`` split evenly: ``ZMQFLOW_BULK_LANES`` in all (2 by default), at least LANE_BYTES
    each, one a shard at least; all ones where a share stays on ZeroMQ (under BULK_FROM, or
    ``ZMQFLOW_BULK=0``). Its push opens one stream a shard beside them."""
    if not _bulk(shards, model_bytes):
        return [1] * shards
    total, share = lanes(), model_bytes // shards
    return [max(1, min(total // shards + (r < total % shards), share // LANE_BYTES)) for r in range(shards)]


def _bulk(shards: int, model_bytes: int) -> bool:
    """Whether zmqflow moves each shard's share of the model over bulk streams, not ZeroMQ."""
    return bulk_enabled() and model_bytes // shards >= BULK_FROM


def _raw_ps_process(port: int, nbytes: int, io_threads: int, conn: Any) -> None:
    """Process entry (see :mod:`zmqflow.bench.procs`): a ROUTER that answers b"pull a,b" with
    those bytes of its buffer, anything else (a pushed slice) with an ack; ``io_threads`` I/O
    threads, one per connection to it, as each of zmqflow's streams has a thread at each end."""
    keep_big_blocks()  # the same allocator as the zmqflow side
    ctx = zmq.Context(io_threads)
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


# a move's plan: for each shard, its (connection, start, stop) slices in the order they are sent
_Plan = list[list[tuple[zmq.Socket, int, int]]]


def _pull(plan: _Plan) -> None:
    """Pull every shard's slices, all in flight at once."""
    for slices in plan:
        for sock, a, b in slices:
            sock.send(b"pull %d,%d" % (a, b))
    for slices in plan:
        for sock, _, _ in slices:
            sock.recv_multipart(copy=False)


def _push(plan: _Plan, payload: np.ndarray) -> None:
    """Push every shard's slices, all in flight at once."""
    view = payload.view(np.uint8)
    for slices in plan:
        for sock, a, b in slices:
            sock.send_multipart([b"push", view[a:b]], copy=False)
    for slices in plan:
        for sock, _, _ in slices:
            sock.recv_multipart()


class Phases:
    """Wall and CPU seconds of timed phases, by name. CPU counts every thread of this process (the
    client, its sockets' I/O threads) and of the server processes ``pids``: on a machine whose
    cores are all busy, the side that spends more CPU per byte cannot move its bytes as fast,
    which is what bounds a ratio there. CPU is None where it cannot be read (``cpu_seconds``)."""

    def __init__(self, pids: Sequence[int] = ()):
        self.pids = [os.getpid(), *pids]
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)

    def _note(self, name: str, took: float, c0: float | None) -> float:
        c1 = cpu_seconds(self.pids)
        self.wall[name].append(took)
        if c0 is not None and c1 is not None:
            self.cpu[name].append(c1 - c0)
        return took

    def timed(self, name: str, call: Callable[[], Any]) -> float:
        """Wall seconds of ``call()``, noted under ``name`` with its CPU seconds."""
        c0 = cpu_seconds(self.pids)
        return self._note(name, seconds(call), c0)

    async def timed_async(self, name: str, call: Callable[[], Awaitable[Any]]) -> float:
        c0 = cpu_seconds(self.pids)
        return self._note(name, await seconds_async(call), c0)

    def median_wall(self, name: str) -> float:
        return statistics.median(self.wall[name])

    def median_cpu(self, name: str) -> float | None:
        """Median CPU seconds of ``name``; None unless every repetition was read."""
        cpu = self.cpu.get(name, [])
        return statistics.median(cpu) if cpu and len(cpu) == len(self.wall[name]) else None


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
    """The baseline: ``shards`` raw ROUTER processes (started in ``procs``, which stops them)
    moving up to ``max_bytes`` of model in SLICE_BYTES slices, all in flight, over as many
    connections as zmqflow's session opens: to each shard, a DEALER per pull stream of
    :func:`zf_streams` (a pull deals its slices to them in turn) and, where zmqflow pushes over a
    stream of its own, a DEALER for the push; one I/O thread per connection at each end."""

    def __init__(self, procs: Procs, shards: int, max_bytes: int):
        self.shards = shards
        own_push = _bulk(shards, max_bytes)
        per_shard = [n + own_push for n in zf_streams(shards, max_bytes)]
        self.io_threads = sum(per_shard)
        self._ctx = zmq.Context(self.io_threads)
        ports = [free_port() for _ in range(shards)]
        for port, n in zip(ports, per_shard):
            procs.start(_raw_ps_process, port, max_bytes // shards, n)
        self.pull_socks: list[list[zmq.Socket]] = []
        self.push_socks: list[zmq.Socket] = []
        for port, n in zip(ports, per_shard):
            conns = [self._ctx.socket(zmq.DEALER) for _ in range(n)]
            for s in conns:
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://127.0.0.1:{port}")
            self.pull_socks.append(conns[:n - own_push])
            self.push_socks.append(conns[-1])
        self._payload = np.ones(max(max_bytes // shards, SLICE_BYTES) // 4, np.float32)

    def nbytes(self, model_bytes: int) -> int:
        """The bytes one move of a ``model_bytes`` model carries each way (split evenly)."""
        return model_bytes // self.shards * self.shards

    def conns(self, model_bytes: int) -> list[int]:
        """The pull connections a move of ``model_bytes`` uses to each shard: zmqflow's streams."""
        return [min(n, len(socks)) for n, socks in zip(zf_streams(self.shards, model_bytes), self.pull_socks)]

    def move(self, model_bytes: int, phases: Phases | None = None) -> tuple[float, float]:
        """Seconds to pull every shard's slices of the model, then to push them (noted in
        ``phases`` as raw_pull and raw_push where given)."""
        phases = phases or Phases()
        slices = _slices(model_bytes, self.shards)
        pulls = [[(socks[i % n], a, b) for i, (a, b) in enumerate(ranges)]
                 for socks, n, ranges in zip(self.pull_socks, self.conns(model_bytes), slices)]
        push_socks = self.push_socks if _bulk(self.shards, model_bytes) else [p[0] for p in self.pull_socks]
        pushes = [[(sock, a, b) for a, b in ranges] for sock, ranges in zip(push_socks, slices)]
        return (phases.timed("raw_pull", lambda: _pull(pulls)),
                phases.timed("raw_push", lambda: _push(pushes, self._payload)))

    def round_trips(self, n: int) -> float:
        """Request/reply round trips per second of a few bytes, one in flight, to the first shard."""
        return _round_trips(self.pull_socks[0][0], n)

    async def loop_round_trips(self, n: int) -> float:
        """The same round trips per second, each reply awaited on the running loop."""
        sock = self.pull_socks[0][0]
        took = await awaited_round_trips(sock, lambda: sock.send(b"add 1"), n)
        return n / (sum(took) / 1e6)

    def close(self) -> None:
        for s in {*self.push_socks, *(s for socks in self.pull_socks for s in socks)}:
            s.close(0)
        self._ctx.term()


async def zf_model(sess: AsyncSession, names: list[str], grads: dict[str, np.ndarray], reps: int,
                   phases: Phases | None = None, beside: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of each pull of every variable (into the same arrays each time, as a training
    loop reading its model every step would) and of each push of a gradient for every variable.
    ``phases``, when given, notes both (zf_pull, zf_push) and a pull without ``out=`` in each
    repetition too (zf_fresh): the received frames themselves, as raw pyzmq keeps them.
    ``beside`` (the baseline) runs before each odd repetition's and after each even one's, so
    drift falls on both alike."""
    pulls, pushes = [], []
    out = {n: np.empty_like(g) for n, g in grads.items()}
    timed = (phases or Phases()).timed_async
    for rep in range(reps):
        if beside is not None and rep % 2:
            beside()
        pulls.append(await timed("zf_pull", lambda: sess.pull(names, out=out)))
        if phases is not None:
            await timed("zf_fresh", lambda: sess.pull(names))
        pushes.append(await timed("zf_push", lambda: sess.push(grads)))
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
        phases = Phases(procs.pids)  # both sides' servers, idle or not, on both sides' clock
        per_var = model_bytes // nvars // 4
        names = [f"v{i}" for i in range(nvars)]
        grads = {n: np.ones(per_var, np.float32) for n in names}
        raw_rates: list[float] = []
        zf_rates: list[float] = []
        floor_rates: list[float] = []

        async def zf_all(wire: RawWire) -> None:
            async with AsyncSession(cluster=spec, task="ps:0", timeout=120) as sess:
                await sess.wait_for_cluster(30)
                for n in names:
                    await sess.variable(n, shape=(per_var,))
                await zf_model(sess, names, grads, 1)  # warm up connections and pages
                await zf_model(sess, names, grads, reps, phases, lambda: wire.move(model_bytes, phases))
                n = trips // SCALAR_ROUNDS
                for i in range(SCALAR_ROUNDS):  # raw, zmqflow, floor; then the other way round
                    for side in ("raw", "zf", "floor")[::1 if i % 2 == 0 else -1]:
                        if side == "raw":
                            raw_rates.append(wire.round_trips(n))
                        elif side == "zf":
                            zf_rates.append(await zf_round_trips(sess, n))
                        else:
                            floor_rates.append(await wire.loop_round_trips(n))

        wire.move(model_bytes)  # warm up
        zf_loop.run(zf_all(wire))
        gb, raw_gb = per_var * 4 * nvars / 1e9, wire.nbytes(model_bytes) / 1e9
        row: dict[str, Any] = {"shards": shards, "model_mb": round(per_var * 4 * nvars / MB, 1),
                               "security": SECURITY, "zf_pull_streams": zf_streams(shards, model_bytes),
                               "raw_pull_conns": wire.conns(model_bytes), "raw_io_threads": wire.io_threads}
        for name in ("zf_pull", "zf_fresh", "zf_push", "raw_pull", "raw_push"):
            moved = raw_gb if name.startswith("raw") else gb
            row[f"{name}_gbps"] = moved / phases.median_wall(name)
            cpu = phases.median_cpu(name)
            row[f"{name}_cpu_s_per_gb"] = None if cpu is None else cpu / moved
        row["zf_assign_add_per_s"] = statistics.mean(zf_rates)
        row["raw_rtt_per_s"] = statistics.mean(raw_rates)
        row["raw_loop_rtt_per_s"] = statistics.mean(floor_rates)
        for what, zf, raw in _RATIOS:
            row[f"{what}_ratio"] = row[f"{zf}_gbps"] / row[f"{raw}_gbps"]
            zf_cpu, raw_cpu = row[f"{zf}_cpu_s_per_gb"], row[f"{raw}_cpu_s_per_gb"]
            row[f"{what}_cpu_ratio"] = None if zf_cpu is None or not raw_cpu else zf_cpu / raw_cpu
        row["scalar_ratio"] = row["zf_assign_add_per_s"] / row["raw_rtt_per_s"]
        row["scalar_loop_ratio"] = row["zf_assign_add_per_s"] / row["raw_loop_rtt_per_s"]
        return row
    finally:
        if wire is not None:
            wire.close()
        procs.close()


def run(quick: bool = False, shards: Sequence[int] = (1, 2, 4), model_mb: float | None = None, nvars: int = 10,
        json_out: str | None = None, echo: Any = print, reps: int | None = None,
        trips: int | None = None) -> list[dict[str, Any]]:
    """One row per shard count (each appended to ``json_out`` as it is measured); ``reps`` model
    moves and ``trips`` scalar updates a side (by default 5 and 2000 with ``quick``, else 9 and 8000)."""
    keep_big_blocks()  # for both clients, raw and zmqflow, in this process
    model_bytes = int((model_mb or (20 if quick else 100)) * MB)
    reps = reps or (5 if quick else 9)
    trips = max(SCALAR_ROUNDS, trips or (2000 if quick else 8000))
    rows = []
    for n in shards:
        with plaintext():
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
            f"{r['zf_fresh_gbps']:.2f}", f"{r['pull_fresh_ratio']:.2f}x",
            f"{r['zf_push_gbps']:.2f}", f"{r['raw_push_gbps']:.2f}", f"{r['push_ratio']:.2f}x",
            f"{r['zf_assign_add_per_s']:.0f}", f"{r['raw_rtt_per_s']:.0f}", f"{r['scalar_ratio']:.2f}x",
        ])
    out = align(lines)
    out.append("pull: into the same out= arrays each time; no out=: the received frames themselves")
    out.append("raw pyzmq over as many connections as zmqflow's streams, one I/O thread each; pull connections a "
               "shard: " + ", ".join(f"{r['shards']} shard(s) {'/'.join(map(str, r['raw_pull_conns']))}"
                                     for r in rows if "raw_pull_conns" in r))
    out.append("scalar beside raw awaited on the asyncio loop (the floor of a loop-driven client): "
               + ", ".join(f"{r['shards']} shard(s) {r['raw_loop_rtt_per_s']:.0f}/s, x{r['scalar_loop_ratio']:.2f}"
                           for r in rows if "raw_loop_rtt_per_s" in r))
    out.append("")
    out += _cpu_table(rows)
    out.append(f"targets: pull >= {PULL_TARGET:.2f}x and push >= {PUSH_TARGET:.2f}x raw GB/s; "
               f"scalar assign_add >= {SCALAR_TARGET:.2f}x raw round trips/s")
    for r in rows:
        missed = [f"{what} x{r[key]:.2f}" for what, key, target in
                  (("pull", "pull_ratio", PULL_TARGET), ("pull without out=", "pull_fresh_ratio", PULL_TARGET),
                   ("push", "push_ratio", PUSH_TARGET),
                   ("scalar", "scalar_ratio", SCALAR_TARGET)) if r[key] < target]
        out.append(f"  {r['shards']} shard(s): " + (f"missed {', '.join(missed)}" if missed else "all met"))
    return "\n".join(out)


def _cpu_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """CPU seconds per GB moved on each side, and zmqflow's over raw's: where every core is busy
    (2 cores carry a client, its I/O thread and every shard's), a side spending more CPU per byte
    moves fewer bytes a second, so a GB/s ratio under 1 with a CPU ratio over 1 is bound by the
    work zmqflow does that raw pyzmq does not (copying into out=, adding a pushed gradient)."""
    lines = [["shards", "CPU s/GB: pull", "raw", "x raw", "no out=", "x raw", "push", "raw", "x raw"]]
    for r in rows:
        lines.append([str(r["shards"]),
                      cell(r["zf_pull_cpu_s_per_gb"], ".3f"), cell(r["raw_pull_cpu_s_per_gb"], ".3f"),
                      cell(r["pull_cpu_ratio"], ".2f"),
                      cell(r["zf_fresh_cpu_s_per_gb"], ".3f"), cell(r["pull_fresh_cpu_ratio"], ".2f"),
                      cell(r["zf_push_cpu_s_per_gb"], ".3f"), cell(r["raw_push_cpu_s_per_gb"], ".3f"),
                      cell(r["push_cpu_ratio"], ".2f")])
    return align(lines) + ["CPU: every thread of the client process and of all the server processes, per GB "
                           "moved; x raw over 1: zmqflow spends more"]


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
