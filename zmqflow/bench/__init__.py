"""Benchmarks that measure zmqflow against the raw libraries it is built on.

``zmqflow.bench.transport``: tensor throughput and request/reply latency of zmqflow's RPC path
against a raw pyzmq DEALER/ROUTER baseline over inproc, ipc and tcp loopback, with numpy
memcpy as the physical reference. Run ``python -m zmqflow.bench.transport --quick``.
"""

__all__: list[str] = []
