"""Test helpers: local cluster specs on any transport, in-process clusters, polling with deadlines.

Nothing here sleeps and hopes: ``wait_until`` polls a predicate and fails loudly at its deadline,
and ``local_cluster`` requires a timeout for its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from .cluster import ClusterSpec, TaskId
from .ports import free_port
from .rpc import Service
from .server.task import AsyncServer

__all__ = ["free_port", "make_spec", "wait_until", "async_wait_until", "local_cluster", "TRANSPORTS"]

TRANSPORTS = ("inproc", "ipc", "tcp")
_names = itertools.count()


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
