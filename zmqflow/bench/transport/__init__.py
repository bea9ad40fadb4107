"""Transport benchmark: zmqflow's RPC path against raw pyzmq, over inproc, ipc and tcp loopback.

For each transport and tensor size (float32 arrays of 64 B .. 64 MiB) it measures:

* one-way throughput (msgs/s, GB/s). The sender keeps a window of requests in flight (64 for
  small messages, fewer for big ones: the window holds at most ``window_bytes``, 128 MiB) and the
  receiver answers each with a tiny ack. zmqflow: ``RpcClient.start_call(ep, "worker", "sink",
  {"x": arr})`` against a real task server. Baseline: a blocking pyzmq DEALER sending ``[header,
  array]`` (``copy=False``) with the same window to a raw ROUTER that acks.
* request/reply latency p50/p99, one request in flight. zmqflow: ``await client.call(ep, "worker",
  "echo", {"x": arr})``; baseline: the same DEALER -> ROUTER echo in raw pyzmq.
* numpy memcpy (``np.copyto``) GB/s at each size, as the physical reference.

Targets (reported, never asserted): zmqflow >= 0.9x raw throughput for messages >= 1 MiB on ipc
and tcp, 0.8x on inproc; >= 0.5x raw throughput and p50 latency within 1.3x raw for 64 B. GB/s is 10**9 payload bytes per second.

Modules: :mod:`.plan` (sizes, message counts, targets), :mod:`.raw_pyzmq` (the baseline),
:mod:`.zmqflow_rpc` (the measured side), :mod:`.servers` (where each side's server runs),
:mod:`.runner` (the measurement loop, ``run`` and ``main``), :mod:`.report` (the table).

Run ``python -m zmqflow.bench.transport [--quick] [--json FILE] [--transport tcp ...] [--sizes 64,1M]``
or ``zmqflow bench transport``.
"""

from __future__ import annotations

from ..machine import cpu_idle_fraction, machine_info
from .plan import DEFAULT_SIZES, FULL, QUICK, QUICK_SIZES, TRANSPORTS, Plan, parse_size
from .report import format_table
from .runner import build_parser, main, run

__all__ = [
    "DEFAULT_SIZES",
    "FULL",
    "QUICK",
    "QUICK_SIZES",
    "TRANSPORTS",
    "Plan",
    "build_parser",
    "cpu_idle_fraction",
    "format_table",
    "machine_info",
    "main",
    "parse_size",
    "run",
]
