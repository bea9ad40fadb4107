"""Blocking twins of the async session and its handles, for scripts and notebooks.

``Session`` runs an :class:`AsyncSession` on a background loop; ``Variable`` and ``Embedding``
wrap the async handles and reach the loop only through :class:`.port.LoopPort`.
"""

from __future__ import annotations

import concurrent.futures
import weakref

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from ..cluster import ClusterSpec, TaskId
from ..errors import SessionClosed
from ..loop import LoopThread
from .embedding import AsyncEmbedding
from .port import LoopPort
from .session import WAIT_MARGIN, AsyncSession
from .variables import AsyncVariable

__all__ = ["Session", "Variable", "Embedding"]

T = TypeVar("T")

CLOSE_WAIT_S = 10.0  # what ``close`` waits for the connections to close and the loop to stop


class Session:
    """The blocking twin of :class:`AsyncSession`, for scripts and notebooks."""

    def __init__(self, target: str | None = None, **kwargs: Any):
        self._async = AsyncSession(target, **kwargs)
        self._thread = LoopThread(name="zmqflow-session")
        # A session dropped unclosed would keep its loop thread and its connections (retrying dead
        # peers) for the life of the process. The finalizer holds the loop and the async session,
        # never this object, and waits for nothing: the garbage collector runs on any thread.
        self._finalizer = weakref.finalize(self, self._thread.stop, 0.0, after=self._async.close)

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

    @property
    def async_session(self) -> AsyncSession:
        """The session this one drives on its background loop (for the ``async_*`` functions)."""
        return self._async

    def run_on_loop(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the session's loop and wait: its deadline (the session's by default) plus a margin."""
        limit = (self._async.timeout if timeout is None else timeout) + WAIT_MARGIN
        return self._thread.call(self._open(coro), timeout=limit)

    def submit(self, coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
        """Start ``coro`` on the session's loop without waiting (a background push, say): the
        caller keeps the future and must look at its result, or its error is lost."""
        return self._thread.submit(self._open(coro))

    def _open(self, coro: Awaitable[T]) -> Awaitable[T]:
        """``coro``, where the session is open; else SessionClosed (its loop has stopped)."""
        try:
            self._async.ensure_open()
        except SessionClosed:
            getattr(coro, "close", lambda: None)()  # never to run: no "never awaited" warning
            raise
        return coro

    def call(self, service: str, op: str, body: Any = None, *, task: "TaskId | str | None" = None, timeout: float | None = None) -> Any:
        return self.run_on_loop(self._async.call(service, op, body, task=task, timeout=timeout), timeout)

    def cluster(self) -> ClusterSpec:
        return self.run_on_loop(self._async.cluster())

    def status(self, task: "TaskId | str | None" = None) -> dict[str, Any]:
        return self.run_on_loop(self._async.status(task))

    def wait_for_cluster(self, timeout: float = 30.0) -> None:
        self.run_on_loop(self._async.wait_for_cluster(timeout), timeout)

    def variable(self, name: str, initial_value: Any = None, **kwargs: Any) -> "Variable":
        return Variable(self, self.run_on_loop(self._async.variable(name, initial_value, **kwargs)))

    def embedding(self, name: str, num_embeddings: int | None, dim: int, **kwargs: Any) -> "Embedding":
        return Embedding(self, self.run_on_loop(self._async.embedding(name, num_embeddings, dim, **kwargs)))

    def lookup_many(self, tables: "Sequence[Embedding]", ids: Sequence[Any], *, create: bool = True,
                    timeout: float | None = None) -> list[Any]:
        """Each table's lookup in one request a shard (:meth:`AsyncSession.lookup_many`)."""
        return self.run_on_loop(self._async.lookup_many(_handles(tables), ids, create=create, timeout=timeout), timeout)

    def push_many(self, tables: "Sequence[Embedding]", ids: Sequence[Any], grads: Sequence[Any], *,
                  step: int | None = None, timeout: float | None = None) -> list[int]:
        """Each table's push in one request a shard (:meth:`AsyncSession.push_many`)."""
        return self.run_on_loop(self._async.push_many(_handles(tables), ids, grads, step=step, timeout=timeout),
                                timeout)

    def get_embedding(self, name: str, timeout: float | None = None) -> "Embedding":
        return Embedding(self, self.run_on_loop(self._async.get_embedding(name, timeout), timeout))

    def get(self, name: str, timeout: float | None = None) -> "Variable":
        return Variable(self, self.run_on_loop(self._async.get(name, timeout), timeout))

    def uninitialized(self, names: list[str]) -> list[str]:
        return self.run_on_loop(self._async.uninitialized(names))

    def variables(self) -> list[dict[str, Any]]:
        return self.run_on_loop(self._async.variables())

    def pull(self, names: "list[str | Variable]", *, timeout: float | None = None, out: Any = None) -> dict[str, Any]:
        return self.run_on_loop(self._async.pull([_unwrap(n) for n in names], timeout=timeout, out=out), timeout)

    def push(self, grads: "Mapping[str | Variable, Any]", step: int | None = None, *,
             timeout: float | None = None, learning_rate: float | None = None) -> int | None:
        return self.run_on_loop(self._async.push({_unwrap(k): v for k, v in grads.items()}, step=step, timeout=timeout,
                                                 learning_rate=learning_rate), timeout)

    def push_pull(self, grads: "Mapping[str | Variable, Any]", step: int | None = None, *,
                  timeout: float | None = None, learning_rate: float | None = None, out: Any = None,
                  groups: int | None = None) -> dict[str, Any]:
        limit = 2 * (self._async.timeout if timeout is None else timeout)  # its pushes', then its pulls'
        return self.run_on_loop(self._async.push_pull({_unwrap(k): v for k, v in grads.items()}, step=step,
                                                      timeout=timeout, learning_rate=learning_rate, out=out,
                                                      groups=groups), limit)

    def global_step(self, *, timeout: float | None = None) -> int:
        return self.run_on_loop(self._async.global_step(timeout=timeout), timeout)

    def run(self, function: str, *args: Any, task: "TaskId | str", timeout: float | None = None, **kwargs: Any) -> Any:
        return self.run_on_loop(self._async.run(function, *args, task=task, timeout=timeout, **kwargs), timeout)

    def close(self) -> None:
        """Close the connections and stop the loop, waiting up to ``CLOSE_WAIT_S`` for both. Called on
        the loop's own thread (a done callback of a future from ``submit``), it waits for nothing:
        the close runs there once the callback has returned."""
        self._finalizer()  # the finalizer's path, run once: later calls (and the collector) do nothing
        self._thread.join(CLOSE_WAIT_S)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unwrap(var: "str | Variable | AsyncVariable") -> "str | AsyncVariable":
    return var.handle if isinstance(var, Variable) else var


