"""Client sessions: talk to a cluster through one of its tasks, from any Python process.

``AsyncSession`` holds its own connections on the caller's loop (its blocking twin ``Session``
is in :mod:`.blocking`). A session is pointed at a target (``server.target`` or
``"tcp://host:port"``) or at a task of a cluster spec. Handles reach it only through
:class:`.port.SessionPort`.

``keys`` (a key directory, else ``ZMQFLOW_KEYS``) makes every connection CurveZMQ. A process that
is a task (its environment names one: ``ZMQFLOW_TASK``, as ``zmqflow launch`` sets it, a
Kubernetes pod's job and index, TF_CONFIG or Slurm) presents its task key, and its session takes
the task's name; any other process presents the client key.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import numbers
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..cluster import Address, ClusterSpec, TaskId, catalog_task, env_task_name, load_config, shard_tasks
from ..errors import ConfigError, InvalidArgument, NotFound, SessionClosed, ShardStateLost, ZmqflowError
from ..rpc import DEFAULT_TIMEOUT, RpcClient
from ..transport.base import Transport
from ..transport.curve import Keys, keys_from
from ..transport.bulk import Kind, bulk_enabled
from ..transport.registry import plain_zeromq
from ..wire.requests import cluster as crq
from . import embedding_many
from .bulk import BulkStream
from .bulk_lanes import lanes
from .bulk_push import PushStream
from .bulk_streams import BulkStreams
from .embedding import AsyncEmbedding, TableInfo, declare_embedding
from .push_pull import push_pull as _push_pull
from .variables import AsyncVariable, VarInfo, declare
from .variables import pull as _pull
from .variables import merged_answers as _merged
from .variables import push as _push

__all__ = ["AsyncSession", "WAIT_MARGIN"]

WAIT_MARGIN = 5.0  # what a blocking caller waits beyond the call's own deadline
# Ops on state a shard held: a NotFound from one of them may mean the shard restarted empty.
_STATE_OPS = frozenset({"pull", "pull_bulk", "assign", "scatter", "push", "push_bulk", "emb_lookup", "emb_push",
                        "emb_lookup_many", "emb_push_many", "emb_stats", "emb_evict", "emb_export"})
_PROBE_TIMEOUT = 5.0  # at most, asking a shard who it is after a NotFound: it just answered
_LEARN_TIMEOUT = 10.0  # at most, asking a shard who it is when a handle first names it


def _target_endpoint(target: str | None, cluster: Any, task: "TaskId | str | None") -> tuple[str, ClusterSpec | None, TaskId | None]:
    if target is not None:  # "host:port", "tcp://host:port", "ipc://path" or "inproc://name"
        return Address.parse(target, "session target").endpoint, None, None
    if cluster is None:
        raise ConfigError("a session needs a target, or cluster= and task=")
    spec, file_task = load_config(cluster)
    tid = TaskId.parse(task) if task is not None else file_task or spec.tasks[0]
    return spec.address(tid).endpoint, spec, tid


class AsyncSession:
    """A session whose methods are coroutines. Use on one event loop."""

    def __init__(
        self,
        target: str | None = None,
        *,
        cluster: "ClusterSpec | Mapping[str, Any] | str | os.PathLike[str] | None" = None,
        task: "TaskId | str | None" = None,
        timeout: float = DEFAULT_TIMEOUT,
        name: str | None = None,
        transport: Transport | None = None,
        keys: "Keys | str | os.PathLike[str] | None" = None,
    ):
        self.endpoint, self._spec, tid = _target_endpoint(target, cluster, task)
        self.keys = keys_from(keys, env_task_name())
        if self.keys is not None:
            if self._spec is not None:
                self.keys.learn(self._spec)
            if self.keys.pinned and name is not None and name != self.keys.name:  # the server would refuse it
                raise ConfigError(f"session name {name!r} differs from its key's ({self.keys.name!r}): with keys "
                                  "a session is named by its key")
            if self.keys.pinned or name is None:
                name = self.keys.name
        self.timeout = timeout
        self.transport = transport  # None: chosen per endpoint scheme (transport.registry)
        # who pushes: sync replicas count gradients per pusher and name the ones that are missing
        self.name = name or (str(tid) if tid is not None else f"session-{uuid.uuid4().hex[:8]}")
        self.step = 0
        self.replicas: list[str] = []  # who contributed to the last synchronous step this session pushed
        self._client: RpcClient | None = None
        self._closed = False
        self._infos: dict[str, VarInfo] = {}
        self._incarnations: dict[TaskId, str] = {}  # each shard this session used, as it was then
        self._asking: dict[TaskId, asyncio.Future[None]] = {}  # shards ``_learn`` is asking who they are
        self._routes: dict[TaskId, tuple[str, str]] = {}  # task -> (endpoint, name): the spec is fixed once known
        self._bulk: BulkStreams | None = None
        # read once, here: a bad value stops the session at its start, not at its first large pull
        self.bulk_lanes = lanes() if bulk_enabled() else 1

    @property
    def client(self) -> RpcClient:
        self.ensure_open()
        if self._client is None:
            # a full 128-bit random suffix: another holder of the same key must not guess this routing id
            self._client = RpcClient(identity=f"{self.name}-{uuid.uuid4().hex}", source=self.name,
                                     default_timeout=self.timeout,
                                     transport=self.transport, keys=self.keys)
        return self._client

    async def call_task(self, task: TaskId, service: str, op: str, body: Any = None, *,
                        timeout: float | None = None, size: int = 0) -> Any:
        """``service.op`` on ``task`` of this session's cluster, within ``timeout`` (the session's
        by default); ``size``: the bytes its reply will carry, when large (``RpcClient.start_call``).
        A shard's NotFound for state it held, from a shard that restarted since this session
        learned of it, is raised as :class:`ShardStateLost` naming the shard."""
        route = self._routes.get(task)
        if route is None:
            spec = self._spec if self._spec is not None else await self.cluster()
            route = self._routes[task] = (spec.address(task).endpoint, str(task))
        try:
            return await self.client.call(route[0], service, op, body, timeout=timeout, name=route[1], size=size)
        except NotFound as exc:
            if service != "ps" or op not in _STATE_OPS:
                raise
            lost = await self._state_lost(task, exc, min(_PROBE_TIMEOUT, self.timeout if timeout is None else timeout))
            if lost is None:
                raise
            raise lost from exc

    async def bulk_stream(self, task: TaskId, kind: Kind = "pull", lane: int = 0) -> BulkStream | PushStream | None:
        """The bulk stream of ``kind`` to ``task``'s shard (:mod:`.bulk_streams`): large pulls land
        through a pull stream, large async pushes go out on a push stream. Opened on first use;
        None where there is none (the task offers none, or this session runs on a transport other
        than ZeroMQ's own, whose faults a stream would bypass)."""
        if not plain_zeromq(self.endpoint, self.transport):
            return None
        if self._bulk is None:
            self._bulk = BulkStreams(self._bulk_call, self._address_of)
        return await self._bulk.get(task, kind, lane)

    async def _bulk_call(self, task: TaskId, op: str, body: Any) -> Any:
        return await self.call_task(task, "ps", op, body, timeout=min(self.timeout, 5.0))

    async def _address_of(self, task: TaskId) -> Address:
        return (self._spec if self._spec is not None else await self.cluster()).address(task)

    async def _learn(self, tasks: Iterable[TaskId]) -> None:
        """Remember who each shard of ``tasks`` is now (its incarnation), once per task: how this
        session later tells a restarted shard from an unknown name. A shard that does not answer
        is asked again next time."""
        new = {t for t in tasks if t not in self._incarnations}
        if not new:
            return
        # One question a shard at a time: the declarations of a model's many variables run at once
        # (a gather), and each asked every shard anew, which sums what it holds: quadratic in all.
        ask = sorted(t for t in new if t not in self._asking)
        if ask:
            asking = asyncio.ensure_future(self._ask(ask))
            for t in ask:
                self._asking[t] = asking
        await asyncio.gather(*(asyncio.shield(f) for f in {self._asking[t] for t in new if t in self._asking}))

    async def _ask(self, tasks: list[TaskId]) -> None:
        """``_learn``'s question to ``tasks``, shared by every call that needs one of them meanwhile."""
        try:
            spec = await self.cluster()
            limit = min(_LEARN_TIMEOUT, self.timeout)
            got = await asyncio.gather(*(self.client.call(spec.address(t).endpoint, "ps", "status", timeout=limit,
                                                          name=str(t)) for t in tasks), return_exceptions=True)
            for task, status in zip(tasks, got):
                if isinstance(status, dict) and isinstance(status.get("incarnation"), str):
                    self._incarnations.setdefault(task, status["incarnation"])
        finally:
            for task in tasks:
                self._asking.pop(task, None)

    async def _state_lost(self, task: TaskId, exc: NotFound, timeout: float) -> ShardStateLost | None:
        """:class:`ShardStateLost` when ``task``'s shard is not the one this session used (it
        restarted), else None: the NotFound stands."""
        known = self._incarnations.get(task)
        if known is None:
            return None
        spec = await self.cluster()
        try:
            status = await self.client.call(spec.address(task).endpoint, "ps", "status", timeout=timeout,
                                            name=str(task))
        except ZmqflowError:
            return None
        now = status.get("incarnation")
        if not isinstance(now, str) or now == known:
            return None
        started = status.get("started")
        when = (f" at {datetime.datetime.fromtimestamp(started).isoformat(timespec='seconds')}"
                if isinstance(started, (int, float)) else "")
        return ShardStateLost(
            f"ps shard {task} lost its state: it restarted{when} since this session used it, and the state it held "
            f"then is gone ({exc.message}). Restore from a checkpoint: zf.checkpoint.restore(sess, dir), or "
            f"zf.checkpoint.recover(sess, dir) on a running cluster", task=str(task), incarnation=now, previous=known)

    async def call_catalog(self, op: str, body: Any, timeout: float | None = None) -> Any:
        """``catalog.op`` on the task that holds the catalog."""
        spec = await self.cluster()
        task = catalog_task(spec)
        return await self.client.call(spec.address(task).endpoint, "catalog", op, body, timeout=timeout, name=str(task))

    # variables --------------------------------------------------------------------------
    async def variable(self, name: str, initial_value: Any = None, *, shape: Any = None, dtype: Any = None,
                       initializer: Any = None, optimizer: Any = None, partitioner: Any = None) -> AsyncVariable:
        """Get-or-create ``name``: the first declaration anywhere creates it, identical ones attach,
        conflicting ones (shape, dtype, partitioning) raise VariableConflict. ``dtype`` defaults to
        the initial value's (float32 for Python numbers and for shapes)."""
        info = await declare(self, name, initial_value, shape=shape, dtype=dtype, initializer=initializer,
                             optimizer=optimizer, partitioner=partitioner)
        self._infos[name] = info
        await self._learn(t for t, _, _ in info.parts)
        return AsyncVariable(self, info)

    async def embedding(self, name: str, num_embeddings: int | None, dim: int, *, partitions: Any = None,
                        partition_strategy: str = "mod", dtype: Any = "float32", initializer: Any = None,
                        optimizer: Any = None, min_frequency: int = 1, capacity: int | None = None) -> AsyncEmbedding:
        """Get-or-create an embedding table spread over the ps shards (``partitions`` parts, one
        per shard by default). ``num_embeddings=None`` makes a dynamic hash table: any int64 id,
        rows created on first lookup (after ``min_frequency`` sightings), at most ``capacity``
        rows per shard with least-recently-used eviction."""
        info = await declare_embedding(self, name, num_embeddings, dim, partitions=partitions,
                                       partition_strategy=partition_strategy, dtype=dtype, initializer=initializer,
                                       optimizer=optimizer, min_frequency=min_frequency, capacity=capacity)
        await self._learn(info.tasks)
        return AsyncEmbedding(self, info)

    async def _lookup(self, name: str, timeout: float | None) -> dict[str, Any]:
        """The catalog's record of ``name``, waiting up to ``timeout`` (0: not at all) for its creator."""
        limit = self.timeout if timeout is None else float(timeout)
        return await self.call_catalog("lookup", crq.Lookup(name=name, wait=limit > 0), timeout=max(limit, 0.01) + 0.2)

    async def lookup_many(self, tables: Sequence[AsyncEmbedding], ids: Sequence[Any], *, create: bool = True,
                          timeout: float | None = None) -> list[np.ndarray]:
        """Each table's lookup of its ids, ``[t.lookup(i) for t, i in zip(tables, ids)]``, in one
        request a shard: a model's tables at the cost of one round trip, not one a table."""
        return await embedding_many.lookup_many(self, tables, ids, create=create, timeout=timeout)

    async def push_many(self, tables: Sequence[AsyncEmbedding], ids: Sequence[Any], grads: Sequence[Any], *,
                        step: int | None = None, timeout: float | None = None) -> list[int]:
        """Each table's push of its gradients in one request a shard; the rows each updated."""
        return await embedding_many.push_many(self, tables, ids, grads, step=step, timeout=timeout)

    async def get_embedding(self, name: str, timeout: float | None = None) -> AsyncEmbedding:
        """An existing table by name, waiting (up to ``timeout``) until it exists."""
        info = TableInfo.from_record(await self._lookup(name, timeout))
        await self._learn(info.tasks)
        return AsyncEmbedding(self, info)

    async def get(self, name: str, timeout: float | None = None) -> AsyncVariable:
        """The variable ``name`` without creating it, waiting (up to ``timeout``) until it exists."""
        info = VarInfo.from_record(await self._lookup(name, timeout))
        self._infos[name] = info
        await self._learn(t for t, _, _ in info.parts)
        return AsyncVariable(self, info)

    async def uninitialized(self, names: list[str]) -> list[str]:
        return await self.call_catalog("uninitialized", crq.Uninitialized(names=list(names)))

    async def variables(self) -> list[dict[str, Any]]:
        """Every variable of the cluster: name, shape, dtype and each part's task and rows."""
        return [
            {k: r[k] for k in ("name", "shape", "dtype", "parts", "optimizer")}
            for r in await self.call_catalog("records", crq.Records())
        ]

    def _known(self, var: object) -> VarInfo | None:
        """``_info`` where it needs no call (a handle, or a name this session has met): no
        coroutine a variable, for a model of hundreds."""
        if isinstance(var, str):
            return self._infos.get(var)
        return var.info if isinstance(var, AsyncVariable) else None

    async def _info(self, var: "str | AsyncVariable") -> VarInfo:
        if isinstance(var, AsyncVariable):
            return var.info
        if not isinstance(var, str):
            raise InvalidArgument(f"expected a variable or its name, got {type(var).__name__}")
        info = self._infos.get(var)
        if info is None:
            info = (await self.get(var, timeout=0)).info
        return info

    async def pull(self, names: "list[str | AsyncVariable]", *, timeout: float | None = None,
                   out: "Mapping[str, Any] | None" = None) -> dict[str, Any]:
        """Current values by name: one request per shard (more for big variables), all at once,
        each within ``timeout`` (the session's by default); ``out``: name -> array to fill, reused."""
        infos = [self._known(n) or await self._info(n) for n in names]
        return await _pull(self, infos, timeout, out)

    async def push(self, grads: "Mapping[str | AsyncVariable, Any]", step: int | None = None, *,
                   timeout: float | None = None, learning_rate: float | None = None) -> int | None:
        """Apply each variable's optimizer to its gradient (an array, ``(indices, rows)``, or
        ``None`` for none this step: a synchronous round counts this replica, adding nothing),
        at ``learning_rate`` in place of each optimizer's own where given (a schedule's value this
        step; a synchronous step applies at the rate of the push that completes it).
        Synchronous variables return the new global step once this step is applied; else a push
        that counts its step in a ``global_step`` variable (one element, no optimizer: a gradient of
        1 adds 1) returns that variable's value after its add, as TF's ``apply_gradients(global_step=)``
        increments it, with no read. Two keys for one variable (two handles, or a name and a
        handle) are refused before anything is sent: their gradients would be merged by no rule."""
        infos = await self._grads(grads)
        rate = None if learning_rate is None else _rate(learning_rate)
        result = await _push(self, infos, self.step if step is None else step, timeout, rate)
        step_now = self._pushed(result)
        return step_now if step_now is not None else result["global_step"]

    async def push_pull(self, grads: "Mapping[str | AsyncVariable, Any]", step: int | None = None, *,
                        timeout: float | None = None, learning_rate: float | None = None,
                        out: "Mapping[str, Any] | None" = None, groups: int | None = None) -> dict[str, Any]:
        """``push(grads)`` and then ``pull`` of the same variables, in one call that overlaps the
        two (:mod:`.push_pull`): each group of variables is read back as soon as its push is
        answered, while later groups' gradients still go out, so a link carries both ways at once.
        Each value includes this push. ``timeout`` bounds the pushes, and each group's pull from
        its push's answer (twice it in all); an error says in ``details["pushed"]`` whether every
        push was answered (the step was taken). ``groups``: about how many groups to cut the model in
        (whole variables each; 1 is a push, then a pull), in place of the default (about 16 of at
        least 1 MiB, one where every shard is on this host). Returns the values by name (``out``'s
        arrays where it names them), as ``pull``; the new step, for synchronous variables, is
        ``self.step``."""
        infos = await self._grads(grads)
        rate = None if learning_rate is None else _rate(learning_rate)
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
            raise InvalidArgument(f"push_pull: groups must be an int >= 1, got {groups!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not timeout > 0):  # NaN too: nothing may go out on it
            raise InvalidArgument(f"push_pull: timeout must be > 0 seconds, got {timeout!r}")
        answered: list[dict[str, Any]] = []
        try:
            return await _push_pull(self, infos, self.step if step is None else step, timeout, rate, out, groups,
                                    answered)
        finally:  # a step the shards took stands, whatever failed after it
            if answered:
                self._pushed(_merged(answered))

    async def _grads(self, grads: "Mapping[str | AsyncVariable, Any]") -> dict[VarInfo, Any]:
        """Each gradient by its variable. Two keys for one variable are refused: their gradients
        would be merged by no rule."""
        infos: dict[VarInfo, Any] = {}
        names: set[str] = set()
        for k, v in grads.items():
            info = self._known(k) or await self._info(k)
            if info.name in names:
                raise InvalidArgument(f"push names variable {info.name!r} twice: one gradient per variable and step",
                                      name=info.name)
            names.add(info.name)
            infos[info] = v
        return infos

    def _pushed(self, result: dict[str, Any]) -> int | None:
        """What a push answered, kept: the step synchronous variables reached, and whose
        gradients it averaged."""
        if result["step"] is not None:
            self.step = result["step"]
        if result["replicas"] is not None:
            self.replicas = result["replicas"]
        return result["step"]

    async def global_step(self, *, timeout: float | None = None) -> int:
        """The highest synchronous step on the default shards and on every task holding a
        variable this session has used (a variable pinned to a worker)."""
        spec = await self.cluster()
        used = {t for info in self._infos.values() for t, _, _ in info.parts}
        tasks = [t for t in spec.tasks if t in used or t in shard_tasks(spec)]
        steps = await asyncio.gather(*(self.call_task(t, "ps", "global_step", timeout=timeout) for t in tasks))
        self.step = max(steps, default=0)
        return self.step

    async def run(self, function: str, *args: Any, task: "TaskId | str", timeout: float | None = None, **kwargs: Any) -> Any:
        """Run a function on ``task``: a name the task registered (``server.register_function``) or
        ``package.module:function``, a public function defined in a module on its allow-list.
        Anything else is ``PermissionDenied``."""
        return await self.call("worker", "run", crq.Run(function=function, args=list(args), kwargs=kwargs),
                               task=task, timeout=timeout)

    async def call(self, service: str, op: str, body: Any = None, *, task: "TaskId | str | None" = None, timeout: float | None = None) -> Any:
        """Call ``service.op`` on the session's target, or on another ``task`` of its cluster."""
        endpoint, name = self.endpoint, None
        if task is not None:
            spec = await self.cluster()
            tid = TaskId.parse(task)
            endpoint, name = spec.address(tid).endpoint, str(tid)
        return await self.client.call(endpoint, service, op, body, timeout=timeout, name=name)

    async def cluster(self) -> ClusterSpec:
        """The cluster the target belongs to (asked once, then remembered)."""
        if self._spec is None:
            reply = await self.client.call(self.endpoint, "master", "cluster")
            self._spec = ClusterSpec(reply["cluster"])
            if self.keys is not None:
                self.keys.learn(self._spec)
        return self._spec

    async def status(self, task: "TaskId | str | None" = None) -> dict[str, Any]:
        return await self.call("master", "status", task=task)

    async def wait_for_cluster(self, timeout: float = 30.0) -> None:
        """Return when every task of the cluster answers; else ClusterNotReady naming the others."""
        await self.client.call(
            self.endpoint, "master", "wait_for_cluster", crq.WaitForCluster(timeout=float(timeout)), timeout=timeout + WAIT_MARGIN
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def ensure_open(self) -> None:
        """SessionClosed naming this session once it is closed."""
        if self._closed:
            raise SessionClosed(f"session {self.name!r} is closed", session=self.name)

    async def close(self) -> None:
        """Close the session's connections; using it afterwards raises SessionClosed."""
        self._closed = True
        if self._bulk is not None:
            bulk, self._bulk = self._bulk, None
            await bulk.close()
        if self._client is not None:
            self._client.close()
            self._client = None

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _rate(value: Any) -> float:
    """A push's learning rate, as a float: finite and not negative (an optimizer's own range)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
        raise InvalidArgument(f"push: learning_rate must be a finite number >= 0, got {value!r}")
    return float(value)
