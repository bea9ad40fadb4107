"""Test helpers: local cluster specs on any transport, in-process clusters, fault injection, polling with deadlines.

Nothing here sleeps and hopes: ``wait_until`` polls a predicate and fails loudly at its deadline,
and ``local_cluster`` requires a timeout for its start. ``faulty_cluster`` runs a cluster on a
seeded ``FaultInjector``, so a test makes one precise thing happen (a reply lost, a request held in
flight across a fence, a connection cut while calls are out) instead of waiting for timing luck.
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
from .server.checkpoint_roots import ANYWHERE
from .server.task import AsyncServer
from .transport import registry
from .transport.base import Transport
from .transport.faults import REPLY, REQUEST, FaultInjector, Packet, Rule

__all__ = [
    "free_port", "make_spec", "wait_until", "async_wait_until", "local_cluster", "faulty_cluster", "TRANSPORTS",
    "FaultInjector", "Packet", "Rule", "REQUEST", "REPLY",
]

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
    via: Transport | None = None,
    **server_kwargs: Any,
) -> AsyncIterator[dict[str, AsyncServer]]:
    """Every task of a cluster as an AsyncServer on this loop, up and answering within ``timeout``.

    With ``via``, every server, and every client made inside the block, uses that transport
    (``transport`` then only shapes the addresses). Its ps shards write checkpoints anywhere
    (``checkpoint_roots="*"``: one process, one test's own directories) unless
    ``checkpoint_roots=`` says otherwise."""
    server_kwargs.setdefault("checkpoint_roots", ANYWHERE)
    spec = jobs if isinstance(jobs, ClusterSpec) else make_spec(jobs, transport)
    with contextlib.ExitStack() as stack:
        if via is not None:
            stack.enter_context(registry.use(via))
        async with _servers(spec, timeout, services, server_kwargs) as servers:
            yield servers


@contextlib.asynccontextmanager
async def faulty_cluster(
    jobs: Mapping[str, int] | ClusterSpec,
    *,
    timeout: float,
    seed: int = 0,
    inner: Transport | None = None,
    services: Callable[[TaskId], Mapping[str, Service]] | None = None,
    **server_kwargs: Any,
) -> AsyncIterator[tuple[dict[str, AsyncServer], FaultInjector]]:
    """``local_cluster`` on a FaultInjector seeded with ``seed`` (over in-process delivery, or
    ``inner``); yields the servers and the injector. Rules added after the start act on what
    follows: ``async with faulty_cluster({"ps": 1, "worker": 1}, timeout=10) as (servers, faults):
    faults.drop(op="ps.push", direction=REPLY, times=1)``."""
    faults = FaultInjector(inner, seed=seed)
    async with local_cluster(jobs, timeout=timeout, services=services, via=faults, **server_kwargs) as servers:
        yield servers, faults


@contextlib.asynccontextmanager
async def _servers(
    spec: ClusterSpec, timeout: float, services: Callable[[TaskId], Mapping[str, Service]] | None, server_kwargs: dict
) -> AsyncIterator[dict[str, AsyncServer]]:
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