def _handles(tables: "Sequence[Embedding | AsyncEmbedding]") -> Any:
    """The async handles of blocking tables (others as given, for the session to refuse)."""
    if isinstance(tables, Embedding):
        return tables.handle  # one table, not a sequence of them: the session refuses it
    return [t.handle if isinstance(t, Embedding) else t for t in tables]


class Variable:
    """A blocking handle on a variable; see :class:`AsyncVariable` for the semantics."""

    def __init__(self, session: LoopPort, handle: AsyncVariable):
        self._session = session
        self.handle = handle

    name = property(lambda self: self.handle.name)
    shape = property(lambda self: self.handle.shape)
    dtype = property(lambda self: self.handle.dtype)
    partitions = property(lambda self: self.handle.partitions)
    optimizer = property(lambda self: self.handle.optimizer)

    # ``timeout=``: each request's deadline (the session's by default); DeadlineExceeded past it.
    def read(self, *, out: Any = None, timeout: float | None = None) -> Any:
        """The current value; with ``out`` (an array of its shape and dtype), written into it."""
        return self._session.run_on_loop(self.handle.read(out=out, timeout=timeout), timeout)

    def assign(self, x: Any, *, timeout: float | None = None) -> None:
        self._session.run_on_loop(self.handle.assign(x, timeout=timeout), timeout)

    def assign_add(self, x: Any, *, timeout: float | None = None) -> None:
        self._session.run_on_loop(self.handle.assign_add(x, timeout=timeout), timeout)

    def assign_sub(self, x: Any, *, timeout: float | None = None) -> None:
        self._session.run_on_loop(self.handle.assign_sub(x, timeout=timeout), timeout)

    def scatter_add(self, indices: Any, rows: Any, *, timeout: float | None = None) -> None:
        self._session.run_on_loop(self.handle.scatter_add(indices, rows, timeout=timeout), timeout)

    def scatter_update(self, indices: Any, rows: Any, *, timeout: float | None = None) -> None:
        self._session.run_on_loop(self.handle.scatter_update(indices, rows, timeout=timeout), timeout)

    def push(self, grad: Any, *, step: int | None = None, timeout: float | None = None,
             learning_rate: float | None = None) -> int | None:
        return self._session.run_on_loop(
            self.handle.push(grad, step=step, timeout=timeout, learning_rate=learning_rate), timeout)

    def __repr__(self) -> str:
        return repr(self.handle).replace("AsyncVariable", "Variable")


