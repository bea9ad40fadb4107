"""Horovod-shaped collectives over JAX pytrees, on the process's ring of ranks.

``allreduce``, ``broadcast`` and ``allgather`` take any pytree and give back JAX arrays in the
same structure. The leaves of one dtype go to the ring as one call (the ring fuses them into one
buffer), so a model's gradients cost one ring call, not one per parameter.

Inside ``jax.jit`` (an optax update in a jitted train step) the collective becomes an ordered
``io_callback``: the host runs it when the compiled step reaches it. Ordered effects run in
program order, and the eager collectives first wait for those still pending
(``jax.effects_barrier``), so every rank starts its collectives in the same order. ``vmap`` and
``grad`` go through them (see ``transforms``): the gradient of a sum (mean) allreduce is the sum
(mean) allreduce of the cotangents, that of a broadcast reaches the root, that of an allgather
each rank's own row.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ..bridge import runtime as rt
from ..client.ring import AsyncRing
from ..client.ring_blocking import Ring
from ..cluster import ClusterSpec, TaskId
from ..errors import DeadlineExceeded, InvalidArgument
from .arrays import (Leaves, as_buffer, check_dtype, flatten, fuse, group_by_dtype, is_tracer, narrow, prod_of,
                     split, to_jax)
from .transforms import cotangents, transformable

__all__ = ["OPS", "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "allreduce", "broadcast", "allgather", "barrier"]

OPS = ("mean", "sum", "min", "max", "prod")


_traced_once = threading.Event()  # a collective was compiled into a jitted function: its effects may be pending
_given_up: "weakref.WeakSet[AsyncRing]" = weakref.WeakSet()  # rings whose calls outlived their wait

GRACE_S = 5.0
"""How long past a collective's own deadline its caller waits before giving the ring up."""


def init(cluster: "ClusterSpec | Mapping[str, Any] | str | os.PathLike[str] | None" = None,
         task: "TaskId | str | None" = None, timeout: float = 60.0) -> rt.Runtime:
    """Join the cluster ``zmqflow launch`` describes (or a private one-process cluster); see
    :func:`zmqflow.bridge.runtime.init`. A second call returns the same runtime."""
    return rt.init(cluster, task, timeout=timeout)


def shutdown() -> None:
    """Leave the cluster; ``init()`` may be called again. The runtime tells the other ranks this
    one is done before its server stops (see ``zmqflow.bridge.runtime.shutdown``)."""
    if _traced_once.is_set():
        jax.effects_barrier()  # no compiled collective may run on a ring that is gone
    rt.shutdown()


def is_initialized() -> bool:
    return rt.is_initialized()


def rank() -> int:
    """This process's rank: 0 for the chief (or the first worker), then every worker."""
    return rt.current().rank


def size() -> int:
    """How many ranks the ring has."""
    return rt.current().size


def local_rank() -> int:
    """This process's rank among the ranks on its host (pick the local accelerator with it)."""
    return rt.current().local_rank


def local_size() -> int:
    return rt.current().local_size


def _ring() -> Ring:
    ring = rt.current().require_ring()
    if ring.async_ring in _given_up:
        raise DeadlineExceeded(f"ring {ring.async_ring.name!r} is unusable: an earlier collective on it did not "
                               f"finish in time and may still be running, so a new call could be matched with it "
                               f"on the other ranks; call zmqflow.jax.shutdown() and init() again")
    return ring


def _settle() -> None:
    """Wait for collectives a jitted step dispatched and has not run yet, so this one starts after them."""
    if _traced_once.is_set():
        jax.effects_barrier()


def _run(what: str, tree: Any, host: Callable[[list[Any]], list[Any]], vjp: Callable[[tuple[Any, ...]], Any],
         check: Callable[[str, np.dtype], None] | None = None, gathered: bool = False) -> Any:
    """Check every leaf, then run ``host`` on their buffers (eagerly, or as an ordered callback
    when traced, differentiable by ``vjp``) and rebuild the tree from what it returns.
    ``gathered``: each result has a new leading axis of ``size()`` rows."""
    leaves: Leaves = flatten(tree)
    for path, x in zip(leaves.paths, leaves.leaves):
        dt = check_dtype(what, path, x.dtype)
        if check is not None:
            check(path, dt)
    if not len(leaves):
        return leaves.unflatten([])
    if leaves.traced:
        n = size() if gathered else 0  # also: no runtime is a ConfigError now, not an INTERNAL one when it runs
        _ring()
        _traced_once.set()
        xs = tuple(x if is_tracer(x) or isinstance(x, jax.Array) else narrow(what, f"leaf {p}", x)
                   for p, x in zip(leaves.paths, leaves.leaves))  # a constant JAX would narrow silently

        def on_host(*arrays: Any) -> list[np.ndarray]:
            return [np.asarray(r) for r in host([np.asarray(a) for a in arrays])]

        def raw(args: tuple[Any, ...]) -> tuple[Any, ...]:
            structs = [jax.ShapeDtypeStruct((n, *a.shape) if gathered else a.shape, a.dtype) for a in args]
            return tuple(io_callback(on_host, structs, *args, ordered=True))

        return leaves.unflatten(transformable(raw, vjp, gathered)(xs))
    _settle()
    results = host([as_buffer(x) for x in leaves.leaves])
    return leaves.unflatten([to_jax(what, p, r, x, gathered) for p, r, x in zip(leaves.paths, results, leaves.leaves)])


