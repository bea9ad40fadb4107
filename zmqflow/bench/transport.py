"""Transport benchmark: zmqflow's RPC path against raw pyzmq, over inproc, ipc and tcp loopback.

For each transport and tensor size (float32 arrays of 64 B .. 64 MiB) it measures:

* one-way throughput (msgs/s, GB/s). The sender keeps a window of requests in flight (64 for
  small messages, fewer for big ones: the window holds at most ``window_bytes``) and the receiver
  answers each with a tiny ack. zmqflow: ``RpcClient.start_call(ep, "worker", "sink", {"x": arr})``
  against a real task server. Baseline: a blocking pyzmq DEALER sending ``[header, array]``
  (``copy=False``) with the same window to a raw ROUTER that acks.
* request/reply latency p50/p99, one request in flight. zmqflow: ``await client.call(ep, "worker",
  "echo", {"x": arr})``; baseline: the same DEALER -> ROUTER echo in raw pyzmq.
* numpy memcpy (``np.copyto``) GB/s at each size, as the physical reference.

For ipc and tcp both servers run in their own spawned processes, so the client's process and GIL
are not shared. inproc only connects within one ZeroMQ context, so there both servers run in this
process on background threads (``zmqflow.Server`` on its loop thread; the raw ROUTER on a plain
thread using zmqflow's process context). The zmqflow client runs on ``zmqflow.loop.run``
(uvloop when installed); the raw client runs blocking on the same thread between zmqflow runs.
Raw and zmqflow measurements alternate within each repetition (the order flips every repetition)
and the reported throughput is the median over repetitions; latency percentiles are taken over
the samples of all repetitions. GB/s is 10**9 payload bytes per second.

Targets (reported, never asserted): zmqflow >= 0.9x raw throughput for messages >= 1 MiB, and
zmqflow p50 latency within 1.5x raw for 64 B.

Run ``python -m zmqflow.bench.transport [--quick] [--json FILE] [--transport tcp ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from .. import loop as zf_loop
from ..rpc import RpcClient
from ..server.task import AsyncServer, Server
from ..transport.context import context
from ..transport.memory import keep_big_blocks

__all__ = [
    "run",
    "format_table",
    "main",
    "build_parser",
    "parse_size",
    "machine_info",
    "cpu_idle_fraction",
    "memcpy_gbps",
    "Plan",
    "FULL",
    "QUICK",
    "TRANSPORTS",
    "DEFAULT_SIZES",
    "QUICK_SIZES",
]

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES: tuple[int, ...] = (64, 4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES: tuple[int, ...] = DEFAULT_SIZES[:-1]
TRANSPORTS: tuple[str, ...] = ("inproc", "ipc", "tcp")

TPUT_TARGET = 0.9  # zmqflow / raw throughput, for messages >= TPUT_TARGET_MIN_BYTES
TPUT_TARGET_MIN_BYTES = MiB
LAT_TARGET = 1.5  # zmqflow / raw p50 latency, for messages <= LAT_TARGET_MAX_BYTES
LAT_TARGET_MAX_BYTES = 64

_ECHO, _ACK = b"e", b"a"  # first byte of the raw baseline's header frame: echo the data or ack it
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_CALL_TIMEOUT = 120.0


@dataclass(frozen=True)
class Plan:
    """How much to measure. Message counts are derived from byte budgets, then clamped."""

    reps: int
    tput_bytes: int  # payload per throughput measurement
    tput_min_msgs: int
    tput_max_msgs: int
    lat_bytes: int  # payload (both ways) per latency measurement
    lat_min: int
    lat_max: int
    memcpy_bytes: int
    window_bytes: int = 128 * MiB  # at most this much payload in flight
    max_window: int = 64
    min_window: int = 2

    def window(self, size: int) -> int:
        return _clamp(self.window_bytes // size, self.min_window, self.max_window)

    def tput_msgs(self, size: int) -> int:
        return _clamp(self.tput_bytes // size, max(self.tput_min_msgs, 2 * self.window(size)), self.tput_max_msgs)

    def lat_iters(self, size: int) -> int:
        return _clamp(self.lat_bytes // (2 * size), self.lat_min, self.lat_max)


FULL = Plan(reps=5, tput_bytes=1 << 30, tput_min_msgs=16, tput_max_msgs=20000, lat_bytes=512 * MiB, lat_min=10,
            lat_max=2000, memcpy_bytes=512 * MiB)
QUICK = Plan(reps=3, tput_bytes=96 * MiB, tput_min_msgs=8, tput_max_msgs=3000, lat_bytes=32 * MiB, lat_min=5,
             lat_max=300, memcpy_bytes=64 * MiB)


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def _tensor(size: int) -> np.ndarray:
    if size <= 0 or size % 4:
        raise ValueError(f"tensor size must be a positive multiple of 4 bytes (float32), got {size}")
    return np.arange(size // 4, dtype=np.float32)


# sizes ------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``64``, ``4K``/``4KiB``, ``1M``/``1MiB``, ``1G`` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise ValueError(f"malformed size {text!r}: expected e.g. 64, 4K, 1M") from None
    if value <= 0 or value % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes")
    return value


def size_label(size: int) -> str:
    for unit, m in (("MiB", MiB), ("KiB", KiB)):
        if size >= m and size % m == 0:
            return f"{size // m} {unit}"
    return f"{size} B"


# machine ----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import msgpack

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "mem_total_gib": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "numpy": np.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "uvloop": None,
        "uvloop_used": None,
    }
    mem = _proc_field("/proc/meminfo", "MemTotal")
    if mem and mem.split()[0].isdigit():
        info["mem_total_gib"] = round(int(mem.split()[0]) / (1 << 20), 1)
    if zf_loop.uvloop_available():
        import uvloop

        info["uvloop"] = getattr(uvloop, "__version__", "?")
    return info


def cpu_idle_fraction(seconds: float = 0.5) -> float | None:
    """Fraction of all CPUs idle over ``seconds`` (from /proc/stat): how quiet the machine is."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)

    a = sample()
    time.sleep(seconds)
    b = sample()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


