"""The process's ZeroMQ context, created lazily and again after a fork (never shared across one)."""

from __future__ import annotations

import os
import threading

import zmq

__all__ = ["context"]

_lock = threading.Lock()
_ctx: zmq.Context | None = None
_pid = 0


def context() -> zmq.Context:
    """One context per process: inproc endpoints only connect within a context."""
    global _ctx, _pid
    with _lock:
        if _ctx is None or _pid != os.getpid() or _ctx.closed:
            _ctx = zmq.Context()
            _pid = os.getpid()
        return _ctx
