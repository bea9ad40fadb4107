"""Runs the transport benchmark: both servers per transport, then for each size a warm-up and
``plan.reps`` repetitions in which raw pyzmq and zmqflow alternate (the order flips every
repetition; the loop floor of the small sizes runs first in one repetition and last in the next),
so drift in the machine's load falls on every side alike.

With ``curve`` each ipc and tcp pass runs twice, plaintext and then with CurveZMQ on both sides
(zmqflow's task server with keys, raw pyzmq as a CURVE server), so the table shows what
encryption costs beside what it costs without."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq

from ... import loop as zf_loop
from ...rpc import RpcClient
from ...transport.context import context
from ...transport.curve import Keys, generate
from ...transport.memory import keep_big_blocks
from ..machine import OtherLoad, cpu_idle_fraction, machine_info
from ..procs import plaintext
from ..report import size_label, write_jsonl
from ..stats import memcpy_gbps, percentile
from . import raw_pyzmq, zmqflow_rpc
from .plan import (
    DEFAULT_SIZES,
    FULL,
    LAT_TARGET,
    LAT_TARGET_MAX_BYTES,
    SMALL_TPUT_TARGET,
    TPUT_TARGET_INPROC,
    QUICK,
    QUICK_SIZES,
    TPUT_TARGET,
    TPUT_TARGET_MIN_BYTES,
    TRANSPORTS,
    Plan,
    parse_sizes,
    tensor,
)
from .report import DISTURBED_CPUS, format_curve_table, format_table
from .servers import servers

__all__ = ["build_parser", "main", "run"]

_MEMCPY_BATCHES = 5


async def _both(raw: Callable[[], Any], zf: Callable[[], Awaitable[Any]], raw_first: bool,
                floor: Callable[[], Awaitable[Any]] | None = None) -> tuple[Any, Any, Any]:
    """One measurement of each side in the order asked (raw pyzmq's first or zmqflow's first; the
    loop floor, where given, first in the one order and last in the other), each after a
    collection, so none pays for another's garbage; returns (raw, zmqflow, floor)."""
    waits: dict[str, Callable[[], Awaitable[Any]]] = {"zf": zf} if floor is None else {"zf": zf, "floor": floor}
    out: dict[str, Any] = {"floor": None}
    order = ["floor", "raw", "zf"] if floor is not None else ["raw", "zf"]
    for side in order if raw_first else order[::-1]:
        gc.collect()
        out[side] = raw() if side == "raw" else await waits[side]()
    return out["raw"], out["zf"], out["floor"]


