"""The transport benchmark's small-message rows carry the floor of a loop-driven client: raw pyzmq
awaited on the asyncio loop, measured beside the blocking baseline and zmqflow."""

from __future__ import annotations

import uuid

import numpy as np
import zmq

from zmqflow import loop as zf_loop
from zmqflow.bench.transport import format_table, raw_pyzmq, run
from zmqflow.transport.context import context

from .conftest import BENCH_WIRING


def test_small_rows_measure_raw_pyzmq_on_the_loop_beside_the_blocking_baseline():
    rows = run(quick=True, transports=("inproc",), sizes=[64, 4096], echo=None, plan=BENCH_WIRING)
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


def test_a_throughput_measurement_lasts_long_enough_where_bytes_cost_nothing():
    from zmqflow.bench.transport import QUICK
    from zmqflow.bench.transport.plan import MiB

    by_bytes = QUICK.tput_msgs(16 * MiB)  # 96 MiB of payload: the floor of 2 windows (16)
    assert by_bytes == 2 * QUICK.window(16 * MiB)
    # inproc hands over a pointer: 70 us a message asks for QUICK.tput_min_s of them
    timed = QUICK.tput_msgs(16 * MiB, 70e-6)
    assert timed * 70e-6 >= QUICK.tput_min_s > (timed - 2) * 70e-6
    assert QUICK.tput_msgs(16 * MiB, 1e-9) == QUICK.tput_max_msgs  # capped
    assert QUICK.tput_msgs(16 * MiB, 1.0) == by_bytes  # slow messages: the byte budget rules
