"""Outgoing calls: one DEALER per peer, many requests in flight, replies matched by id.

Every call has a deadline. A peer that does not answer in time raises ``DeadlineExceeded``; a
peer that could not be reached, or whose connection dropped while calls were in flight (as the
transport reports it: for ZeroMQ a socket monitor, which ZMTP heartbeats keep honest), raises
``Unavailable``. Both name the peer and the op. Connections come from the transport registered
for the endpoint's scheme, or from the ``transport`` given.

With ``keys`` every connection is a CURVE client presenting this process's key and expecting the
peer task's public key, and the client names itself by its key (the server checks the claim). A
peer that refuses the key (or wants keys this client lacks, or has none while this client has)
makes its calls fail at once with ``Unauthenticated``: nothing was sent, so nothing was read or
changed.

With ``retry_interval`` a call unanswered after that long is sent again with the same request id
and frames, until its deadline: a lost request or reply costs an interval, not the call. Servers
keep a record of recent ids per peer and answer a duplicate with the first reply instead of running
it again; a late or second reply is ignored (counted in ``late_replies``), and so is a reply from
any peer but the one its call went to (:mod:`.replies`). A call its caller cancels is never sent
again: its retries stop, and a send still waiting for the connection or held for the tick is
dropped.

Small requests made in one loop tick for one peer go out together in one batch envelope
(``wire/batch.py``, chosen by :mod:`.coalesce`): the first goes out at once, alone, and the
others follow as one message on the next tick. A peer that answers an envelope with an error (a
server that predates envelopes, or one with tighter limits: nothing in it ran) gets the envelope's
requests again one by one, and no more envelopes. ``coalesce=False`` sends every request alone;
the fault injector's rules read each message's op, so over it requests always go alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import secrets
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, DeadlineExceeded, Unavailable, ZmqflowError
from ..transport import registry
from ..transport.base import AUTH_FAILED, CONNECTING, DOWN, UP, SendFailed, Transport
from ..transport.curve import Keys
from ..transport.options import DEFAULT_OPTIONS, SocketOptions
from ..wire import Limits, encode_request
from ..wire.batch import encode_batch
from ..wire.codec import DEFAULT_LIMITS
from .calls import Peer, Pending, unauthenticated, unreachable
from .coalesce import Coalescer
from .counters import Counters, frames_nbytes
from .deadlines import Deadlines
from .replies import Replies
from .streams import Streams, configured_streams

__all__ = ["RpcClient", "Peer", "DEFAULT_TIMEOUT"]  # Peer: re-exported from .calls

DEFAULT_TIMEOUT = 30.0
# After a connection drops, calls wait this long for the reconnect before failing fast
# (twice the longest reconnect interval, so one reconnect attempt always fits).
RECONNECT_GRACE = 2.0  # a call to a peer down for less than this waits for it to come back (a quick restart)


class RpcClient(Replies):
    """Calls services on other tasks. Lives on one event loop; not thread-safe."""

    def __init__(
        self,
        *,
        identity: str,
        source: str = "",
        loop: asyncio.AbstractEventLoop | None = None,
        limits: Limits = DEFAULT_LIMITS,
        options: SocketOptions = DEFAULT_OPTIONS,
        default_timeout: float = DEFAULT_TIMEOUT,
        counters: Counters | None = None,
        transport: Transport | None = None,
        keys: Keys | None = None,
        retry_interval: float | None = None,
        coalesce: bool = True,
        streams: int | None = None,
    ):
        if retry_interval is not None and not retry_interval > 0:
            raise ValueError(f"retry_interval must be positive or None, got {retry_interval!r}")
        # a call unanswered this long is sent again, same id and frames: servers run it once
        self.retry_interval = retry_interval
        self.retries = 0  # requests sent again
        self.identity = identity.encode()
        self.keys = keys
        # with a key that names this process, the server takes that name and refuses any other
        self.source = keys.name if keys is not None and keys.pinned else source
        self.limits = limits
        if options.max_msg_parts < limits.max_frames + 1:  # a reply the codec takes is never cut
            options = dataclasses.replace(options, max_msg_parts=limits.max_frames + 1)
        self.options = options
        self.default_timeout = float(default_timeout)  # a float, as the compiled encoder takes a deadline
        self.counters = counters if counters is not None else Counters()
        self._loop = loop or asyncio.get_running_loop()
        # chosen now, so a client made inside ``registry.use`` keeps that transport for good
        self._transport = transport if transport is not None else registry.current_override()
        self._peers: dict[str, Peer] = {}
        self._pending: dict[int, Pending] = {}
        # one loop timer for every call's deadline, armed for the earliest (per-call timers cost more)
        self._deadlines = Deadlines()
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at = 0.0
        # from a random point of 2**62: a restarted task reuses its routing identity, and a request it
        # sends anew under an id its last incarnation used (same op, same body) would get that one's kept reply
        self._ids = itertools.count(secrets.randbits(62) + 1)
        self._closed = False
        self._senders: dict[int, asyncio.Task] = {}  # sends waiting for a connection, by request id
        self.coalesce = coalesce
        self._coalescer = Coalescer()
        # connections per peer for large requests (rpc/streams.py); ZMQFLOW_STREAMS when not given
        self._streams = Streams(configured_streams() if streams is None else streams)
        # envelopes sent whose peer has answered nothing of them yet: (peer, [(request id, frames)])
        self._batches: dict[int, tuple[Peer, list[tuple[int, list[Any]]]]] = {}
        self.batches_out = 0  # envelopes sent

    # connections ------------------------------------------------------------------------
    def peer(self, endpoint: str, name: str | None = None, stream: int = 0) -> Peer:
        """The pooled connection to ``endpoint`` (its ``stream``-th: see :mod:`.streams`), opened on first use."""
        key = Streams.key(endpoint, stream)
        found = self._peers.get(key)
        if found is not None:
            return found
        if self._closed:
            raise Unavailable(f"client {self.identity.decode()} is closed")
        peer = Peer(endpoint, name or endpoint)
        transport = self._transport if self._transport is not None else registry.lookup(endpoint)
        extra = {} if self.keys is None else {"security": self.keys.client(endpoint, name)}
        try:
            peer.conn = transport.connect(
                endpoint,
                Streams.identity(self.identity, stream),
                functools.partial(self._on_reply, peer),
                functools.partial(self._on_state, peer),
                loop=self._loop,
                options=self.options,
                name=peer.name,
                **extra,
            )
        except TypeError:
            if not extra:
                raise
            raise ConfigError(f"the transport for {endpoint} ({type(transport).__name__}) does not carry keys") from None
        # a transport that says ``envelopes = False`` (the fault injector) gets every request alone
        peer.batching = self.coalesce and getattr(transport, "envelopes", True)
        self._peers[key] = peer
        return peer

    def _on_state(self, peer: Peer, state: str) -> None:
        if state == UP:
            peer.state = UP
            peer.up.set()
        elif state == DOWN and peer.state != DOWN:
            peer.state = DOWN
            peer.up.clear()
            peer.down_since = self._loop.time()
            self._fail_inflight(peer, f"connection to {peer.name} dropped")
        elif state == AUTH_FAILED and peer.state is not AUTH_FAILED:
            peer.state = AUTH_FAILED
            for rid in list(peer.inflight):  # sent or not: none of them gets through
                pending = self._pending.get(rid)
                if pending is not None:
                    self._finish(rid, exc=unauthenticated(pending, self.keys))

    def _refusal(self, pending: Pending) -> ZmqflowError | None:
        """Why a call to a peer that is not up fails at once (None: it may wait for the peer)."""
        peer = pending.peer
        if peer.state is AUTH_FAILED:
            return unauthenticated(pending, self.keys)
        if peer.state == DOWN and self._loop.time() - peer.down_since > RECONNECT_GRACE:
            return Unavailable(f"{peer.name} is down; {pending.what} not sent", task=peer.name)
        return None

    def _fail_inflight(self, peer: Peer, why: str) -> None:
        """Fail the calls that went out on the dropped connection; unsent ones wait for the next."""
        for rid in list(peer.inflight):
            pending = self._pending.get(rid)
            if pending is not None and pending.sent:
                self._finish(rid, exc=Unavailable(f"{why} during {pending.what}", task=peer.name))

    # calls ------------------------------------------------------------------------------
    def call(self, endpoint: str, service: str, op: str, body: Any = None, *, timeout: float | None = None,
             name: str | None = None, size: int = 0) -> "asyncio.Future[Any]":
        """Call ``service.op`` on the task at ``endpoint``: await the result. A future, not a
        coroutine (one frame less on every call): the request goes out now, and what refuses it
        (a bad argument, a closed client) is raised where it is awaited, as from a coroutine."""
        try:
            return self.start_call(endpoint, service, op, body, timeout=timeout, name=name, size=size)
        except Exception as exc:
            failed = self._loop.create_future()
            failed.set_exception(exc)
            return failed

    def start_call(self, endpoint: str, service: str, op: str, body: Any = None, *, timeout: float | None = None,
                   name: str | None = None, size: int = 0) -> asyncio.Future:
        """Send now and return a future for the reply: pipelines many calls without a task each.
        ``size``: bytes the call moves that its request does not carry (a read's reply), so that
        a large read may take another stream (:mod:`.streams`) as a large write would."""
        timeout = self.default_timeout if timeout is None else float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        peer = self.peer(endpoint, name)
        rid = next(self._ids)
        frames = encode_request(rid, service, op, body, timeout, self.source)
        nbytes = frames_nbytes(frames)
        if self._streams.count > 1 and (k := self._streams.pick(endpoint, max(size, nbytes))):
            peer = self.peer(endpoint, name, k)
        state = peer.state
        # the common case goes out first and is recorded after: nothing can answer it before this
        # returns to the loop, and the reply's trip starts a few microseconds sooner
        coalescer = self._coalescer
        lone = ((state is UP or state is CONNECTING) and peer.batching and nbytes <= coalescer.small_bytes
                and coalescer.hold(peer))
        if lone:  # alone in its tick (which it opens): out now
            self._loop.call_soon(self._end_tick, peer)  # the tick this request opened ends on the next one
            sent = peer.conn.try_send(frames)
        fut = self._loop.create_future()
        pending = Pending(fut, peer, service, op, False, None, timeout)
        self._pending[rid] = pending
        peer.inflight.add(rid)
        due = self._loop.time() + timeout
        self._deadlines.add(due, rid, self._pending)
        if self._wake is None or due < self._wake_at:
            self._arm(due)
        if self.retry_interval is not None and self.retry_interval < timeout:
            pending.retry = self._loop.call_later(self.retry_interval, self._retry, rid, frames)
        if lone:
            if sent:
                pending.sent = True
                self._count_out(frames, nbytes)
            else:  # no room now: wait for it
                self._send_one(peer, rid, frames, nbytes)
            return fut
        if state is not UP and state is not CONNECTING and (refused := self._refusal(pending)) is not None:
            self._finish(rid, exc=refused)
            return fut
        if peer.batching and state != DOWN:
            if coalescer.small(nbytes):  # its peer's tick is open (a lone request opened it): held
                full, _ = coalescer.add(peer, (rid, frames), nbytes + 8 * len(frames))
                if full is not None:
                    self._send_group(peer, full)
                return fut
            held = coalescer.take(peer)
            if held:  # what was made before goes before: a large request never waits for the tick
                self._send_group(peer, held)
        self._send_one(peer, rid, frames, nbytes)
        return fut

    def _send_one(self, peer: Peer, rid: int, frames: list[Any], nbytes: int | None = None) -> None:
        """Send one request now, or start waiting for room or for the connection."""
        pending = self._pending.get(rid)
        if pending is None or pending.sent:
            return
        if peer.state != DOWN and (peer.conn.try_send(frames) or (self._refresh(peer, rid) and peer.conn.try_send(frames))):
            pending.sent = True
            self._count_out(frames, nbytes)
            return
        task = self._loop.create_task(self._send_later(rid, peer, frames, pending.timeout))
        self._senders[rid] = task
        task.add_done_callback(lambda _t, rid=rid: self._senders.pop(rid, None))
        # a call waiting to be sent ends when its caller cancels it: on this slow path only, so
        # the common one (sent at once, answered) carries no callback
        pending.future.add_done_callback(functools.partial(self._abandoned, rid))

    def _abandoned(self, rid: int, future: asyncio.Future) -> None:
        """A call its caller cancelled ends now: out of the record, its retries and waiting send stopped,
        so nothing of it goes out after the cancel."""
        pending = self._pending.get(rid)
        if pending is not None and pending.future is future and future.cancelled():
            self._finish(rid)

    def _end_tick(self, peer: Peer) -> None:
        held = self._coalescer.end_tick(peer)
        if held:
            self._send_group(peer, held)

    def _send_group(self, peer: Peer, items: list[tuple[int, list[Any]]]) -> None:
        """Held requests: one goes alone, several in one envelope (each alone when that cannot go now)."""
        pending_of = self._pending.get
        # not ended meanwhile, nor cancelled by its caller while held (a cancelled call is never sent)
        live = [item for item in items if (p := pending_of(item[0])) is not None and not p.sent and not p.future.done()]
        if len(live) < len(items):
            for rid, _ in items:
                if (p := pending_of(rid)) is not None:
                    self._abandoned(rid, p.future)
        if len(live) < 2 or not peer.batching:
            for rid, frames in live:
                self._send_one(peer, rid, frames)
            return
        bid = next(self._ids)
        frames = encode_batch(bid, [f for _, f in live])
        if peer.state != DOWN and peer.conn.try_send(frames):
            self._batches[bid] = (peer, live)
            for rid, _ in live:
                p = self._pending[rid]
                p.sent = True
                p.batch = bid
            self.batches_out += 1
            self._count_out(frames)
            return
        for rid, f in live:
            self._send_one(peer, rid, f)

    @staticmethod
    def _refresh(peer: Peer, rid: int) -> bool:
        """A connection that cannot recover by itself (inproc) is replaced, when nothing else is in flight on it."""
        return not peer.inflight - {rid} and peer.conn.refresh()

    async def _send_later(self, rid: int, peer: Peer, frames: list[Any], timeout: float) -> None:
        """The peer is not connected yet (or its pipe is full): keep trying within the deadline."""
        limit = timeout if peer.state != DOWN else min(timeout, RECONNECT_GRACE)
        until = self._loop.time() + limit
        try:
            if peer.state == DOWN and peer.conn.monitored:
                async with asyncio.timeout_at(until):
                    await peer.up.wait()
            sent = await peer.conn.send(frames, until)
        except (SendFailed, TimeoutError):
            sent = False
        pending = self._pending.get(rid)
        if sent:
            self._count_out(frames)
            if pending is not None:
                pending.sent = True
            return
        if pending is not None:
            self._finish(rid, exc=unreachable(pending, limit))

    def _retry(self, rid: int, frames: list[Any]) -> None:
        """Send an unanswered call again, unchanged (the server answers a duplicate from its record)."""
        pending = self._pending.get(rid)
        if pending is None:
            return
        if pending.future.done():  # its caller cancelled it: it ends here, and is never sent again
            self._finish(rid)
            return
        peer = pending.peer
        if pending.sent and peer.state != DOWN and peer.conn.try_send(frames):
            self.retries += 1
            self._count_out(frames)
        # not sent yet (its send waits for the connection) or no room now: try again later
        pending.retry = self._loop.call_later(self.retry_interval, self._retry, rid, frames)  # type: ignore[arg-type]

    def _count_out(self, frames: Sequence[Any], nbytes: int | None = None) -> None:
        counters = self.counters
        counters.msgs_out += 1
        counters.bytes_out += frames_nbytes(frames) if nbytes is None else nbytes

    def _arm(self, due: float) -> None:
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at = due
        self._wake = self._loop.call_at(due, self._on_wake)

    def _on_wake(self) -> None:
        """The earliest deadline came: end every call due by the time the timer was armed for (a
        loop may fire it a hair early), then arm it for the next."""
        self._wake = None
        live = self._pending
        for rid in self._deadlines.pop_due(max(self._loop.time(), self._wake_at), live):
            pending = live.get(rid)
            if pending is not None:
                self._expire(rid, pending)
        due = self._deadlines.next_due(live)
        if due is not None and not self._closed:
            self._arm(due)

    def _expire(self, rid: int, pending: Pending) -> None:
        timeout = pending.timeout
        if not pending.sent:  # never left this process: the peer is unreachable, not slow
            self._finish(rid, exc=unreachable(pending, timeout))
        else:
            self._finish(rid, exc=DeadlineExceeded(f"{pending.what} did not answer within {timeout:g}s", task=pending.peer.name))

    def _finish(self, rid: int, *, result: Any = None, exc: BaseException | None = None) -> None:
        pending = self._pending.pop(rid)
        pending.peer.inflight.discard(rid)
        if pending.batch:  # the peer answered (or the call ended): its envelope needs no fallback
            self._batches.pop(pending.batch, None)
        if not pending.sent:  # a send still waiting for the connection must never go out after this
            sender = self._senders.pop(rid, None)
            if sender is not None and sender is not asyncio.current_task():
                sender.cancel()
        if pending.retry is not None:
            pending.retry.cancel()
        if pending.future.done():  # the caller cancelled
            return
        if exc is not None:
            pending.future.set_exception(exc)
        else:
            pending.future.set_result(result)

    def down_since(self, endpoint: str) -> float | None:
        """Loop time at which the connection to ``endpoint`` dropped, None while it is not down."""
        peer = self._peers.get(endpoint)
        if peer is None or self.peer_state(endpoint) != DOWN:
            return None
        return peer.down_since

    def connections(self, endpoint: str) -> int:
        """How many connections to ``endpoint`` are open: more than one once streams carried large requests."""
        return sum(Streams.key(endpoint, k) in self._peers for k in range(self._streams.count))

    def peer_state(self, endpoint: str) -> str:
        """``up``, ``down`` or ``connecting``, as the transport sees it now (an inproc peer is up
        while its pipe takes messages)."""
        peer = self._peers.get(endpoint)
        if peer is None:
            return CONNECTING
        return peer.conn.state

    # shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Fail what is in flight and close every socket (linger 0)."""
        if self._closed:
            return
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        for task in list(self._senders.values()):
            task.cancel()
        for rid, pending in list(self._pending.items()):
            self._finish(rid, exc=Unavailable(f"client closed during {pending.what}", task=pending.peer.name))
        self._deadlines.clear()  # after the calls above ended: nothing is live to wake for
        for peer in self._peers.values():
            peer.conn.close()
        self._peers.clear()

