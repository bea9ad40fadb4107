"""Free local ports for clusters generated on one host (``launch``, tests, benchmarks)."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_handed_out: set[int] = set()
_pick = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the kernel's ephemeral range, never one this process
    was already given. Outside the range, because ports in it are also handed to outgoing
    connections: one could take the port before its task binds it, and a connection retried to
    a port nobody listens on yet can, on loopback, connect to itself."""
    lo, hi = _ephemeral_range()
    span = (10000, lo) if lo - 10000 >= 1000 else (hi + 1, 65536)
    for _ in range(200):
        port = _pick.randrange(*span) if span[1] - span[0] >= 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no fresh free port on {host}")