async def _measure_size(
    transport: str, client: RpcClient, zf_ep: str, raw: zmq.Socket, size: int, plan: Plan, memcpy: float | None
) -> dict[str, Any]:
    """One row: both sides checked, warmed up, then measured ``plan.reps`` times."""
    arr = tensor(size)
    window, n_tput, n_lat = plan.window(size), plan.tput_msgs(size), plan.lat_iters(size)
    await zmqflow_rpc.check(client, zf_ep, arr)
    raw_pyzmq.check(raw, arr)
    # warm up both paths (allocator, page faults, pipes) before anything is timed
    warm = min(max(2 * window, n_tput // 10), n_tput)
    took = max(raw_pyzmq.throughput(raw, arr, warm, window),
               await zmqflow_rpc.throughput(client, zf_ep, arr, warm, window))
    n_tput = plan.tput_msgs(size, took / warm)  # long enough to measure (``Plan.tput_min_s``)
    raw_pyzmq.latency(raw, arr, max(2, n_lat // 10))
    await zmqflow_rpc.latency(client, zf_ep, arr, max(2, n_lat // 10))

    load = OtherLoad()
    zf_secs: list[float] = []
    raw_secs: list[float] = []
    zf_lat: list[float] = []
    raw_lat: list[float] = []
    loop_lat: list[float] = []  # raw pyzmq awaited on this loop, at the sizes the latency target judges
    for rep in range(plan.reps):
        raw_first = rep % 2 == 0
        r, z, _ = await _both(
            lambda: raw_pyzmq.throughput(raw, arr, n_tput, window),
            lambda: zmqflow_rpc.throughput(client, zf_ep, arr, n_tput, window),
            raw_first,
        )
        raw_secs.append(r)
        zf_secs.append(z)
        floor = (lambda: raw_pyzmq.loop_latency(raw, arr, n_lat)) if size <= LAT_TARGET_MAX_BYTES else None
        r, z, f = await _both(
            lambda: raw_pyzmq.latency(raw, arr, n_lat), lambda: zmqflow_rpc.latency(client, zf_ep, arr, n_lat),
            not raw_first, floor,
        )
        raw_lat += r
        zf_lat += z
        loop_lat += f or []
    row = _row(transport, size, window, n_tput, n_lat, plan.reps, zf_secs, raw_secs, zf_lat, raw_lat, memcpy)
    if loop_lat:  # the floor of any asyncio client: what part of zmqflow's p50 the loop's wake-up costs
        row["loop_p50_us"] = percentile(loop_lat, 50)
        row["lat_ratio_loop"] = row["zf_p50_us"] / row["loop_p50_us"]
    row["other_cpu"] = load.cpus()
    return row


async def _measure_transport(
    transport: str,
    zf_ep: str,
    raw_ep: str,
    sizes: Sequence[int],
    plan: Plan,
    memcpy: dict[int, float],
    say: Callable[[str], Any],
    keys: tuple[Keys, Keys] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """Every size over one transport; returns the rows and whether the loop was uvloop's.
    ``keys``: (client keys, task keys) to measure with CURVE on."""
    loop = asyncio.get_running_loop()
    uvloop_used = type(loop).__module__.startswith("uvloop")
    client = RpcClient(identity=f"zfbench-{os.getpid()}", source="zfbench", loop=loop,
                       keys=keys[0] if keys is not None else None)
    raw = context().socket(zmq.DEALER)
    raw.linger = 0
    security = "curve" if keys is not None else "plain"
    rows: list[dict[str, Any]] = []
    try:
        if keys is not None:
            raw_pyzmq.curve_client(raw, keys[0].public, keys[0].secret, keys[1].public)
        raw.connect(raw_ep)
        for size in sizes:
            row = await _measure_size(transport, client, zf_ep, raw, size, plan, memcpy.get(size))
            row["security"] = security
            rows.append(row)
            say(
                f"  {transport:6} {security:5} {size_label(size):>7}: zmqflow {row['zf_gbps']:.3g} GB/s"
                f" vs raw {row['raw_gbps']:.3g} GB/s (x{row['tput_ratio']:.2f});"
                f" p50 {row['zf_p50_us']:.0f} us vs {row['raw_p50_us']:.0f} us (x{row['lat_ratio']:.2f})"
                + (f"; other CPU {row['other_cpu']:.2f}" if (row["other_cpu"] or 0) > DISTURBED_CPUS else "")
            )
    finally:
        raw.close(0)
        client.close()
    return rows, uvloop_used


def _row(
    transport: str,
    size: int,
    window: int,
    n_tput: int,
    n_lat: int,
    reps: int,
    zf_secs: list[float],
    raw_secs: list[float],
    zf_lat: list[float],
    raw_lat: list[float],
    memcpy: float | None,
) -> dict[str, Any]:
    """Rates from the timings: throughput is the median over repetitions, latency percentiles are
    over the samples of all of them."""
    zf_rate = [n_tput / s for s in zf_secs]
    raw_rate = [n_tput / s for s in raw_secs]
    zf_mps, raw_mps = statistics.median(zf_rate), statistics.median(raw_rate)
    row: dict[str, Any] = {
        "transport": transport,
        "size_bytes": size,
        "size": size_label(size),
        "window": window,
        "tput_msgs": n_tput,
        "lat_iters": n_lat,
        "reps": reps,
        "zf_msgs_per_s": zf_mps,
        "zf_gbps": zf_mps * size / 1e9,
        "raw_msgs_per_s": raw_mps,
        "raw_gbps": raw_mps * size / 1e9,
        "tput_ratio": zf_mps / raw_mps,
        "zf_p50_us": percentile(zf_lat, 50),
        "zf_p99_us": percentile(zf_lat, 99),
        "raw_p50_us": percentile(raw_lat, 50),
        "raw_p99_us": percentile(raw_lat, 99),
        "memcpy_gbps": memcpy,
        "zf_gbps_reps": [r * size / 1e9 for r in zf_rate],
        "raw_gbps_reps": [r * size / 1e9 for r in raw_rate],
    }
    row["lat_ratio"] = row["zf_p50_us"] / row["raw_p50_us"]
    row["lat_ratio_p99"] = row["zf_p99_us"] / row["raw_p99_us"]
    tput_target = TPUT_TARGET_INPROC if transport == "inproc" else TPUT_TARGET
    row["target_tput_met"] = row["tput_ratio"] >= tput_target if size >= TPUT_TARGET_MIN_BYTES else None
    row["target_small_tput_met"] = row["tput_ratio"] >= SMALL_TPUT_TARGET if size <= LAT_TARGET_MAX_BYTES else None
    row["target_lat_met"] = row["lat_ratio"] <= LAT_TARGET if size <= LAT_TARGET_MAX_BYTES else None
    return row


def run(
    quick: bool = False,
    transports: Sequence[str] = TRANSPORTS,
    sizes: Sequence[int] | None = None,
    json_out: str | None = None,
    echo: Callable[[str], Any] | None = print,
    curve: bool = False,
    keys: str | None = None,
    plan: Plan | None = None,
) -> list[dict[str, Any]]:
    """Run the benchmark; returns one row per transport x size (also written as JSON lines to
    ``json_out``, replacing what it held). Progress and the final table go to ``echo`` (``None``:
    silent). ``curve``: ipc and tcp again with CurveZMQ, with the keys of directory ``keys`` (it
    must hold a shared task key: ``zmqflow keys generate DIR``) or fresh temporary ones. ``plan``:
    how much to measure, in place of the quick or full one (a smaller one checks the wiring)."""
    say: Callable[[str], Any] = echo if echo is not None else (lambda _line: None)
    keep_big_blocks()  # both clients, raw and zmqflow, share this process and its allocator
    plan = plan or (QUICK if quick else FULL)
    transports = list(transports)
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"unknown transport {t!r} (choose from {', '.join(TRANSPORTS)})")
    sizes = list(sizes) if sizes else list(QUICK_SIZES if quick else DEFAULT_SIZES)
    for s in sizes:
        tensor(s)  # validates
    machine = machine_info()
    machine["cpu_idle_before"] = idle = cpu_idle_fraction()
    if idle is not None and idle < 0.8:
        say(f"warning: the machine is busy before the benchmark starts ({100 * (1 - idle):.0f}% CPU in use); "
            "numbers may be disturbed")
    say(
        f"zmqflow transport benchmark ({'quick' if quick else 'full'}): {machine['cpu_count']} CPUs, "
        f"python {machine['python']}, pyzmq {machine['pyzmq']} (libzmq {machine['libzmq']}), "
        f"uvloop {machine['uvloop'] or 'not installed'}; {plan.reps} repetitions"
    )
    t_start = time.perf_counter()
    memcpy = {s: memcpy_gbps(s, plan.memcpy_copies(s, _MEMCPY_BATCHES), _MEMCPY_BATCHES) for s in sizes}
    rows: list[dict[str, Any]] = []
    uvloop_used = False
    with contextlib.ExitStack() as stack:
        stack.enter_context(plaintext())  # the plaintext passes: keys only where given, to both sides
        pair = _bench_keys(stack, keys) if curve or keys else None
        for transport in transports:
            for keyed in (None, pair) if pair is not None and transport != "inproc" else (None,):
                with servers(transport, keyed[1] if keyed else None) as (zf_ep, raw_ep):
                    t_rows, used = zf_loop.run(
                        _measure_transport(transport, zf_ep, raw_ep, sizes, plan, memcpy, say, keyed))
                rows += t_rows
                uvloop_used = uvloop_used or used
    machine["uvloop_used"] = uvloop_used
    elapsed = time.perf_counter() - t_start
    for row in rows:
        row["quick"] = quick
        row["machine"] = machine
    if json_out:
        write_jsonl(json_out, rows, append=False)
    say("")
    say(format_table(rows))
    if any(r.get("security") == "curve" for r in rows):
        say("")
        say(format_curve_table(rows))
    say(f"({elapsed:.0f} s" + (f"; JSON lines in {json_out})" if json_out else ")"))
    return rows


def _bench_keys(stack: contextlib.ExitStack, directory: str | None) -> tuple[Keys, Keys]:
    """(client keys, task keys) from ``directory``, or from a temporary one removed afterwards."""
    if directory is None:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="zfbench-keys-"))
        generate(directory)
    return Keys.load(directory), Keys.load(directory, "worker:0", require_task=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zmqflow.bench.transport",
        description="zmqflow RPC throughput and latency against raw pyzmq over inproc, ipc and tcp loopback.",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes (no 64 MiB), repetitions and messages")
    p.add_argument("--json", metavar="FILE", dest="json_out", help="write one JSON object per transport x size")
    p.add_argument(
        "--transport",
        action="append",
        metavar="NAME",
        help="inproc, ipc or tcp (repeat or comma-separate; default: all)",
    )
    p.add_argument("--sizes", metavar="LIST", help="comma-separated tensor sizes in bytes, e.g. 64,4K,1M")
    p.add_argument("--curve", action="store_true", help="ipc and tcp again with CurveZMQ on, beside off")
    p.add_argument("--keys", metavar="DIR", help="key directory for --curve (a shared task key); default: temporary")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zmqflow.bench.transport``; returns the exit status (2: bad arguments)."""
    args = build_parser().parse_args(argv)
    transports = TRANSPORTS
    if args.transport:
        transports = tuple(t.strip() for item in args.transport for t in item.split(",") if t.strip())
    try:
        sizes = parse_sizes(args.sizes) if args.sizes else None
        unknown = [t for t in transports if t not in TRANSPORTS]
        if unknown:
            raise ValueError(f"unknown transport {unknown[0]!r} (choose from {', '.join(TRANSPORTS)})")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(quick=args.quick, transports=transports, sizes=sizes, json_out=args.json_out, curve=args.curve, keys=args.keys)
    return 0