class _OtherLoad:
    """CPU used by processes outside this one and its children while a measurement runs, in CPUs
    (0.0: the machine was ours; 1.0: another process kept a whole core busy). Linux only."""

    _HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self._start = self._sample()
        self._t0 = time.perf_counter()

    @staticmethod
    def _sample() -> dict[int, tuple[int, int]] | None:
        """pid -> (parent pid, user + system ticks) for every process."""
        out: dict[int, tuple[int, int]] = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            return None
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        return out

    def cpus(self) -> float | None:
        end, elapsed = self._sample(), time.perf_counter() - self._t0
        if self._start is None or end is None or elapsed <= 0:
            return None
        me = os.getpid()

        def ours(pid: int) -> bool:
            for _ in range(32):
                if pid == me:
                    return True
                parent = end.get(pid, self._start.get(pid, (0, 0)))[0]
                if parent <= 1:
                    return False
                pid = parent
            return False

        ticks = sum(t - self._start.get(pid, (0, 0))[1] for pid, (_, t) in end.items() if not ours(pid))
        return max(0.0, ticks / self._HZ / elapsed)


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path) as fh:
            for line in fh:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def memcpy_gbps(size: int, budget_bytes: int, batches: int = 5) -> float:
    """Median GB/s of ``np.copyto`` between two warm float32 arrays of ``size`` bytes."""
    src = _tensor(size)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    k = _clamp(budget_bytes // (size * batches), 3, 20000)
    rates = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(k):
            np.copyto(dst, src)
        rates.append(size * k / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


# raw pyzmq server -------------------------------------------------------------------------


def _raw_serve(sock: zmq.Socket, should_stop: Callable[[], bool]) -> None:
    """A ROUTER that acks (``[id, header]``) or echoes (``[id, header, data...]``) each message."""
    while True:
        try:
            if not sock.poll(100, zmq.POLLIN):
                if should_stop():
                    return
                continue
            while True:
                try:
                    ident = sock.recv(_NOBLOCK)
                except zmq.Again:
                    break
                hdr = sock.recv()  # the rest of a multipart message is already here
                data = []
                while sock.rcvmore:
                    data.append(sock.recv(copy=False))
                if hdr[:1] == _ECHO:
                    sock.send_multipart([ident, hdr, *data], copy=False)
                else:
                    sock.send_multipart([ident, hdr])
        except zmq.ContextTerminated:
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ENOTSOCK:
                return
            raise


def _raw_server_process(bind: str, conn: Any) -> None:
    """Process entry: the raw ROUTER on its own context; stops when the parent says so (or dies)."""
    keep_big_blocks()  # the same allocator as the zmqflow side
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    try:
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            conn.send(("error", f"cannot bind {bind}: {exc}"))
            return
        conn.send(("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
        _raw_serve(sock, conn.poll)  # a stop message or EOF (parent gone) makes poll() true
    finally:
        sock.close(0)
        ctx.term()


class _RawThread:
    """The raw ROUTER on a background thread of this process (inproc: same context as the client)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        sock = context().socket(zmq.ROUTER)
        sock.linger = 0
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="zfbench-raw-router", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            _raw_serve(self._sock, self._stop.is_set)
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# zmqflow server process -------------------------------------------------------------------


def _zf_server_process(address: str, conn: Any) -> None:
    """Process entry: a zmqflow task server (job ``worker``) on ``zmqflow.loop.run``."""
    keep_big_blocks()  # as `zmqflow serve` does
    zf_loop.run(_zf_serve(address, conn))


async def _zf_serve(address: str, conn: Any) -> None:
    try:
        server = AsyncServer({"worker": [address]}, "worker:0")
        await server.start()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(conn.fileno(), stop.set)  # a stop message or EOF (parent gone)
    try:
        conn.send(("ready", server.target))
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await server.stop()


class _Child:
    """A spawned server process with a pipe for 'ready' and 'stop'."""

    def __init__(self, target: Callable[[str, Any], None], arg: str, name: str):
        mp = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child_conn = mp.Pipe()
        self.proc = mp.Process(target=target, args=(arg, child_conn), name=name, daemon=True)
        self.proc.start()
        child_conn.close()

    def wait_ready(self, timeout: float = 60.0) -> str:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name} did not start within {timeout:g}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.name} exited (code {self.proc.exitcode}) before it was ready") from None
        if status != "ready":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop", None))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _servers(transport: str) -> Iterator[tuple[str, str]]:
    """Start the zmqflow and the raw server for ``transport``; yield their endpoints; clean up."""
    with contextlib.ExitStack() as stack:
        if transport == "inproc":
            tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            zf = Server({"worker": [f"inproc://zfbench-zf-{tag}"]}, "worker:0")
            stack.callback(zf.stop)
            raw = _RawThread(f"inproc://zfbench-raw-{tag}")
            stack.callback(raw.stop)
            yield zf.target, raw.endpoint
            return
        if transport == "ipc":
            tmpdir = tempfile.mkdtemp(prefix="zfbench-")
            stack.callback(shutil.rmtree, tmpdir, True)
            raw_bind = f"ipc://{tmpdir}/raw.sock"
        else:
            raw_bind = "tcp://127.0.0.1:*"
        raw = _Child(_raw_server_process, raw_bind, f"raw {transport} server")
        stack.callback(raw.stop)
        zf_ep = None
        for attempt in range(5):  # a picked tcp port can be taken before the server binds it
            address = f"ipc://{tmpdir}/zf-{attempt}.sock" if transport == "ipc" else f"127.0.0.1:{_free_port()}"
            zf = _Child(_zf_server_process, address, f"zmqflow {transport} server")
            try:
                zf_ep = zf.wait_ready()
            except RuntimeError as exc:
                zf.stop()
                if "in use" not in str(exc) or attempt == 4:
                    raise
                continue
            stack.callback(zf.stop)
            break
        raw_ep = raw.wait_ready()
        assert zf_ep is not None
        yield zf_ep, raw_ep


# measurements -----------------------------------------------------------------------------


def _raw_throughput(sock: zmq.Socket, arr: np.ndarray, n: int, window: int) -> float:
    """Seconds to push ``n`` messages with ``window`` in flight, each acked by the raw ROUTER."""
    hdr = _ACK + b"\0" * 7
    send, recv = sock.send, sock.recv
    sent = done = 0
    t0 = time.perf_counter()
    while sent < min(window, n):
        send(hdr, _SNDMORE)
        send(arr, copy=False)
        sent += 1
    while done < n:
        recv()
        done += 1
        if sent < n:
            send(hdr, _SNDMORE)
            send(arr, copy=False)
            sent += 1
    return time.perf_counter() - t0


def _raw_latency(sock: zmq.Socket, arr: np.ndarray, n: int) -> list[float]:
    """Round-trip microseconds of ``n`` echoes, one in flight."""
    hdr = _ECHO + b"\0" * 7
    send, recv = sock.send, sock.recv
    pc = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = pc()
        send(hdr, _SNDMORE)
        send(arr, copy=False)
        recv()
        recv(copy=False)
        out.append((pc() - t0) / 1e3)
    return out


def _raw_check(sock: zmq.Socket, arr: np.ndarray) -> None:
    sock.send(_ECHO + b"\0" * 7, _SNDMORE)
    sock.send(arr, copy=False)
    if not sock.poll(30_000):
        raise RuntimeError("raw server did not answer within 30s")
    frames = sock.recv_multipart(copy=False)
    got = np.frombuffer(frames[-1], dtype=arr.dtype)
    if len(frames) != 2 or not np.array_equal(got, arr):
        raise RuntimeError("raw echo returned different data")


async def _zf_throughput(client: RpcClient, ep: str, arr: np.ndarray, n: int, window: int) -> float:
    """Seconds to complete ``n`` ``worker.sink`` calls with ``window`` in flight."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    body = {"x": arr}
    start_call = client.start_call
    state = [0, 0]  # sent, done

    def issue() -> None:
        state[0] += 1
        start_call(ep, "worker", "sink", body, timeout=_CALL_TIMEOUT).add_done_callback(on_done)

    def on_done(fut: asyncio.Future) -> None:
        if finished.done():
            return
        exc = fut.exception()
        if exc is not None:
            finished.set_exception(exc)
            return
        state[1] += 1
        if state[0] < n:
            issue()
        elif state[1] == n:
            finished.set_result(None)

    t0 = time.perf_counter()
    for _ in range(min(window, n)):
        issue()
    await finished
    return time.perf_counter() - t0


async def _zf_latency(client: RpcClient, ep: str, arr: np.ndarray, n: int) -> list[float]:
    """Round-trip microseconds of ``n`` ``worker.echo`` calls, one in flight."""
    body = {"x": arr}
    call = client.call
    pc = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = pc()
        await call(ep, "worker", "echo", body, timeout=_CALL_TIMEOUT)
        out.append((pc() - t0) / 1e3)
    return out


async def _zf_check(client: RpcClient, ep: str, arr: np.ndarray) -> None:
    reply = await client.call(ep, "worker", "echo", {"x": arr}, timeout=_CALL_TIMEOUT)
    got = reply.get("x") if isinstance(reply, dict) else None
    if not isinstance(got, np.ndarray) or got.dtype != arr.dtype or not np.array_equal(got, arr):
        raise RuntimeError("zmqflow echo returned different data")
    nbytes = await client.call(ep, "worker", "sink", {"x": arr}, timeout=_CALL_TIMEOUT)
    if nbytes != arr.nbytes:
        raise RuntimeError(f"zmqflow sink counted {nbytes} bytes, sent {arr.nbytes}")


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


async def _measure_transport(
    transport: str,
    zf_ep: str,
    raw_ep: str,
    sizes: Sequence[int],
    plan: Plan,
    memcpy: dict[int, float],
    say: Callable[[str], None],
) -> tuple[list[dict[str, Any]], bool]:
    loop = asyncio.get_running_loop()
    uvloop_used = type(loop).__module__.startswith("uvloop")
    client = RpcClient(identity=f"zfbench-{os.getpid()}", source="zfbench", loop=loop)
    raw = context().socket(zmq.DEALER)
    raw.linger = 0
    rows: list[dict[str, Any]] = []
    try:
        raw.connect(raw_ep)
        for size in sizes:
            arr = _tensor(size)
            window, n_tput, n_lat = plan.window(size), plan.tput_msgs(size), plan.lat_iters(size)
            await _zf_check(client, zf_ep, arr)
            _raw_check(raw, arr)
            # warm up both paths (allocator, page faults, pipes) before anything is timed
            warm = max(2 * window, n_tput // 10)
            _raw_throughput(raw, arr, min(warm, n_tput), window)
            await _zf_throughput(client, zf_ep, arr, min(warm, n_tput), window)
            _raw_latency(raw, arr, max(2, n_lat // 10))
            await _zf_latency(client, zf_ep, arr, max(2, n_lat // 10))

            load = _OtherLoad()
            zf_secs: list[float] = []
            raw_secs: list[float] = []
            zf_lat: list[float] = []
            raw_lat: list[float] = []
            for rep in range(plan.reps):
                raw_first = rep % 2 == 0
                for side in ("raw", "zf") if raw_first else ("zf", "raw"):
                    gc.collect()
                    if side == "raw":
                        raw_secs.append(_raw_throughput(raw, arr, n_tput, window))
                    else:
                        zf_secs.append(await _zf_throughput(client, zf_ep, arr, n_tput, window))
                for side in ("zf", "raw") if raw_first else ("raw", "zf"):
                    gc.collect()
                    if side == "raw":
                        raw_lat += _raw_latency(raw, arr, n_lat)
                    else:
                        zf_lat += await _zf_latency(client, zf_ep, arr, n_lat)
            row = _row(
                transport, size, window, n_tput, n_lat, plan.reps, zf_secs, raw_secs, zf_lat, raw_lat, memcpy.get(size)
            )
            row["other_cpu"] = load.cpus()
            rows.append(row)
            say(
                f"  {transport:6} {size_label(size):>7}: zmqflow {row['zf_gbps']:.3g} GB/s"
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
        "zf_p50_us": _pct(zf_lat, 50),
        "zf_p99_us": _pct(zf_lat, 99),
        "raw_p50_us": _pct(raw_lat, 50),
        "raw_p99_us": _pct(raw_lat, 99),
        "memcpy_gbps": memcpy,
        "zf_gbps_reps": [r * size / 1e9 for r in zf_rate],
        "raw_gbps_reps": [r * size / 1e9 for r in raw_rate],
    }
    row["lat_ratio"] = row["zf_p50_us"] / row["raw_p50_us"]
    row["lat_ratio_p99"] = row["zf_p99_us"] / row["raw_p99_us"]
    row["target_tput_met"] = row["tput_ratio"] >= TPUT_TARGET if size >= TPUT_TARGET_MIN_BYTES else None
    row["target_lat_met"] = row["lat_ratio"] <= LAT_TARGET if size <= LAT_TARGET_MAX_BYTES else None
    return row


# report -----------------------------------------------------------------------------------

_COLUMNS = (
    # header, key, format
    ("transport", "transport", "{}"),
    ("size", "size", "{}"),
    ("zf msg/s", "zf_msgs_per_s", "{:,.0f}"),
    ("zf GB/s", "zf_gbps", "{:.3g}"),
    ("raw GB/s", "raw_gbps", "{:.3g}"),
    ("zf/raw", "tput_ratio", "{:.2f}"),
    ("zf p50 us", "zf_p50_us", "{:,.0f}"),
    ("zf p99 us", "zf_p99_us", "{:,.0f}"),
    ("raw p50 us", "raw_p50_us", "{:,.0f}"),
    ("raw p99 us", "raw_p99_us", "{:,.0f}"),
    ("lat zf/raw", "lat_ratio", "{:.2f}"),
    ("memcpy GB/s", "memcpy_gbps", "{:.3g}"),
    ("other CPU", "other_cpu", "{:.2f}"),
)

DISTURBED_CPUS = 0.25  # rows where other processes used more CPU than this are flagged


def _cell(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and fmt == "{:,.0f}" and abs(value) < 100:
        return f"{value:.1f}"
    return fmt.format(value)


def format_table(rows: Sequence[dict[str, Any]], targets: bool = True) -> str:
    """The rows as an aligned text table, followed (``targets``) by which targets were met."""
    cells = [[h for h, _, _ in _COLUMNS]] + [[_cell(f, r.get(k)) for _, k, f in _COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    out = []
    for j, line in enumerate(cells):
        padded = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        out.append("  ".join(padded).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    if targets:
        out.append("")
        out.extend(_target_lines(rows))
    disturbed = [f"{r['transport']} {r['size']}" for r in rows if (r.get("other_cpu") or 0) > DISTURBED_CPUS]
    if any("other_cpu" in r for r in rows):
        out.append(
            "other CPU: CPUs kept busy by other processes while the row was measured"
            + (f"; disturbed (> {DISTURBED_CPUS}): {', '.join(disturbed)}" if disturbed else " (none disturbed)")
        )
    return "\n".join(out)


def _target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    tput = [r for r in rows if r.get("target_tput_met") is not None]
    if tput:
        missed = [f"{r['transport']} {r['size']} (x{r['tput_ratio']:.2f})" for r in tput if not r["target_tput_met"]]
        lines.append(
            f"throughput target (zmqflow >= {TPUT_TARGET}x raw at >= {size_label(TPUT_TARGET_MIN_BYTES)}): "
            f"met {len(tput) - len(missed)}/{len(tput)}" + (f"; missed: {', '.join(missed)}" if missed else "")
        )
    lat = [r for r in rows if r.get("target_lat_met") is not None]
    if lat:
        missed = [f"{r['transport']} {r['size']} (x{r['lat_ratio']:.2f})" for r in lat if not r["target_lat_met"]]
        lines.append(
            f"latency target (zmqflow p50 <= {LAT_TARGET}x raw at {size_label(LAT_TARGET_MAX_BYTES)}): "
            f"met {len(lat) - len(missed)}/{len(lat)}" + (f"; missed: {', '.join(missed)}" if missed else "")
        )
    return lines


# entry points -----------------------------------------------------------------------------


def run(
    quick: bool = False,
    transports: Sequence[str] = TRANSPORTS,
    sizes: Sequence[int] | None = None,
    json_out: str | None = None,
    echo: Callable[[str], Any] | None = print,
) -> list[dict[str, Any]]:
    """Run the benchmark; returns one row per transport x size (also written as JSON lines to
    ``json_out``). Progress and the final table go to ``echo`` (``None``: silent)."""
    say: Callable[[str], Any] = echo if echo is not None else (lambda _line: None)
    keep_big_blocks()  # both clients, raw and zmqflow, share this process and its allocator
    plan = QUICK if quick else FULL
    transports = list(transports)
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"unknown transport {t!r} (choose from {', '.join(TRANSPORTS)})")
    sizes = list(sizes) if sizes else list(QUICK_SIZES if quick else DEFAULT_SIZES)
    for s in sizes:
        _tensor(s)  # validates
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
    memcpy = {s: memcpy_gbps(s, plan.memcpy_bytes) for s in sizes}
    rows: list[dict[str, Any]] = []
    uvloop_used = False
    for transport in transports:
        with _servers(transport) as (zf_ep, raw_ep):
            t_rows, used = zf_loop.run(_measure_transport(transport, zf_ep, raw_ep, sizes, plan, memcpy, say))
        rows += t_rows
        uvloop_used = uvloop_used or used
    machine["uvloop_used"] = uvloop_used
    elapsed = time.perf_counter() - t_start
    for row in rows:
        row["quick"] = quick
        row["machine"] = machine
    if json_out:
        with open(json_out, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    say("")
    say(format_table(rows))
    say(f"({elapsed:.0f} s" + (f"; JSON lines in {json_out})" if json_out else ")"))
    return rows


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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    transports = TRANSPORTS
    if args.transport:
        transports = tuple(t.strip() for item in args.transport for t in item.split(",") if t.strip())
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()] if args.sizes else None
        unknown = [t for t in transports if t not in TRANSPORTS]
        if unknown:
            raise ValueError(f"unknown transport {unknown[0]!r} (choose from {', '.join(TRANSPORTS)})")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(quick=args.quick, transports=transports, sizes=sizes, json_out=args.json_out)
    return 0


if __name__ == "__main__":
    # Go through the package module so spawned server processes find their entry points by name.
    from zmqflow.bench import transport as _module

    sys.exit(_module.main())
