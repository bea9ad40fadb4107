"""Test helpers: local cluster specs on any transport, in-process clusters, polling with deadlines.

Nothing here sleeps and hopes: ``wait_until`` polls a predicate and fails loudly at its deadline,
and ``local_cluster`` requires a timeout for its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from .cluster import ClusterSpec, TaskId
from .rpc import Service
from .server import AsyncServer

__all__ = ["free_port", "make_spec", "wait_until", "async_wait_until", "local_cluster", "TRANSPORTS"]

TRANSPORTS = ("inproc", "ipc", "tcp")
_names = itertools.count()


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


def make_spec(jobs: Mapping[str, int], transport: str = "tcp", *, ipc_dir: str | None = None) -> ClusterSpec:
    """A cluster of ``{job: count}`` tasks on fresh local addresses of ``transport``."""
    tag = f"{os.getpid()}-{next(_names)}"
    out: dict[str, list[str]] = {}
    for job, count in jobs.items():
        addrs = []
        for i in range(count):
            if transport == "tcp":
                addrs.append(f"127.0.0.1:{free_port()}")
            elif transport == "ipc":
                base = ipc_dir or tempfile.gettempdir()
                addrs.append(f"ipc://{base}/zf-{tag}-{job}-{i}.sock")
            elif transport == "inproc":
                addrs.append(f"inproc://zf-{tag}-{job}-{i}")
            else:
                raise ValueError(f"unknown transport {transport!r}; use one of {TRANSPORTS}")
        out[job] = addrs
    return ClusterSpec(out)


def wait_until(pred: Callable[[], Any], timeout: float, *, interval: float = 0.01, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy; raise TimeoutError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g}s")
        time.sleep(interval)


async def async_wait_until(pred: Callable[[], Any], timeout: float, *, interval: float = 0.01, what: str = "condition") -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = pred()
        if value:
            return value
        if loop.time() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g}s")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def local_cluster(
    jobs: Mapping[str, int] | ClusterSpec,
    *,
    timeout: float,
    transport: str = "inproc",
    services: Callable[[TaskId], Mapping[str, Service]] | None = None,
    **server_kwargs: Any,
) -> AsyncIterator[dict[str, AsyncServer]]:
    """Every task of a cluster as an AsyncServer on this loop, up and answering within ``timeout``."""
    spec = jobs if isinstance(jobs, ClusterSpec) else make_spec(jobs, transport)
    servers: dict[str, AsyncServer] = {}
    try:
        async with asyncio.timeout(timeout):
            for tid in spec.tasks:
                extra = services(tid) if services else None
                servers[str(tid)] = await AsyncServer(spec, tid, services=extra, **server_kwargs).start()
            await next(iter(servers.values())).wait_for_cluster(timeout)
        yield servers
    finally:
        for server in servers.values():
            await server.stop()
