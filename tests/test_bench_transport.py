"""The transport benchmark's small-message rows carry the floor of a loop-driven client: raw pyzmq
awaited on the asyncio loop, measured beside the blocking baseline and zmqflow."""

from __future__ import annotations

import uuid

import numpy as np
import zmq

from zmqflow import loop as zf_loop
from zmqflow.bench.transport import format_table, raw_pyzmq, run
from zmqflow.transport.context import context


def test_small_rows_measure_raw_pyzmq_on_the_loop_beside_the_blocking_baseline():
    rows = run(quick=True, transports=("inproc",), sizes=[64, 4096], echo=None)
    small, big = rows
    assert small["loop_p50_us"] > 0 and small["lat_ratio_loop"] == small["zf_p50_us"] / small["loop_p50_us"]
    assert "loop_p50_us" not in big  # only where the latency target judges
    assert "awaited on the asyncio loop" in format_table(rows)


def test_loop_latency_times_real_echoes_and_leaves_the_socket_as_it_was():
    server = raw_pyzmq.ServerThread(f"inproc://bench-loop-latency-{uuid.uuid4().hex[:8]}")
    sock = context().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(server.endpoint)
        arr = np.arange(64, dtype=np.uint8)
        got = zf_loop.run(raw_pyzmq.loop_latency(sock, arr, 50))
        assert len(got) == 50 and all(us > 0 for us in got)
        raw_pyzmq.check(sock, arr)  # nothing left unread: the next echo is its own
    finally:
        sock.close(0)
        server.stop()
