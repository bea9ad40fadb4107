"""``zmqflow stop``: stop a cluster's tasks cleanly, over the wire (TF's ps tasks never exit).

Each task is asked (``master.shutdown``: it answers, then stops as on SIGTERM and ``serve`` exits 0)
and then pinged until its connection is gone, within ``--timeout``. The chief, the workers and
every other job go first and the ps tasks last, so no trainer loses its shards under it. One line
per task: ``stopped``, ``already down``, ``did not stop within Ns`` or ``refused: ...``; the exit
code is 0 only when every task named is down. With keys (``--keys DIR``, else ``ZMQFLOW_KEYS``)
it asks as the client key, which every task admits to ``master.shutdown`` (see ``zmqflow/rpc/roles.py``).
"""

from __future__ import annotations

import asyncio
import uuid

import click

from ..cluster import ClusterSpec, TaskId, resolve
from ..errors import ConfigError, PermissionDenied, Unauthenticated, Unavailable, ZmqflowError
from ..loop import run
from ..rpc import RpcClient
from ..transport.curve import KEYS_ENV, Keys, keys_from
from ..wire.requests import cluster as crq
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail
from .cluster_arg import load_cluster_arg

__all__ = ["stop", "stop_tasks", "STOPPED", "ALREADY_DOWN"]

STOPPED, ALREADY_DOWN = "stopped", "already down"
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


async def _stop_one(client: RpcClient, spec: ClusterSpec, task: TaskId, timeout: float, reason: str) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    endpoint, name = spec.address(task).endpoint, str(task)
    try:
        await client.call(endpoint, "master", "ping", timeout=min(PROBE, timeout), name=name)
    except (Unauthenticated, PermissionDenied) as exc:
        return f"refused: {exc.message}"
    except Unavailable:
        return ALREADY_DOWN
    except ZmqflowError:
        pass  # slow: ask anyway
    try:
        await client.call(endpoint, "master", "shutdown", crq.Stop(reason=reason), timeout=min(PROBE * 2, timeout), name=name)
    except (Unauthenticated, PermissionDenied) as exc:
        return f"refused: {exc.message}"
    except ZmqflowError:
        pass  # the reply may be lost as it stops: the pings below tell
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return f"did not stop within {timeout:g}s"
        if await _down(client, spec, task, min(PROBE, remaining)):
            return STOPPED
        await asyncio.sleep(min(POLL, max(0.0, deadline - loop.time())))


async def stop_tasks(spec: ClusterSpec, tasks: list[TaskId], timeout: float, keys: Keys | None = None,
                     reason: str = "zmqflow stop") -> list[tuple[TaskId, str]]:
    """Stop ``tasks`` (the ps tasks after all others); each task's outcome, in the order given."""
    if keys is not None:
        keys.learn(spec)
    client = RpcClient(identity=f"stop-{uuid.uuid4().hex[:8]}", source="zmqflow-stop", default_timeout=timeout, keys=keys)
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
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
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
