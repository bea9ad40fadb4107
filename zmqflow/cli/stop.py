"""``zmqflow stop``: stop a cluster's tasks cleanly, over the wire (TF's ps tasks never exit).

Each task is asked (``master.shutdown``: it answers, then stops as on SIGTERM and ``serve`` exits 0)
and then pinged until its connection is gone, within ``--timeout``. The chief, the workers and
every other job go first and the ps tasks last, so no trainer loses its shards under it. One line
per task: ``stopped``, ``already down``, ``did not stop within Ns``, ``refused: ...`` or
``unreachable: ...``; the exit code is 0 only when every task named is down.

A task that never answered is down only when its host says so (it refuses the connection: nothing
listens there); a host that does not resolve or answer says nothing about the task, which may be
running beyond a network this process cannot reach: that is ``unreachable``, not down.

With keys (``--keys DIR``, else ``ZMQFLOW_KEYS``) it asks as the client key, which every task
admits to ``master.shutdown`` (see ``zmqflow/rpc/roles.py``).
"""

from __future__ import annotations

import asyncio
import socket

import click

from ..cluster import Address, ClusterSpec, TaskId, resolve
from ..errors import ConfigError, PermissionDenied, Unauthenticated, Unavailable, ZmqflowError
from ..loop import run
from ..rpc import RpcClient
from ..transport.curve import KEYS_ENV, Keys, keys_from
from ..wire.requests import cluster as crq
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, FiniteFloatRange, fail
from .cluster_arg import load_cluster_arg
from .probe_client import probe_client

__all__ = ["stop", "stop_tasks", "STOPPED", "ALREADY_DOWN", "UNREACHABLE"]

STOPPED, ALREADY_DOWN, UNREACHABLE = "stopped", "already down", "unreachable"
PROBE = 1.0  # one ping's deadline: a live task answers one well within it
POLL = 0.05  # between pings of a task still answering


async def _down(client: RpcClient, spec: ClusterSpec, task: TaskId, timeout: float) -> bool:
    """Whether ``task`` is down: its connection is gone or was never made (not a slow answer)."""
    try:
        await client.call(spec.address(task).endpoint, "master", "ping", timeout=timeout, name=str(task))
    except Unavailable:
        return True
    except ZmqflowError:  # no answer in time, or a refusal: it may still be up
        return False
    return False


async def _unreachable(address: Address, timeout: float) -> str | None:
    """Why ``address`` cannot be reached, or None when its host refuses the connection (nothing
    listens: the task is down). ZeroMQ retries a connection in silence, so a plain one tells."""
    if address.scheme != "tcp":  # a local path: nothing there, or nothing listening, is down
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout)
    except ConnectionRefusedError:
        return None
    except socket.gaierror as exc:
        return f"host {address.host} does not resolve ({exc.strerror or exc})"
    except TimeoutError:
        return f"no answer from {address} within {timeout:g}s"
    except OSError as exc:
        return f"cannot connect to {address}: {exc.strerror or exc}"
    writer.close()
    return f"{address} accepts connections but no zmqflow task answered there"


async def _stop_one(client: RpcClient, spec: ClusterSpec, task: TaskId, timeout: float, reason: str) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    address = spec.address(task)
    endpoint, name = address.endpoint, str(task)
    reached = False  # whether a request ever went out on a connection to it
    try:
        await client.call(endpoint, "master", "ping", timeout=min(PROBE, timeout), name=name)
        reached = True
    except (Unauthenticated, PermissionDenied) as exc:
        return f"refused: {exc.message}"
    except Unavailable:  # never connected: down only if its host refuses the connection
        why = await _unreachable(address, min(PROBE, max(0.1, deadline - loop.time())))
        return ALREADY_DOWN if why is None else f"{UNREACHABLE}: {why}"
    except ZmqflowError:
        reached = True  # sent, but slow: ask anyway
    try:
        await client.call(endpoint, "master", "shutdown", crq.Stop(reason=reason), timeout=min(PROBE * 2, timeout), name=name)
        reached = True
    except (Unauthenticated, PermissionDenied) as exc:
        return f"refused: {exc.message}"
    except ZmqflowError:
        pass  # the reply may be lost as it stops: the pings below tell
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return f"did not stop within {timeout:g}s"
        if await _down(client, spec, task, min(PROBE, remaining)):
            why = None if reached else await _unreachable(address, min(PROBE, max(0.1, deadline - loop.time())))
            return STOPPED if why is None else f"{UNREACHABLE}: {why}"
        await asyncio.sleep(min(POLL, max(0.0, deadline - loop.time())))


async def stop_tasks(spec: ClusterSpec, tasks: list[TaskId], timeout: float, keys: Keys | None = None,
                     reason: str = "zmqflow stop") -> list[tuple[TaskId, str]]:
    """Stop ``tasks`` (the ps tasks after all others); each task's outcome, in the order given."""
    if keys is not None:
        keys.learn(spec)
    client = probe_client("stop", timeout, keys, source="zmqflow-stop")
    outcome: dict[TaskId, str] = {}
    try:
        for phase in ([t for t in tasks if t.job != "ps"], [t for t in tasks if t.job == "ps"]):
            results = await asyncio.gather(*(_stop_one(client, spec, t, timeout, reason) for t in phase))
            outcome.update(zip(phase, results))
    finally:
        client.close()
    return [(t, outcome[t]) for t in tasks]


def _tasks(spec: ClusterSpec, names: tuple[str, ...]) -> list[TaskId]:
    if not names:
        return list(spec.tasks)
    chosen: list[TaskId] = []
    for name in names:
        try:
            tid = TaskId.parse(name)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"--task {name!r}: {exc}") from None
        if tid not in spec.tasks:
            raise ConfigError(f"--task {name!r}: the cluster has no such task (tasks: "
                              f"{', '.join(map(str, spec.tasks))})")
        if tid not in chosen:
            chosen.append(tid)
    return chosen


@click.command()
@click.option("--cluster", metavar="PATH|JSON", help="Cluster spec file or inline JSON (else ZMQFLOW_CLUSTER, TF_CONFIG).")
@click.option("--keys", metavar="DIR", envvar=KEYS_ENV, type=click.Path(file_okay=False),
              help="CurveZMQ key directory (else ZMQFLOW_KEYS): asks as the client key.")
@click.option("--timeout", type=FiniteFloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds each task has to stop answering.")
@click.option("--task", "task_names", multiple=True, metavar="JOB:INDEX",
              help="Stop only this task; repeatable (default: every task).")
def stop(cluster: str | None, keys: str | None, timeout: float, task_names: tuple[str, ...]) -> None:
    """Stop every task of a cluster (or those named): workers and chief first, then ps.

    Exits 0 only when every task named is down."""
    try:
        spec = load_cluster_arg(cluster) if cluster is not None else resolve(None, None, require_task=False)[0]
        tasks = _tasks(spec, task_names)
        loaded = keys_from(keys, env={})
    except ConfigError as exc:
        fail("stop", exc, EXIT_USAGE)
    results = run(stop_tasks(spec, tasks, timeout, loaded))
    width = max(len(str(t)) for t, _ in results)
    for task, outcome in results:
        click.echo(f"{str(task).ljust(width)}  {outcome}")
    down = all(outcome in (STOPPED, ALREADY_DOWN) for _, outcome in results)
    raise SystemExit(EXIT_OK if down else EXIT_FAILURE)
