"""The blocking ring: :class:`AsyncRing`'s collectives driven from the caller's thread.

Each call runs on the task server's loop thread, except where it may go straight through the
same-host shared memory from the caller's thread (a numpy or cupy array, or a list of numpy arrays
of one dtype, that fits one bucket, with nothing of this ring still running on the loop): that
saves the hand-offs to the loop and back.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cluster import TaskId
from ..server.task import AsyncServer, Server
from ..state.reduce import OPS, Joined, is_cupy, to_device, to_host, unfuse
from . import ring_shm
from .ring import AsyncRing
from .ring_meta import call_meta

__all__ = ["Ring"]

_NOTHING = np.zeros(0, np.int8)  # what a barrier carries


class Ring:
    """The blocking ring on a :class:`Server` (its loop thread runs the collectives).
    ``Ring(async_server)`` gives an :class:`AsyncRing` instead."""

    def __new__(cls, server: Any, members: Any = None, **kwargs: Any) -> Any:
        if isinstance(server, AsyncServer):
            return AsyncRing(server, members, **kwargs)
        return super().__new__(cls)

    def __init__(self, server: Server, members: Sequence["TaskId | str"] | None = None, **kwargs: Any):
        self._bind(server, AsyncRing(server.async_server, members, **kwargs))

    def _bind(self, server: Server, ring: AsyncRing) -> None:
        self._server, self._async = server, ring
        self._pending = 0  # submitted calls not yet finished: the blocking fast path waits its turn behind them
        self._pending_lock = threading.Lock()  # counted up here, down on the loop thread

    @classmethod
    def over(cls, server: Server, ring: AsyncRing) -> "Ring":
        """The blocking face of an existing AsyncRing."""
        out = object.__new__(cls)
        out._bind(server, ring)
        return out

    @property
    def async_ring(self) -> AsyncRing:
        """The ring this one drives; its coroutines run on the server's loop (``submit``)."""
        return self._async

    def submit(self, coro: Any) -> "concurrent.futures.Future[Any]":
        """Start ``coro`` (a collective of :attr:`async_ring`) on the server's loop without waiting.
        Collectives started from one thread start in that order, so every rank may keep several
        in flight (a collective takes its sequence number when it starts)."""
        with self._pending_lock:
            self._pending += 1
        fut = self._server.loop_thread.submit(coro)
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _: Any) -> None:
        with self._pending_lock:
            self._pending -= 1

    rank = property(lambda self: self._async.rank)
    size = property(lambda self: self._async.size)
    members = property(lambda self: self._async.members)

    def _call(self, coro: Any, timeout: float | None) -> Any:
        limit = (self._async.timeout if timeout is None else timeout) + 5.0
        return self._server.loop_thread.call(coro, timeout=limit)

    def _host(self, array: Any, gpu: bool = False) -> "ring_shm.ShmChannel | None":
        """The same-host channel when ``array`` may go through it from this thread: a numpy array
        (or, with ``gpu``, a cupy one, staged through the host), and no call submitted to the loop
        still running (it takes its sequence number there)."""
        shm = self._async.shm_channel
        # an array in the other byte order takes the loop's path, where ``as_array`` makes it native
        usable = (type(array) is np.ndarray and array.dtype.isnative) or (gpu and is_cupy(array))
        return shm if shm is not None and not self._pending and usable else None

    def _on_host(self, shm: "ring_shm.ShmChannel", flat: Any, op: str, meta: list[Any], timeout: float | None,
                 root: int = 0, in_place: bool = False) -> Any:
        """One call through shared memory from this thread; over TCP, with the number it took, when
        the channel broke on an earlier call while this one was being chosen (as on every rank)."""
        try:
            return self._async.run_on_host(shm, flat, op, meta, timeout, root, in_place)
        except ring_shm.ChannelClosed as closed:
            return self._call(self._async.over_tcp(flat, op, meta, closed.seq, timeout, root), timeout)

    def allreduce(self, arrays: Any, op: str = "sum", *, timeout: float | None = None) -> Any:
        if isinstance(arrays, (list, tuple)):
            return self._allreduce_list(arrays, op, timeout)
        shm = self._host(arrays, gpu=True)
        if shm is not None and op in OPS and arrays.nbytes <= self._async.bucket_bytes:  # no hand-off to the loop
            meta = call_meta("allreduce", op, [arrays])
            started = time.perf_counter()
            if is_cupy(arrays):  # one copy down to pinned memory, reduced there in place, one copy up
                staged = self._on_host(shm, to_host([arrays]), op, meta, timeout, in_place=True)
                out = to_device(staged).reshape(arrays.shape)
            else:
                out = self._on_host(shm, arrays.reshape(-1), op, meta, timeout).reshape(arrays.shape)
            self._noted(arrays.nbytes, started)
            return out
        return self._call(self._async.allreduce(arrays, op, timeout=timeout), timeout)

    def _noted(self, nbytes: int, started: float) -> None:
        """Count an allreduce of the fast path in the task's metrics, as the loop counts its own:
        the count goes to the loop thread, which owns the metrics (no waiting for it here)."""
        self._server.loop_thread.loop.call_soon_threadsafe(self._async.note_allreduce, nbytes,
                                                           time.perf_counter() - started)

    def _allreduce_list(self, arrays: Sequence[Any], op: str, timeout: float | None) -> list[Any]:
        """A list of numpy arrays of one dtype that fits one bucket goes through shared memory from
        this thread, its pieces copied straight out of the arrays; any other list is bucketed on the loop."""
        shm = self._host(arrays[0]) if arrays else None
        nbytes = sum(a.nbytes for a in arrays)
        if (shm is None or op not in OPS or any(type(a) is not np.ndarray or a.dtype != arrays[0].dtype for a in arrays)
                or nbytes > self._async.bucket_bytes):
            return self._call(self._async.allreduce(list(arrays), op, timeout=timeout), timeout)
        started = time.perf_counter()
        fused = self._on_host(shm, Joined(arrays), op, call_meta("allreduce", op, list(arrays)), timeout)
        self._noted(nbytes, started)
        return unfuse(fused, arrays)

    def allgather(self, array: Any, *, timeout: float | None = None) -> Any:
        shm = self._host(array)
        if shm is not None:
            meta = call_meta("allgather", "none", [array])
            return self._on_host(shm, array.reshape(-1), "gather", meta, timeout).reshape(self.size, *array.shape)
        return self._call(self._async.allgather(array, timeout=timeout), timeout)

    def broadcast(self, array: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        shm = self._host(array)
        if shm is not None and type(root) is int and 0 <= root < self.size:
            meta = call_meta("broadcast", "none", [array], root)
            return self._on_host(shm, array.reshape(-1), "broadcast", meta, timeout, root).reshape(array.shape)
        return self._call(self._async.broadcast(array, root, timeout=timeout), timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        shm = self._host(_NOTHING)
        if shm is not None:
            self._on_host(shm, _NOTHING, "barrier", call_meta("barrier", "sum", []), timeout)
            return
        self._call(self._async.barrier(timeout=timeout), timeout)

    def leave(self, timeout: float = 5.0) -> None:
        self._call(self._async.leave(timeout), timeout)