class Embedding:
    """A blocking handle on an embedding table; see :class:`AsyncEmbedding` for the semantics."""

    def __init__(self, session: LoopPort, handle: AsyncEmbedding):
        self._session = session
        self.handle = handle

    name = property(lambda self: self.handle.name)
    dim = property(lambda self: self.handle.dim)
    partitions = property(lambda self: self.handle.partitions)

    # ``timeout=``: each request's deadline (the session's by default); DeadlineExceeded past it.
    def lookup(self, ids: Any, *, create: bool = True, timeout: float | None = None) -> Any:
        return self._session.run_on_loop(self.handle.lookup(ids, create=create, timeout=timeout), timeout)

    def lookup_sparse(self, ids: Any, segment_ids: Any, weights: Any = None, combiner: str = "mean",
                      num_segments: int | None = None, *, create: bool = True, timeout: float | None = None) -> Any:
        return self._session.run_on_loop(self.handle.lookup_sparse(ids, segment_ids, weights, combiner, num_segments,
                                                                   create=create, timeout=timeout), timeout)

    def push(self, ids: Any, grads: Any, *, step: int | None = None, timeout: float | None = None) -> int:
        return self._session.run_on_loop(self.handle.push(ids, grads, step=step, timeout=timeout), timeout)

    def export_delta(self, since_step: int, directory: str, *, timeout: float | None = None) -> str:
        """Rows changed at steps >= ``since_step`` and ids dropped since, as files; the manifest's path."""
        return self._session.run_on_loop(self.handle.export_delta(since_step, directory, timeout=timeout), timeout)

    def stats(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return self._session.run_on_loop(self.handle.stats(timeout=timeout), timeout)

    def size(self, *, timeout: float | None = None) -> int:
        return self._session.run_on_loop(self.handle.size(timeout=timeout), timeout)

    def evict(self, older_than: Any = None, *, timeout: float | None = None, **kwargs: Any) -> int:
        return self._session.run_on_loop(self.handle.evict(older_than, timeout=timeout, **kwargs), timeout)

    def export(self, page: int = 1 << 16, *, timeout: float | None = None) -> Any:
        """``(ids, rows)`` pages, shard by shard (``timeout``: per page)."""
        agen = self.handle.export(page, timeout=timeout)
        while True:
            try:
                yield self._session.run_on_loop(agen.__anext__(), timeout)
            except StopAsyncIteration:
                return

    def __repr__(self) -> str:
        return repr(self.handle).replace("AsyncEmbedding", "Embedding")