def _overlapped(ring: Ring, calls: list[Callable[[AsyncRing], Coroutine[Any, Any, Any]]],
                timeout: float | None) -> list[Any]:
    """Start single-buffer collectives together (each takes one sequence number when it starts,
    in this order on every rank) and wait for all of them."""
    futures = [ring.submit(call(ring.async_ring)) for call in calls]
    limit = (ring.async_ring.timeout if timeout is None else float(timeout)) + GRACE_S
    _, late = concurrent.futures.wait(futures, timeout=limit)
    if late:  # they hold sequence numbers and may still run: no later call may start beside them
        _given_up.add(ring.async_ring)
        raise DeadlineExceeded(f"a collective on ring {ring.async_ring.name!r} did not finish in {limit:g}s; "
                               f"the ring is given up: call zmqflow.jax.shutdown() and init() again")
    return [f.result() for f in futures]


def allreduce(tree: Any, op: str = "mean", *, timeout: float | None = None) -> Any:
    """Reduce every leaf across the ranks: ``mean`` (integers truncate toward zero), ``sum``,
    ``min``, ``max`` or ``prod``. Every rank gets the same bytes back. One ring call per dtype."""
    if op not in OPS:
        raise InvalidArgument(f"allreduce: op must be one of {', '.join(OPS)}, got {op!r}")

    def no_bool_mean(path: str, dt: np.dtype) -> None:
        if op == "mean" and dt.kind == "b":
            raise InvalidArgument(f"allreduce: the mean of leaf {path} (bool) is not defined; "
                                  f"use op='sum', 'min' or 'max'")

    def host(arrays: list[Any]) -> list[Any]:
        ring = _ring()
        out: list[Any] = [None] * len(arrays)
        for idx in group_by_dtype(arrays):
            group = [arrays[i] for i in idx]
            if op == "prod":  # the ring has no product: gather, then multiply in rank order everywhere
                results = split(prod_of(ring.allgather(fuse(group), timeout=timeout)), [a.shape for a in group])
            else:
                results = ring.allreduce(group, op, timeout=timeout)  # sequential: a big group takes several buckets
            for i, r in zip(idx, results):
                out[i] = r
        return out

    def vjp(cts: tuple[Any, ...]) -> Any:
        if op not in ("sum", "mean"):
            raise InvalidArgument(f"allreduce: op {op!r} has no gradient here, only 'sum' and 'mean' do; "
                                  f"apply jax.lax.stop_gradient to its input if none should flow through it")
        return cotangents(cts, lambda live: allreduce(live, op, timeout=timeout))

    return _run("allreduce", tree, host, vjp, check=no_bool_mean)


def broadcast(tree: Any, root: int = 0, *, timeout: float | None = None) -> Any:
    """``root``'s leaves on every rank (the others pass a tree of the same shapes and dtypes)."""
    n = size()
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n:
        raise InvalidArgument(f"broadcast: root must be a rank in [0, {n}), got {root!r}")

    def host(arrays: list[Any]) -> list[Any]:
        ring = _ring()
        groups = group_by_dtype(arrays)
        fused = [fuse([arrays[i] for i in idx]) for idx in groups]
        got = _overlapped(ring, [lambda r, buf=buf: r.broadcast(buf, root, timeout=timeout) for buf in fused], timeout)
        out: list[Any] = [None] * len(arrays)
        for idx, buf in zip(groups, got):
            for i, part in zip(idx, split(buf, [arrays[i].shape for i in idx])):
                out[i] = part
        return out

    def vjp(cts: tuple[Any, ...]) -> Any:  # every rank's cotangent flows back to the root's leaves
        root_gets = rank() == root
        return cotangents(cts, lambda live: [c if root_gets else jnp.zeros_like(c)
                                             for c in allreduce(live, "sum", timeout=timeout)])

    return _run("broadcast", tree, host, vjp)


def allgather(tree: Any, *, timeout: float | None = None) -> Any:
    """Every rank's leaves, stacked: each leaf of shape ``s`` comes back as ``(size, *s)``, row
    ``r`` from rank ``r`` (every rank passes the same shapes)."""
    n = size()

    def host(arrays: list[Any]) -> list[Any]:
        ring = _ring()
        groups = group_by_dtype(arrays)
        fused = [fuse([arrays[i] for i in idx]) for idx in groups]
        got = _overlapped(ring, [lambda r, buf=buf: r.allgather(buf, timeout=timeout) for buf in fused], timeout)
        out: list[Any] = [None] * len(arrays)
        for idx, stacked in zip(groups, got):
            for i, part in zip(idx, split(stacked, [arrays[i].shape for i in idx], lead=(n,))):
                out[i] = part
        return out

    def vjp(cts: tuple[Any, ...]) -> Any:  # row r of every rank's cotangent flows back to rank r
        me = rank()
        return cotangents(cts, lambda live: [c[me] for c in allreduce(live, "sum", timeout=timeout)])

    return _run("allgather", tree, host, vjp, gathered=True)


def barrier(*, timeout: float | None = None) -> None:
    """Return once every rank has reached its barrier (after its pending jitted collectives)."""
    _settle()
    _ring().barrier(timeout=timeout)
