"""Peer ring collectives over the tasks' own servers: allreduce, allgather, broadcast, barrier.

``AsyncRing(server)`` (or the blocking ``Ring`` of :mod:`.ring_blocking`) joins the ring of the
cluster's ``chief`` and ``worker`` tasks (or ``members``) through this task's in-process server: chunks go to the right neighbour's ``ring`` service and
arrive from the left one's. Tensors are fused into buckets (~25 MB); each bucket is one ring call
whose chunks (4 MB) are pipelined: chunk k is reduced while chunk k+1 is on the wire. A bucket of
at most ``small_bytes`` (1 MiB) is latency-bound instead: every rank sends all of it to every
other rank in one step and folds the ``n`` buffers locally in rank order (the same bits on every
rank, as the ring's allgather gives). A single-array bucket is reduced from the caller's array
into a new one, without copying it into the buffer first; numpy inputs are never written. cupy
arrays are reduced on their GPU around the ring; on one host, or when small, they are copied to
pinned host memory once and take the host's path (shared memory, or the one-step exchange). Every
chunk carries the call's sequence number, op, dtype and shapes; a rank that sees a mismatch
aborts the call on every rank with ``CollectiveMismatch`` naming both sides. A member that dies
makes the others raise ``Unavailable`` naming it within seconds; a silent one ``DeadlineExceeded``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cluster import ClusterSpec, TaskId
from ..state.reduce import (OPS, Joined, array_module, as_array, backend_for, finish_mean, is_cupy, mean_dtype,
                            reduce_in_order, to_device, to_host, unfuse, write_back)
from ..state.ring_schedule import RS, Step, allgather as allgather_steps, chunk_range, chunks, scatter_reduce, segments
from ..errors import ConfigError, InvalidArgument, ZmqflowError
from ..server.task import AsyncServer
from ..rpc.health import wait_for_tasks
from ..wire.requests import cluster as crq
from . import ring_shm
from .ring_failures import RingFailures
from .ring_meta import call_meta
from .ring_probe import CallProbe, RingWatch

__all__ = ["AsyncRing", "default_members", "DEFAULT_BUCKET_BYTES", "DEFAULT_CHUNK_BYTES", "DEFAULT_SMALL_BYTES"]

DEFAULT_BUCKET_BYTES = 25 << 20
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_SMALL_BYTES = 1 << 20  # buckets up to this size take one all-to-all exchange, not 2(n-1) ring steps
_NOTHING = np.zeros(0, np.int8)  # what a barrier carries


def default_members(spec: ClusterSpec) -> list[TaskId]:
    """The chief (if any), then every worker, by index."""
    return [t for t in spec.tasks if t.job == "chief"] + [TaskId("worker", i) for i in spec.task_indices("worker")]


class AsyncRing:
    """The asyncio-native ring; every collective is a coroutine. All ranks must make the same
    calls in the same order."""

    def __init__(self, server: AsyncServer, members: Sequence["TaskId | str"] | None = None, *, name: str = "default",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 small_bytes: int = DEFAULT_SMALL_BYTES, timeout: float | None = None, shm: bool = True):
        self.server = server
        self._shm: Any = None if shm else False  # None: not agreed yet; False: TCP; else the same-host channel
        self._agreeing: "asyncio.Future | None" = None
        self.members = [TaskId.parse(m) for m in members] if members is not None else default_members(server.spec)
        if server.task not in self.members:
            raise ConfigError(f"task {server.task} is not a member of the ring ({', '.join(map(str, self.members))})")
        if len(set(self.members)) != len(self.members):
            raise ConfigError(f"ring members repeat: {', '.join(map(str, self.members))}")
        for m in self.members:
            server.spec.address(m)  # unknown tasks fail here
        self.name = name
        self.rank = self.members.index(server.task)
        self.size = len(self.members)
        self.bucket_bytes = int(bucket_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self.small_bytes = int(small_bytes)  # must be the same on every rank (it picks the algorithm)
        self.timeout = server.default_timeout if timeout is None else float(timeout)
        self.seq = 0
        self.completed = -1  # the last call this rank completed
        self._endpoints = [server.spec.address(m).endpoint for m in self.members]
        self._connected = False
        self.failures = RingFailures(name, self.rank, self.members, self._endpoints, server)
        self._seen = RingWatch(name, str(server.task))  # timeline spans, stragglers
        # with keys: chunks only from their rank's task; the timeout bounds how long a deposit may wait
        self.service.register(name, [str(m) for m in self.members], self.timeout)

    @property
    def shm_channel(self) -> "ring_shm.ShmChannel | None":
        """The shared-memory path, once every rank agreed on it (``client/ring_shm.py``), for the
        next call: None once it broke on an earlier call, here or on any peer, so that every rank
        takes TCP from the same call on."""
        return self._shm if self._shm and self._shm.usable(self.seq) else None

    async def _same_host(self, deadline: float, cupy: bool = False) -> "ring_shm.ShmChannel | None":
        """The shared-memory channel for a host call (agreed with every rank on the first), or None."""
        if self.size == 1 or cupy:
            return None
        if self._agreeing is not None:  # a call started meanwhile waits for the same agreement
            await asyncio.shield(self._agreeing)
        elif self._shm is None:  # agreed inline, so this call's allgathers take their numbers now
            self._agreeing = asyncio.get_running_loop().create_future()
            try:
                self._shm = await ring_shm.negotiate(self, True, deadline - asyncio.get_running_loop().time()) or False
            finally:
                self._agreeing.set_result(None)
                self._agreeing = None
        return self.shm_channel

    async def _on_host(self, shm: "ring_shm.ShmChannel", flat: Any, op: str, meta: list[Any], deadline: float,
                       root: int = 0, in_place: bool = False) -> Any:
        seq, self.seq = self.seq, self.seq + 1
        left = deadline - asyncio.get_running_loop().time()
        try:
            out = await asyncio.wrap_future(shm.submit(flat, op, seq, meta, left, self._seen, root, in_place))
        except ring_shm.ChannelClosed:  # queued before the channel broke: over TCP, as on every rank
            return await self._tcp(flat, op, meta, deadline, seq, root)
        self.completed = max(self.completed, seq)
        return out

    def run_on_host(self, shm: "ring_shm.ShmChannel", flat: Any, op: str, meta: list[Any], timeout: float | None,
                    root: int = 0, in_place: bool = False) -> Any:
        """A collective on the shared-memory path, run on the caller's thread (the blocking ring's
        fast path); it takes its sequence number here, so nothing may be in flight on the loop.
        ``ChannelClosed``: the caller runs the call over TCP (:meth:`over_tcp`) with its number."""
        seq, self.seq = self.seq, self.seq + 1
        out = shm.run(flat, op, seq, meta, self.timeout if timeout is None else float(timeout), self._seen, root, in_place)
        self.completed = max(self.completed, seq)
        return out

    async def over_tcp(self, flat: Any, op: str, meta: list[Any], seq: int, timeout: float | None,
                       root: int = 0) -> Any:
        """Call ``seq`` of the blocking fast path over TCP, after the channel turned it away."""
        return await self._tcp(flat, op, meta, self._deadline(timeout), seq, root)

    async def _tcp(self, flat: Any, op: str, meta: list[Any], deadline: float, seq: int | None = None,
                   root: int = 0) -> Any:
        """A call of the shared-memory path's form (flat input, its ``op``) over TCP, as a rank that
        chose TCP for it runs it: the result the channel would give (a gather as rows)."""
        xp = array_module(flat)
        if op == "gather":
            buf = xp.zeros((self.size, flat.size), dtype=flat.dtype)
            buf[self.rank] = flat
            steps = scatter_reduce(self.rank, self.size)  # send own segment first, then pass the rest on
            await self._run(buf.reshape(-1), steps, "none", meta, deadline, equal=True, seq=seq)
            return buf
        if op == "broadcast":
            buf, dist = flat.copy(), (self.rank - root) % self.size
            await self._run(buf, [Step("bc", 0, 0, 0)], "none", meta, deadline, receive=dist > 0,
                            send=dist < self.size - 1, whole=True, seq=seq)
            return buf
        if op == "barrier":
            await self._allreduce_buffer(np.zeros(self.size, np.int32), "sum", meta, deadline, seq=seq)
            return flat
        flat = np.concatenate(flat.parts) if isinstance(flat, Joined) else flat
        if flat.nbytes <= self.small_bytes:
            return await self._exchange(flat, op, meta, deadline, seq)
        out = np.empty_like(flat)
        await self._allreduce_buffer(out, op, meta, deadline, src=flat, seq=seq)
        return out

    @property
    def service(self) -> Any:
        return self.server.service("ring")

    async def connect(self, timeout: float | None = None) -> None:
        """Wait until every member answers; keeps a connection to each, to notice one that dies."""
        with self._seen.span("ring", "negotiate"):
            await wait_for_tasks(self.server.client, self.server.spec, self.timeout if timeout is None else timeout, self.members)
        self._connected = True

    # collectives ------------------------------------------------------------------------
    async def allreduce(self, arrays: Any, op: str = "sum", *, timeout: float | None = None) -> Any:
        """Reduce one array or a list across the ring; returns the same structure."""
        if op not in OPS:
            raise InvalidArgument(f"op must be one of {', '.join(OPS)}, got {op!r}")
        single = not isinstance(arrays, (list, tuple))
        items = [as_array(a) for a in ([arrays] if single else list(arrays))]
        deadline = self._deadline(timeout)
        started = time.perf_counter()
        results: list[Any] = [None] * len(items)
        for bucket in self._buckets([a for a, _ in items]):
            arrays_in = [items[i][0] for i in bucket]
            fused = await self._reduce_bucket(arrays_in, op, call_meta("allreduce", op, arrays_in), deadline)
            for i, part in zip(bucket, unfuse(fused, arrays_in)):
                results[i] = write_back(items[i][1], part)
        self.note_allreduce(sum(a.nbytes for a, _ in items), time.perf_counter() - started)
        return results[0] if single else results

    def note_allreduce(self, nbytes: int, seconds: float) -> None:
        """Count a finished allreduce in the task's metrics (bytes, time, bus bandwidth); on the
        loop thread, which owns them (the blocking ring's fast path hands its count over)."""
        metrics = self.server.metrics
        if metrics is not None and self.size > 1:
            metrics.ring_allreduce(nbytes, seconds, self.size)

    async def _reduce_bucket(self, arrays_in: list[Any], op: str, meta: list[Any], deadline: float) -> Any:
        """One bucket's reduced values, flat: through shared memory on one host, in one exchange
        when small, else around the ring (cupy arrays on their GPU). On the first two paths cupy
        arrays go down once into pinned memory, are reduced there in place, and go up once."""
        shm = await self._same_host(deadline)
        host = not is_cupy(arrays_in[0])
        if shm is not None or (1 < self.size and sum(a.nbytes for a in arrays_in) <= self.small_bytes):
            if not host:
                flat = to_host(arrays_in)
            elif len(arrays_in) == 1:
                flat = arrays_in[0].reshape(-1)
            else:  # through shared memory each piece is copied out of the arrays: no fusing pass first
                flat = Joined(arrays_in) if shm is not None else np.concatenate([a.reshape(-1) for a in arrays_in])
            if shm is not None:
                out = await self._on_host(shm, flat, op, meta, deadline, in_place=not host)
            else:
                out = await self._exchange(flat, op, meta, deadline)  # never writes into ``flat``
            return out if host else to_device(out)
        if len(arrays_in) == 1 and host and self.size > 1:
            src = arrays_in[0].reshape(-1)  # only read: the result goes to a new buffer, no copy first
            fused = np.empty_like(src)
            await self._allreduce_buffer(fused, op, meta, deadline, src=src)
            return fused
        xp = array_module(arrays_in[0])
        fused = xp.concatenate([a.reshape(-1) for a in arrays_in]) if arrays_in else xp.zeros(0)
        await self._allreduce_buffer(fused, op, meta, deadline)
        return fused

    async def allgather(self, array: Any, *, timeout: float | None = None, shm: bool = True) -> Any:
        """Every rank's ``array`` (same shape and dtype everywhere), stacked: shape ``(size, *shape)``.
        ``shm=False``: over TCP even on one host (how the ranks agree on the shared-memory path)."""
        a, _ = as_array(array)
        meta, deadline = call_meta("allgather", "none", [a]), self._deadline(timeout)
        same = await self._same_host(deadline, is_cupy(a)) if shm else None
        if same is not None:
            return (await self._on_host(same, a.reshape(-1), "gather", meta, deadline)).reshape(self.size, *a.shape)
        return (await self._tcp(a.reshape(-1), "gather", meta, deadline)).reshape(self.size, *a.shape)

    async def broadcast(self, array: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """``root``'s array on every rank (others pass an array of the same shape and dtype)."""
        if not 0 <= root < self.size:
            raise InvalidArgument(f"root must be a rank in [0, {self.size}), got {root}")
        a, original = as_array(array)
        meta, deadline = call_meta("broadcast", "none", [a], root), self._deadline(timeout)
        same = await self._same_host(deadline, is_cupy(a))
        if same is not None:
            return write_back(original, (await self._on_host(same, a.reshape(-1), "broadcast", meta, deadline, root)).reshape(a.shape))
        out = await self._tcp(a.reshape(-1), "broadcast", meta, deadline, root=root)
        return write_back(original, out.reshape(a.shape))

    async def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has reached its barrier."""
        meta, deadline = call_meta("barrier", "sum", []), self._deadline(timeout)
        same = await self._same_host(deadline)
        await (self._on_host(same, _NOTHING, "barrier", meta, deadline) if same is not None
               else self._tcp(_NOTHING, "barrier", meta, deadline))

    def peer_down(self, rank: int) -> bool:
        """Whether the transport has given up on ``rank`` (its connection dropped or its
        heartbeats stopped): how the shared-memory path names a frozen peer, as TCP does."""
        return self.server.client.peer_state(self._endpoints[rank]) == "down"

    def release(self) -> None:
        """Drop the same-host channel (a retired generation of an elastic ring): its segments'
        mappings, its wake-up sockets and its thread. Later calls of this ring go over TCP."""
        if self._shm:
            self._shm.close()
        self._shm = False

    async def leave(self, timeout: float = 5.0) -> None:
        """Tell every live member this rank is done (after its last call), and wait for them to
        hear it: a rank that completed the last call and exits is then not taken for a death by a
        member still finishing that call (whose last acknowledgement from here may never arrive)."""
        if self.size == 1:
            return
        self.release()
        client = self.server.client
        body = crq.Leave(ring=self.name, src=self.rank, seq=self.completed)
        calls = [client.start_call(ep, "ring", "leave", body, timeout=timeout, name=str(self.members[i]))
                 for i, ep in enumerate(self._endpoints) if i != self.rank and client.peer_state(ep) != "down"]
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)

    # machinery --------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (self.timeout if timeout is None else float(timeout))

    def _buckets(self, arrays: list[Any]) -> list[list[int]]:
        """Indices fused per bucket: same dtype and device, about ``bucket_bytes`` each, in order."""
        out: list[list[int]] = []
        key = None
        size = 0
        for i, a in enumerate(arrays):
            k = (str(a.dtype), is_cupy(a))
            if not out or k != key or size + a.nbytes > self.bucket_bytes:
                out.append([])
                key, size = k, 0
            out[-1].append(i)
            size += a.nbytes
        return out

    async def _allreduce_buffer(self, buf: Any, op: str, meta: list[Any], deadline: float, src: Any = None,
                                seq: int | None = None) -> None:
        """``buf``: the reduction of ``src`` (or of ``buf`` itself) across the ring. A half-precision
        mean goes around in float32 (``reduce.mean_dtype``: its sum may not fit), then is rounded once."""
        steps = scatter_reduce(self.rank, self.size) + allgather_steps(self.rank, self.size)
        wide = mean_dtype(buf.dtype) if op == "mean" and self.size > 1 else None
        work = buf if wide is None else (buf if src is None else src).astype(wide)
        await self._run(work, steps, op, meta, deadline, src=None if wide is not None else src, seq=seq)
        if op == "mean" and self.size > 1:
            with self._seen.span("ring reduce", "mean"):
                finish_mean(work, self.size)
            if wide is not None:
                buf[...] = work

    async def _run(self, buf: Any, steps: list[Step], op: str, meta: list[Any], deadline: float, *,
                   receive: bool = True, send: bool = True, whole: bool = False, equal: bool = False,
                   src: Any = None, seq: int | None = None) -> None:
        """One call around the ring; ``seq``: a number it already took (else it takes the next)."""
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        if self.size == 1:
            return
        if not self._connected:
            await self.connect(max(0.05, deadline - asyncio.get_running_loop().time()))
        n = self.size
        chunk = max(1, self.chunk_bytes // max(1, buf.dtype.itemsize))
        segs = [(0, len(buf))] if whole else segments(len(buf), n)
        count = chunks(len(buf), 1 if whole else n, chunk)
        backend = backend_for(buf, src)
        sends: list[asyncio.Future] = []
        service = self.service
        probe, first, left = self._seen.call(), steps[0], str(self.members[(self.rank - 1) % n])

        async def receive_chunk(step: Step, k: int) -> None:
            with self._seen.span("ring wait", "wait"):
                src, their_meta, data = await service.take((self.name, seq, step.phase, step.index, k))
            if step is first and k == 0 and not whole:  # a relay (broadcast) waits by design
                probe.arrived(left)  # sent as soon as the left started this call
            a, b = chunk_range(segs[step.recv], k, chunk)
            self.failures.check(seq, src, meta, their_meta, data, b - a, buf.dtype)
            with self._seen.span("ring reduce", "reduce" if step.phase == RS and op != "none" else "place"):
                if step.phase == RS and op != "none":
                    backend.fold(a, b, data, op)
                else:
                    backend.place(a, b, data)

        def send_chunk(step: Step, k: int) -> None:
            a, b = chunk_range(segs[step.send], k, chunk)
            own = step.phase == RS and step.index == 0  # this rank's own segment: still only in ``src``
            sends.append(self._send(seq, step, k, backend.outgoing(a, b, own), meta, deadline))

        async def chain(k: int) -> None:
            for step in steps:
                if whole:  # a relay: what arrives from the left goes on to the right
                    if receive:
                        await receive_chunk(step, k)
                    if send:
                        send_chunk(step, k)
                    continue
                send_chunk(step, k)  # send first: every rank sends before it waits, so no one deadlocks
                await receive_chunk(step, k)

        async def body() -> None:
            await asyncio.gather(*(chain(k) for k in range(count)))
            if sends:  # every chunk acknowledged: the right holds it, our buffer is ours again
                await asyncio.gather(*sends)
            backend.synchronize()

        await self._guarded(seq, meta, deadline, sends, body(), probe)

    async def _exchange(self, flat: np.ndarray, op: str, meta: list[Any], deadline: float,
                        seq: int | None = None) -> np.ndarray:
        """Allreduce a small host buffer in one step: every rank deposits all of it at every other
        rank, then reduces the ``n`` buffers locally in rank order, so every rank computes the very
        same bits (as the ring's allgather guarantees) with one message latency instead of
        ``2(n - 1)``. Returns a new array; ``flat`` is only read."""
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        if not self._connected:
            await self.connect(max(0.05, deadline - asyncio.get_running_loop().time()))
        n, rank, service = self.size, self.rank, self.service
        sends: list[asyncio.Future] = []
        parts: list[Any] = [None] * n
        parts[rank] = flat
        probe = self._seen.call()

        async def receive(src: int) -> None:
            # the left neighbour's buffer takes the key of the ring's first chunk, so a rank that
            # runs the ring against this one (a different size) meets a mismatch, not a deadlock
            with self._seen.span("ring wait", "wait"):
                got_src, their_meta, data = await service.take((self.name, seq, RS, (rank - src) % n - 1, 0))
            probe.arrived(str(self.members[src]))
            self.failures.check(seq, got_src, meta, their_meta, data, len(flat), flat.dtype)
            parts[src] = data

        async def body() -> None:
            for dst in range(n):
                if dst != rank:
                    sends.append(self._send(seq, Step(RS, (dst - rank) % n - 1, 0, 0), 0, flat, meta, deadline, dst))
            await asyncio.gather(*(receive(src) for src in range(n) if src != rank))
            await asyncio.gather(*sends)  # acknowledged: nobody holds ``flat`` for a resend any more

        await self._guarded(seq, meta, deadline, sends, body(), probe)
        with self._seen.span("ring reduce", "reduce"):
            return reduce_in_order(parts, op)

    async def _guarded(self, seq: int, meta: list[Any], deadline: float, sends: list[asyncio.Future], body: Any,
                       probe: CallProbe) -> None:
        """Run one call's ``body`` under its watcher; on failure cancel its sends and let the other
        members hear why before the caller moves on."""
        service = self.service
        watcher = asyncio.ensure_future(self.failures.watch(seq, meta, deadline))
        try:
            with self._seen.span("ring", meta[0]):
                await body
            self.completed = max(self.completed, seq)
            probe.done()
        except ZmqflowError:
            for fut in sends:
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()
            if self.failures.aborts:  # let the other members hear why before this rank's caller moves on (or exits)
                await asyncio.wait(self.failures.aborts, timeout=1.0)
                self.failures.aborts.clear()
            raise
        finally:
            watcher.cancel()
            service.forget(self.name, seq)

    def _send(self, seq: int, step: Step, k: int, data: Any, meta: list[Any], deadline: float,
              right: int | None = None) -> asyncio.Future:
        right = (self.rank + 1) % self.size if right is None else right
        remaining = max(0.05, deadline - asyncio.get_running_loop().time())
        call = self.server.client.start_call(
            self._endpoints[right], "ring", "deposit",
            crq.Deposit(ring=self.name, seq=seq, phase=step.phase, step=step.index, chunk=k, src=self.rank,
                        meta=meta, data=data),
            timeout=remaining, name=str(self.members[right]),
        )
        fut = asyncio.ensure_future(self.failures.delivered(call, right, seq))
        fut.add_done_callback(lambda f: self.failures.sent(f, seq))
        self._seen.track_send(fut, seq, str(self.members[right]))
        return fut
