"""The process's ZeroMQ context, created lazily and again after a fork (never shared across one).

``ZMQFLOW_IO_THREADS`` sets its I/O threads (default 1, libzmq's: its guide asks for about one
per gigabyte a second of traffic). Every connection is served by one of them, so a process that
moves tensors to or from several peers at once over a fast link can spread that work over cores.
"""

from __future__ import annotations

import os
import threading

import zmq

from ..env import bounded_int

__all__ = ["context", "io_threads"]

_lock = threading.Lock()
_ctx: zmq.Context | None = None
_pid = 0
MAX_IO_THREADS = 64


def io_threads(environ: dict[str, str] | None = None) -> int:
    """The I/O threads ``ZMQFLOW_IO_THREADS`` asks for (1 when unset); ConfigError names a bad value."""
    return bounded_int("ZMQFLOW_IO_THREADS", 1, MAX_IO_THREADS, 1, environ)


def context() -> zmq.Context:
    """One context per process: inproc endpoints only connect within a context."""
    global _ctx, _pid
    with _lock:
        if _ctx is None or _pid != os.getpid() or _ctx.closed:
            _ctx = zmq.Context(io_threads=io_threads())
            _pid = os.getpid()
        return _ctx
