"""Client sessions: talk to a cluster through one of its tasks, from any Python process.

``AsyncSession`` holds its own connections on the caller's loop; ``Session`` runs one on a
background loop for scripts and notebooks. A session is pointed at a target (``server.target``
or ``"tcp://host:port"``) or at a task of a cluster spec.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping
from typing import Any

from ..cluster import Address, ClusterSpec, TaskId, catalog_task, load_config, shard_tasks
from ..errors import ConfigError, InvalidArgument
from ..loop import LoopThread
from ..rpc import DEFAULT_TIMEOUT, RpcClient
from .embedding import AsyncEmbedding, TableInfo, declare_embedding
from .variables import AsyncVariable, VarInfo, declare
from .variables import pull as _pull
from .variables import push as _push

__all__ = ["AsyncSession", "Session", "Variable", "Embedding"]

_WAIT_MARGIN = 5.0


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
    ):
        self.endpoint, self._spec, tid = _target_endpoint(target, cluster, task)
        self.timeout = timeout
        # who pushes: sync replicas count gradients per pusher and name the ones that are missing
        self.name = name or (str(tid) if tid is not None else f"session-{uuid.uuid4().hex[:8]}")
        self.step = 0
        self.replicas: list[str] = []  # who contributed to the last synchronous step this session pushed
        self._client: RpcClient | None = None
        self._infos: dict[str, VarInfo] = {}

    @property
    def client(self) -> RpcClient:
        if self._client is None:
            self._client = RpcClient(identity=f"{self.name}-{uuid.uuid4().hex[:8]}", source=self.name, default_timeout=self.timeout)
        return self._client

    async def _call_task(self, task: TaskId, service: str, op: str, body: Any = None) -> Any:
        spec = self._spec or await self.cluster()
        return await self.client.call(spec.address(task).endpoint, service, op, body, name=str(task))

    async def _catalog_call(self, op: str, body: Any, timeout: float | None = None) -> Any:
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
        return AsyncEmbedding(self, info)

    async def _lookup(self, name: str, timeout: float | None) -> dict[str, Any]:
        """The catalog's record of ``name``, waiting up to ``timeout`` (0: not at all) for its creator."""
        limit = self.timeout if timeout is None else float(timeout)
        return await self._catalog_call("lookup", {"name": name, "wait": limit > 0}, timeout=max(limit, 0.01) + 0.2)

    async def get_embedding(self, name: str, timeout: float | None = None) -> AsyncEmbedding:
        """An existing table by name, waiting (up to ``timeout``) until it exists."""
        return AsyncEmbedding(self, TableInfo.from_record(await self._lookup(name, timeout)))

    async def get(self, name: str, timeout: float | None = None) -> AsyncVariable:
        """The variable ``name`` without creating it, waiting (up to ``timeout``) until it exists."""
        info = VarInfo.from_record(await self._lookup(name, timeout))
        self._infos[name] = info
        return AsyncVariable(self, info)

    async def uninitialized(self, names: list[str]) -> list[str]:
        return await self._catalog_call("uninitialized", {"names": list(names)})

    async def variables(self) -> list[dict[str, Any]]:
        """Every variable of the cluster: name, shape, dtype and each part's task and rows."""
        return [
            {k: r[k] for k in ("name", "shape", "dtype", "parts", "optimizer")}
            for r in await self._catalog_call("records", {})
        ]

    async def _info(self, var: "str | AsyncVariable") -> VarInfo:
        if isinstance(var, AsyncVariable):
            return var.info
        if not isinstance(var, str):
            raise InvalidArgument(f"expected a variable or its name, got {type(var).__name__}")
        info = self._infos.get(var)
        if info is None:
            info = (await self.get(var, timeout=0)).info
        return info

    async def pull(self, names: "list[str | AsyncVariable]") -> dict[str, Any]:
        """Current values by name: one request per shard (more for big variables), all at once."""
        infos = [await self._info(n) for n in names]
        return await _pull(self, infos)

    async def push(self, grads: "Mapping[str | AsyncVariable, Any]", step: int | None = None) -> int | None:
        """Apply each variable's optimizer to its gradient (an array, or ``(indices, rows)``).
        Synchronous variables return the new global step once this step is applied."""
        infos = {await self._info(k): v for k, v in grads.items()}
        result = await _push(self, infos, self.step if step is None else step)
        if result["step"] is not None:
            self.step = result["step"]
        if result["replicas"] is not None:
            self.replicas = result["replicas"]
        return result["step"]

    async def global_step(self) -> int:
        spec = await self.cluster()
        steps = await asyncio.gather(*(self._call_task(t, "ps", "global_step") for t in shard_tasks(spec)))
        self.step = max(steps, default=0)
        return self.step

    async def run(self, function: str, *args: Any, task: "TaskId | str", timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``package.module:function(*args, **kwargs)`` on ``task`` (its allow-list decides)."""
        return await self.call("worker", "run", {"function": function, "args": list(args), "kwargs": kwargs},
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
        return self._spec

    async def status(self, task: "TaskId | str | None" = None) -> dict[str, Any]:
        return await self.call("master", "status", task=task)

    async def wait_for_cluster(self, timeout: float = 30.0) -> None:
        """Return when every task of the cluster answers; else ClusterNotReady naming the others."""
        await self.client.call(
            self.endpoint, "master", "wait_for_cluster", {"timeout": float(timeout)}, timeout=timeout + _WAIT_MARGIN
        )

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Session:
    """The blocking twin of :class:`AsyncSession`, for scripts and notebooks."""

    def __init__(self, target: str | None = None, **kwargs: Any):
        self._async = AsyncSession(target, **kwargs)
        self._thread = LoopThread(name="zmqflow-session")

    @property
    def name(self) -> str:
        return self._async.name

    @property
    def step(self) -> int:
        return self._async.step

    @property
    def replicas(self) -> list[str]:
        """The replicas whose gradients the last synchronous step this session pushed averaged."""
        return self._async.replicas

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        limit = (self._async.timeout if timeout is None else timeout) + _WAIT_MARGIN
        return self._thread.call(coro, timeout=limit)

    def call(self, service: str, op: str, body: Any = None, *, task: "TaskId | str | None" = None, timeout: float | None = None) -> Any:
        return self._run(self._async.call(service, op, body, task=task, timeout=timeout), timeout)

    def cluster(self) -> ClusterSpec:
        return self._run(self._async.cluster())

    def status(self, task: "TaskId | str | None" = None) -> dict[str, Any]:
        return self._run(self._async.status(task))

    def wait_for_cluster(self, timeout: float = 30.0) -> None:
        self._run(self._async.wait_for_cluster(timeout), timeout)

    def variable(self, name: str, initial_value: Any = None, **kwargs: Any) -> "Variable":
        return Variable(self, self._run(self._async.variable(name, initial_value, **kwargs)))

    def embedding(self, name: str, num_embeddings: int | None, dim: int, **kwargs: Any) -> "Embedding":
        return Embedding(self, self._run(self._async.embedding(name, num_embeddings, dim, **kwargs)))

    def get_embedding(self, name: str, timeout: float | None = None) -> "Embedding":
        return Embedding(self, self._run(self._async.get_embedding(name, timeout), timeout))

    def get(self, name: str, timeout: float | None = None) -> "Variable":
        return Variable(self, self._run(self._async.get(name, timeout), timeout))

    def uninitialized(self, names: list[str]) -> list[str]:
        return self._run(self._async.uninitialized(names))

    def variables(self) -> list[dict[str, Any]]:
        return self._run(self._async.variables())

    def pull(self, names: "list[str | Variable]") -> dict[str, Any]:
        return self._run(self._async.pull([_unwrap(n) for n in names]))

    def push(self, grads: "Mapping[str | Variable, Any]", step: int | None = None) -> int | None:
        return self._run(self._async.push({_unwrap(k): v for k, v in grads.items()}, step=step))

    def global_step(self) -> int:
        return self._run(self._async.global_step())

    def run(self, function: str, *args: Any, task: "TaskId | str", timeout: float | None = None, **kwargs: Any) -> Any:
        return self._run(self._async.run(function, *args, task=task, timeout=timeout, **kwargs), timeout)

    def close(self) -> None:
        if self._thread.loop.is_closed():
            return
        self._thread.call(self._async.close(), timeout=5)
        self._thread.stop()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unwrap(var: "str | Variable | AsyncVariable") -> "str | AsyncVariable":
    return var.handle if isinstance(var, Variable) else var


class Variable:
    """A blocking handle on a variable; see :class:`AsyncVariable` for the semantics."""

    def __init__(self, session: Session, handle: AsyncVariable):
        self._session = session
        self.handle = handle

    name = property(lambda self: self.handle.name)
    shape = property(lambda self: self.handle.shape)
    dtype = property(lambda self: self.handle.dtype)
    partitions = property(lambda self: self.handle.partitions)

    def read(self) -> Any:
        return self._session._run(self.handle.read())

    def assign(self, x: Any) -> None:
        self._session._run(self.handle.assign(x))

    def assign_add(self, x: Any) -> None:
        self._session._run(self.handle.assign_add(x))

    def assign_sub(self, x: Any) -> None:
        self._session._run(self.handle.assign_sub(x))

    def scatter_add(self, indices: Any, rows: Any) -> None:
        self._session._run(self.handle.scatter_add(indices, rows))

    def scatter_update(self, indices: Any, rows: Any) -> None:
        self._session._run(self.handle.scatter_update(indices, rows))

    def push(self, grad: Any, *, step: int | None = None) -> int | None:
        return self._session._run(self.handle.push(grad, step=step))

    def __repr__(self) -> str:
        return repr(self.handle).replace("AsyncVariable", "Variable")


class Embedding:
    """A blocking handle on an embedding table; see :class:`AsyncEmbedding` for the semantics."""

    def __init__(self, session: Session, handle: AsyncEmbedding):
        self._session = session
        self.handle = handle

    name = property(lambda self: self.handle.name)
    dim = property(lambda self: self.handle.dim)
    partitions = property(lambda self: self.handle.partitions)

    def lookup(self, ids: Any, *, create: bool = True) -> Any:
        return self._session._run(self.handle.lookup(ids, create=create))

    def lookup_sparse(self, ids: Any, segment_ids: Any, weights: Any = None, combiner: str = "mean",
                      num_segments: int | None = None) -> Any:
        return self._session._run(self.handle.lookup_sparse(ids, segment_ids, weights, combiner, num_segments))

    def push(self, ids: Any, grads: Any) -> int:
        return self._session._run(self.handle.push(ids, grads))

    def stats(self) -> list[dict[str, Any]]:
        return self._session._run(self.handle.stats())

    def size(self) -> int:
        return self._session._run(self.handle.size())

    def evict(self, older_than: Any = None, **kwargs: Any) -> int:
        return self._session._run(self.handle.evict(older_than, **kwargs))

    def export(self, page: int = 1 << 16) -> Any:
        """``(ids, rows)`` pages, shard by shard."""
        agen = self.handle.export(page)
        while True:
            try:
                yield self._session._run(agen.__anext__())
            except StopAsyncIteration:
                return

    def __repr__(self) -> str:
        return repr(self.handle).replace("AsyncEmbedding", "Embedding")
