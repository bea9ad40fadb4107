"""The baseline: the same transfers in raw pyzmq, a blocking DEALER against a ROUTER that acks
(``[id, header]``) or echoes (``[id, header, data...]``) each message by the header's first byte."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from ...transport.context import context
from ...transport.memory import keep_big_blocks
from ..loop_floor import awaited_round_trips

__all__ = ["ServerThread", "check", "curve_client", "latency", "loop_latency", "server_process", "throughput"]

_ECHO, _ACK = b"e", b"a"  # first byte of the header frame: echo the data or ack it
_SNDMORE = int(zmq.SNDMORE)  # plain ints: pyzmq's enum arithmetic would cost more than the send
_NOBLOCK = int(zmq.NOBLOCK)


def _serve(sock: zmq.Socket, should_stop: Callable[[], bool]) -> None:
    """Answer every message on ``sock`` until ``should_stop()`` (polled every 100 ms when idle)."""
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


def server_process(bind: str, curve: tuple[bytes, bytes] | None, conn: Any) -> None:
    """Process entry (see :mod:`zmqflow.bench.procs`): the ROUTER on its own context; answers the
    endpoint it bound. ``curve``: its (public, secret) keypair, as a CURVE server."""
    keep_big_blocks()  # the same allocator as the zmqflow side
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    if curve is not None:
        sock.curve_server = 1
        sock.curve_publickey, sock.curve_secretkey = curve
    try:
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            conn.send(("error", f"cannot bind {bind}: {exc}"))
            return
        conn.send(("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
        _serve(sock, conn.poll)  # a stop message or EOF (parent gone) makes poll() true
    finally:
        sock.close(0)
        ctx.term()


class ServerThread:
    """The ROUTER on a background thread of this process: inproc only connects within one
    context, so it shares zmqflow's process context with the client."""

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
            _serve(self._sock, self._stop.is_set)
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def curve_client(sock: zmq.Socket, public: bytes, secret: bytes, server: bytes) -> None:
    """Make the DEALER a CURVE client (before it connects)."""
    sock.curve_serverkey = server
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def throughput(sock: zmq.Socket, arr: np.ndarray, n: int, window: int) -> float:
    """Seconds to push ``n`` messages with ``window`` in flight, each acked by the ROUTER."""
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


def latency(sock: zmq.Socket, arr: np.ndarray, n: int) -> list[float]:
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


async def loop_latency(sock: zmq.Socket, arr: np.ndarray, n: int) -> list[float]:
    """Round-trip microseconds of ``n`` echoes as :func:`latency`, each reply awaited on the
    running asyncio loop instead of in a blocking ``recv`` (:mod:`zmqflow.bench.loop_floor`)."""
    hdr = _ECHO + b"\0" * 7

    def send() -> None:
        sock.send(hdr, _SNDMORE)
        sock.send(arr, copy=False)

    return await awaited_round_trips(sock, send, n)


def check(sock: zmq.Socket, arr: np.ndarray) -> None:
    """Raise unless the ROUTER echoes ``arr`` back unchanged (within 30 s)."""
    sock.send(_ECHO + b"\0" * 7, _SNDMORE)
    sock.send(arr, copy=False)
    if not sock.poll(30_000):
        raise RuntimeError("raw server did not answer within 30s")
    frames = sock.recv_multipart(copy=False)
    got = np.frombuffer(frames[-1], dtype=arr.dtype)
    if len(frames) != 2 or not np.array_equal(got, arr):
        raise RuntimeError("raw echo returned different data")
