"""Incoming calls: a router-like listener that decodes, dispatches to services, and always answers.

Whatever a client sends, the server keeps serving: a message that cannot be decoded, names an
unknown service or op, or has bad arguments gets an error reply when its request id can be read,
and is dropped and counted when it cannot. Short handlers run inline on the loop; handlers that
return a coroutine run as tasks, cancelled at the request's deadline. The listener comes from the
transport registered for the endpoint's scheme (a ZeroMQ ROUTER for tcp, ipc and inproc), or from
the ``transport`` given.

With ``keys`` the listener is a CURVE server admitting only the keys of the allow-list; each
message arrives with its sender's authenticated ``role/name``, which becomes the call's identity
and role (:func:`.roles.authorize`) before the service admits it: a client key calling a task op,
or a header claiming another name than its key's, is refused with ``PermissionDenied``.

A batch envelope (``wire/batch.py``) is checked whole before any of its requests runs: a
malformed or over-limit one is answered, under its envelope id, with a ``PROTOCOL`` or
``RESOURCE_EXHAUSTED`` error naming what is wrong. Each request of a well-formed one is then
served exactly as if it had come alone (its own id, deadline, dedup record, in-flight count and
authorization from the connection's key), and the small replies for a peer that sends envelopes
go back the same way: those made while answering an envelope in one, later ones per loop tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from ..observe.metrics import TaskMetrics
from ..errors import DeadlineExceeded, NotFound, ResourceExhausted, ZmqflowError
from ..observe.progress import note_error
from ..transport import registry
from ..transport.base import Listener, SendFailed, Transport
from ..transport.curve import Keys
from ..transport.options import DEFAULT_OPTIONS, SocketOptions
from ..wire import REPLY, REQUEST, DecodeError, Limits, Message, decode, encode, encode_reply, error_message
from ..wire.batch import BATCH, DEFAULT_BATCH_LIMITS, BatchLimits, batch_id, decode_batch, encode_batch
from ..wire.codec import DEFAULT_LIMITS
from .coalesce import Coalescer
from .counters import Counters, frames_nbytes
from .dedup import DONE, IN_FLIGHT, MAX_KEPT_BYTES, MAX_PEER_KEPT_BYTES, Dedup
from .roles import authorize, client_ops
from .service import Answer, CallContext, Service

__all__ = ["RpcServer", "REPLY_GRACE", "MAX_DEADLINE", "MAX_IN_FLIGHT"]

log = logging.getLogger(__name__)

# How long a reply may wait for room in a slow client's pipe when the request had no deadline.
REPLY_GRACE = 5.0
# The longest a request may run (and the deadline of one that names none): waits such as
# catalog.lookup end there instead of holding memory forever.
MAX_DEADLINE = 3600.0
# Handlers one peer may have running at once (a multi-GiB push in 4 MiB slices stays well below).
MAX_IN_FLIGHT = 4096
# what most handlers return: known not to be coroutines without asking asyncio (an ABC check)
_PLAIN_RESULTS = frozenset((dict, list, tuple, int, float, str, bytes, bool, type(None), Answer))


class RpcServer:
    """Serves ``services`` on a bound listener."""

    def __init__(
        self,
        bind_endpoint: str,
        services: Mapping[str, Service],
        *,
        name: str,
        loop: asyncio.AbstractEventLoop | None = None,
        limits: Limits = DEFAULT_LIMITS,
        options: SocketOptions = DEFAULT_OPTIONS,
        counters: Counters | None = None,
        transport: Transport | None = None,
        max_deadline: float = MAX_DEADLINE,
        max_in_flight: int = MAX_IN_FLIGHT,
        debug: bool = False,
        keys: Keys | None = None,
        metrics: TaskMetrics | None = None,
        batch_limits: BatchLimits = DEFAULT_BATCH_LIMITS,
        max_kept_bytes: int = MAX_KEPT_BYTES,
        max_peer_kept_bytes: int = MAX_PEER_KEPT_BYTES,
    ):
        if not max_deadline > 0 or max_in_flight < 1:
            raise ValueError(f"max_deadline must be > 0 and max_in_flight >= 1, got {max_deadline}, {max_in_flight}")
        self.max_deadline = float(max_deadline)
        self.max_in_flight = int(max_in_flight)
        self.debug = debug
        self._in_flight: dict[bytes, int] = {}  # peer (routing id) -> handlers running
        self._waiting: dict[bytes, int] = {}  # peer -> replies waiting for room in its pipe
        self.bind_endpoint = bind_endpoint
        self.keys = keys
        self.services = dict(services)
        self.name = name
        self.limits = limits
        self.options = options
        self.counters = counters if counters is not None else Counters()
        self.metrics = metrics  # None: no per-peer or per-op recording at all
        self._loop = loop or asyncio.get_running_loop()
        # chosen now, so a server made inside ``registry.use`` keeps that transport for good
        self._transport = transport if transport is not None else registry.lookup(bind_endpoint)
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task] = set()
        self.endpoint = bind_endpoint
        # a retried or duplicated request (same peer, same id, same header) runs once; the replies
        # kept for one are capped in bytes, per peer and in all
        self.dedup = Dedup(max_bytes=max_kept_bytes, max_peer_bytes=max_peer_kept_bytes)
        self.batch_limits = batch_limits
        self._coalescer = Coalescer()
        self._batch_peers: set[bytes] = set()  # peers that sent an envelope, so they read them
        self.batches_in = 0
        self.batches_out = 0

    async def start(self) -> None:
        """Bind (AddressInUse when the address is taken, Unavailable when it cannot be bound)."""
        extra = {} if self.keys is None else {"security": self.keys.server()}
        self._listener = await self._transport.listen(
            self.bind_endpoint, self._on_request, loop=self._loop, options=self.options, name=self.name, **extra
        )
        self.endpoint = self._listener.endpoint

    # receiving --------------------------------------------------------------------------
    def _on_request(self, frames: list[Any], user: str | None = None) -> None:
        """One message; ``user`` is its sender's authenticated ``role/name`` on a CURVE listener."""
        counters = self.counters
        counters.msgs_in += 1
        nbytes = sum(map(len, frames))
        counters.bytes_in += nbytes
        identity = frames[0]
        metrics = self.metrics
        if metrics is not None:
            metrics.message_in(identity, nbytes)
        try:
            msg = decode(frames[1:], self.limits)
        except DecodeError as exc:
            if exc.kind is None and len(frames) > 1 and batch_id(frames[1]) is not None:
                self._on_batch(identity, frames[1:], user)
            else:
                self._undecodable(identity, exc)
            return
        self._serve(identity, msg, frames[1], user)

    def _undecodable(self, identity: bytes, exc: DecodeError) -> None:
        if exc.request_id is not None and exc.kind in (REQUEST, None, BATCH):
            self._reply_error(identity, exc.request_id, exc, None)
        else:
            self.counters.dropped += 1
            log.warning("%s dropped an unreadable message: %s", self.name, exc)

    def _on_batch(self, identity: bytes, frames: list[Any], user: str | None) -> None:
        """An envelope: refused whole when malformed, else each request served as if alone."""
        try:
            batch = decode_batch(frames, self.limits, self.batch_limits)
        except DecodeError as exc:
            self._undecodable(identity, exc)
            return
        self.batches_in += 1
        peers = self._batch_peers
        if identity not in peers:
            if len(peers) >= 65536:  # bounded: a forgotten peer is learned again from its next envelope
                peers.clear()
            peers.add(identity)
        coalescer = self._coalescer
        opened = coalescer.hold(identity)  # the replies made now go back together
        try:
            for entry in batch.entries:
                try:
                    msg = decode(entry, self.limits)
                except DecodeError as exc:
                    self._undecodable(identity, exc)
                    continue
                self._serve(identity, msg, entry[0], user)
        finally:
            held = coalescer.end_tick(identity) if opened else coalescer.take(identity)
            if held:
                self._send_group(identity, held)

    def _serve(self, identity: bytes, msg: Message, header: Any, user: str | None) -> None:
        """One decoded message (alone or from an envelope): a request is run or refused, anything else dropped."""
        if msg.kind != REQUEST:
            self.counters.dropped += 1
            return
        metrics = self.metrics
        now = self._loop.time()
        dedup = self.dedup
        if dedup.sweep_due(now):
            dedup.sweep(now, self.reachable)
        seen = dedup.begin(identity, msg.id, header, now)
        if seen is not None:
            self._replay(identity, msg, seen)
            return
        capped = msg.deadline is None or msg.deadline > self.max_deadline
        deadline = now + (self.max_deadline if capped else msg.deadline)
        reply_by = None if msg.deadline is None else deadline  # a reply without one waits REPLY_GRACE for room
        ctx = CallContext(msg.service, msg.op, identity, msg.source, deadline)
        in_flight = self._in_flight.get(identity, 0)
        bound = False
        try:
            if in_flight >= self.max_in_flight:
                raise ResourceExhausted(
                    f"{msg.service}.{msg.op} refused: this peer already has {in_flight} requests in flight on "
                    f"{self.name}, the limit", limit=self.max_in_flight)
            service = self.services.get(msg.service)
            if service is None:
                raise NotFound(f"task {self.name} has no service {msg.service!r} (services: {', '.join(sorted(self.services))})")
            if user is not None:
                authorize(ctx, user, client_ops(service))
            service.admit(ctx)
            call = service.find_op(msg.op).bind(msg.service, msg.op, ctx, msg.body)
            bound = True
            result = call()
        except Exception as exc:
            self._reply_error(identity, msg.id, exc, reply_by)
            if bound and metrics is not None:
                metrics.request(msg.service, msg.op, self._loop.time() - now)
            return
        if result.__class__ not in _PLAIN_RESULTS and asyncio.iscoroutine(result):
            task = self._loop.create_task(self._run_async(identity, msg.id, result, ctx, capped, reply_by, now))
            self._tasks.add(task)
            self._in_flight[identity] = in_flight + 1
            task.add_done_callback(lambda t: self._done(t, identity, result))
        else:
            self._reply(identity, msg.id, result, reply_by)
            if metrics is not None:
                metrics.request(msg.service, msg.op, self._loop.time() - now)

    def _done(self, task: asyncio.Task, identity: bytes, coro: Any) -> None:
        # a no-op once it ran; a handler whose task was cancelled before it started (the server
        # stopping) is closed here, not left for the collector to warn that it was never awaited
        coro.close()
        self._tasks.discard(task)
        _count_down(self._in_flight, identity)

    async def _run_async(self, identity: bytes, rid: int, coro: Any, ctx: CallContext, capped: bool,
                         reply_by: float | None, started: float) -> None:
        try:
            await self._run_body(identity, rid, coro, ctx, capped, reply_by)
        finally:
            if self.metrics is not None:
                self.metrics.request(ctx.service, ctx.op, self._loop.time() - started)

    async def _run_body(self, identity: bytes, rid: int, coro: Any, ctx: CallContext, capped: bool,
                        reply_by: float | None) -> None:
        try:
            if ctx.deadline is None:
                result = await coro
            else:
                timer = asyncio.timeout_at(ctx.deadline)
                try:
                    async with timer:
                        result = await coro
                except TimeoutError:
                    if not timer.expired():  # the handler's own error (ClusterNotReady is a TimeoutError)
                        raise
                    why = f" (the server's limit of {self.max_deadline:g}s)" if capped else ""
                    raise DeadlineExceeded(f"{ctx.service}.{ctx.op} on {self.name} ran past its deadline{why}", task=self.name) from None
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._reply_error(identity, rid, exc, reply_by)
            return
        self._reply(identity, rid, result, reply_by)

    def _replay(self, identity: bytes, msg: Message, seen: object) -> None:
        """Answer a duplicate from the record: nothing while its handler runs, else the kept reply."""
        if seen is IN_FLIGHT:
            return
        reply_by = None if msg.deadline is None else self._loop.time() + min(msg.deadline, self.max_deadline)
        if seen is DONE:
            exc = ResourceExhausted(
                f"{msg.service}.{msg.op} request {msg.id} already ran on {self.name}; its reply was not kept for a "
                "retry (too large, or over the bytes of replies kept), so this duplicate is not answered with it")
            error = error_message(msg.id, exc, source=self.name)
            self._reply(identity, msg.id, None, reply_by, error=error, record=False)
        else:
            self._send([identity, *seen], msg.id, reply_by)  # type: ignore[misc]

    # replying ---------------------------------------------------------------------------
    def _reply_error(self, identity: bytes, rid: int, exc: BaseException, deadline: float | None) -> None:
        self.counters.errors += 1
        if not isinstance(exc, ZmqflowError):  # a bug, not a refusal: its traceback stays here unless debugging
            log.warning("%s: request %d failed: %s: %s", self.name, rid, type(exc).__name__, exc, exc_info=exc)
            note_error(f"{self.name}: a request failed: {type(exc).__name__}: {exc}")
        error = error_message(rid, exc, source=self.name, with_traceback=self.debug)
        self._reply(identity, rid, None, deadline, error=error)

    def _reply(self, identity: bytes, rid: int, result: Any, deadline: float | None, *, error: Message | None = None,
               record: bool = True) -> None:
        """Answer request ``rid`` with ``result``, or with ``error`` (an error message) when given."""
        if self._listener is None:
            return
        if result.__class__ is Answer:
            self._reply_answer(identity, rid, result, deadline)
            return
        try:  # a listener closed meanwhile sends nothing (_send_now looks)
            frames = [identity, *(encode_reply(rid, result) if error is None else encode(error))]
        except Exception as exc:  # a result that cannot be encoded is the handler's error
            self.counters.errors += 1
            frames = [identity, *encode(error_message(rid, exc, source=self.name, with_traceback=self.debug))]
        nbytes = frames_nbytes(frames)  # once: for the record and the counters
        self._send(frames, rid, deadline, nbytes)
        if record:  # after the send, off the reply's path: nothing runs between them to change its bytes
            self.dedup.finish(identity, rid, frames[1:], nbytes - len(identity))

    def _reply_answer(self, identity: bytes, rid: int, answer: Answer, deadline: float | None) -> None:
        """Answer with ``answer.value``, and keep ``answer.retry`` for a duplicate where the value
        is more than the record keeps (apart from ``_reply``: every other reply skips the check)."""
        try:
            frames = [identity, *encode_reply(rid, answer.value)]
        except Exception:  # the handler's error, answered and kept as ``_reply`` does
            self._reply(identity, rid, answer.value, deadline)
            return
        nbytes = frames_nbytes(frames)
        self._send(frames, rid, deadline, nbytes)
        nbytes -= len(identity)
        if answer.retry is not None and nbytes > self.dedup.max_kept_reply:
            try:
                frames = [identity, *encode_reply(rid, answer.retry)]
                nbytes = frames_nbytes(frames) - len(identity)
            except Exception:  # unencodable too: the duplicate is told the call ran, as for any big reply
                pass
        self.dedup.finish(identity, rid, frames[1:], nbytes)

    def _send(self, frames: list[Any], rid: int, deadline: float | None, nbytes: int | None = None) -> None:
        identity = frames[0]
        if identity in self._batch_peers:
            coalescer = self._coalescer
            if nbytes is None:
                nbytes = frames_nbytes(frames)
            if coalescer.small(nbytes):
                now, schedule = coalescer.add(identity, (frames, rid, deadline, nbytes), nbytes + 8 * len(frames))
                if schedule:  # alone in its tick: out now, the tick ends on the next one
                    self._loop.call_soon(self._end_tick, identity)
                    self._send_now(frames, rid, deadline, nbytes)
                elif now is not None:
                    self._send_group(identity, now)
                return
            held = coalescer.take(identity)
            if held:  # replies made before go first; a large one never waits for the tick
                self._send_group(identity, held)
        self._send_now(frames, rid, deadline, nbytes)

    def _end_tick(self, identity: bytes) -> None:
        held = self._coalescer.end_tick(identity)
        if held:
            self._send_group(identity, held)

    def _send_group(self, identity: bytes, items: list[tuple[list[Any], int, float | None, int]]) -> None:
        """Held replies for one peer: one goes alone, several in one envelope (id 0: no call has it)."""
        if len(items) == 1:
            self._send_now(*items[0])
            return
        frames = [identity, *encode_batch(0, [item[0][1:] for item in items])]
        deadlines = [item[2] for item in items]
        self.batches_out += 1
        self._send_now(frames, 0, None if None in deadlines else max(deadlines))  # type: ignore[type-var]

    def _send_now(self, frames: list[Any], rid: int, deadline: float | None, nbytes: int | None = None) -> None:
        listener = self._listener
        if listener is None or listener.closed:
            return
        try:
            sent = listener.try_send(frames)
        except SendFailed as exc:  # the requester is gone (ZeroMQ: EHOSTUNREACH under ROUTER_MANDATORY)
            self.counters.undeliverable += 1
            log.debug("%s: reply %d undeliverable: %s", self.name, rid, exc)
            return
        if sent:
            self._count_out(frames, nbytes)
            return
        identity = frames[0]
        waiting = self._waiting.get(identity, 0)
        if waiting >= self.max_in_flight:  # a peer that reads no replies: what waits for it is capped
            self.counters.undeliverable += 1
            log.debug("%s: reply %d dropped: %d replies already wait for room", self.name, rid, waiting)
            return
        self._waiting[identity] = waiting + 1
        until = deadline if deadline is not None else self._loop.time() + REPLY_GRACE
        task = self._loop.create_task(self._reply_later(frames, until))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._replied(t, identity))

    def _replied(self, task: asyncio.Task, identity: bytes) -> None:
        self._tasks.discard(task)
        _count_down(self._waiting, identity)

    @property
    def replies_waiting(self) -> int:
        """Replies waiting for room in their peers' pipes (each peer's capped at ``max_in_flight``)."""
        return sum(self._waiting.values())

    async def _reply_later(self, frames: list[Any], until: float) -> None:
        try:
            sent = await self._listener.send(frames, until) if self._listener else False
        except SendFailed:
            sent = False
        if sent:
            self._count_out(frames)
        else:
            self.counters.undeliverable += 1

    def reachable(self, identity: bytes) -> bool:
        """Whether the client with this routing id is still connected. ROUTER_MANDATORY refuses a
        message to a peer that is gone; the probe (a reply to request 0) is ignored by clients."""
        if self._listener is None or self._listener.closed:
            return False
        try:
            self._listener.try_send([identity, *encode(Message(REPLY, 0, body=None))])
        except SendFailed:
            return False
        return True

    def _count_out(self, frames: list[Any], nbytes: int | None = None) -> None:
        if nbytes is None:
            nbytes = frames_nbytes(frames)
        self.counters.msgs_out += 1
        self.counters.bytes_out += nbytes
        if self.metrics is not None:
            self.metrics.message_out(frames[0], nbytes)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()


def _count_down(counts: dict[bytes, int], identity: bytes) -> None:
    """One less for ``identity`` in a per-peer count; a peer at zero is not kept."""
    left = counts.get(identity, 1) - 1
    if left > 0:
        counts[identity] = left
    else:
        counts.pop(identity, None)
