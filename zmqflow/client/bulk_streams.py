"""A session's bulk streams (:mod:`zmqflow.transport.bulk`) by task, kind and lane, opened on
first use: pull streams that transfers land on (:mod:`.bulk`; a large pull from few tasks uses
several lanes, :mod:`.bulk_lanes`), a push stream that gradients go out on (:mod:`.bulk_push`).

A task that offers none (``ZMQFLOW_BULK=0`` there, keys beyond loopback, an older task, one at
its cap of streams), or whose offered port cannot be reached (a network policy, a firewall), is
left to ZeroMQ for ``RETRY_AFTER`` seconds, then asked again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..cluster import Address, TaskId
from ..errors import ZmqflowError
from ..transport.bulk import HELLO, MAGIC, OPENED, TOKEN_BYTES, Kind, bulk_enabled, family, recv_exact, tune
from .bulk import BulkStream
from .bulk_push import PushStream

__all__ = ["BulkStreams"]

log = logging.getLogger("zmqflow.client.bulk")
_CONNECT_TIMEOUT = 5.0
RETRY_AFTER = 30.0  # seconds a task that gave no stream is left to ZeroMQ before it is asked again


def _well_formed(offer: Any) -> bool:
    """An offer as ``ps.bulk_offer`` answers it: a port, a 16-byte token and a handle."""
    return (isinstance(offer, dict) and isinstance(offer.get("port"), int) and 0 < offer["port"] < 65536
            and isinstance(offer.get("token"), bytes) and len(offer["token"]) == TOKEN_BYTES
            and isinstance(offer.get("handle"), int) and offer["handle"] >= 0)


class BulkStreams:
    """A session's streams by task and kind. ``call(task, op, body)`` is the session's call to a
    task's ps service; ``address(task)`` where the task is."""

    def __init__(self, call: Callable[[TaskId, str, Any], Awaitable[Any]],
                 address: Callable[[TaskId], Awaitable[Address]]):
        self._call, self._address = call, address
        self._streams: dict[tuple[TaskId, Kind, int], BulkStream | PushStream] = {}
        # (task, kind, lane) that gave no stream, and until when to believe it; lane 0 speaks for its kind
        self._none: dict[tuple[TaskId, Kind, int], float] = {}
        self._opening: dict[tuple[TaskId, Kind, int], asyncio.Future] = {}
        self.enabled = bulk_enabled()
        self._closed = False

    async def get(self, task: TaskId, kind: Kind = "pull", lane: int = 0) -> BulkStream | PushStream | None:
        """The open stream of ``kind`` to ``task`` in ``lane`` (a large share is spread over several
        lanes), opened now if need be; None where it offers none, or once these streams are closed
        (the caller's transfer goes over ZeroMQ, which says whether the session is closed)."""
        now, none = time.monotonic(), self._none
        if self._closed or not self.enabled:
            return None
        if none.get((task, kind, 0), 0.0) > now or none.get((task, kind, lane), 0.0) > now:
            return None
        key = (task, kind, lane)
        s = self._streams.get(key)
        # a push stream has no reader to see the task close it (a restart, a stop): one look, so
        # a push goes to the task as it is now (a restarted one says what it lost), not to a gone stream
        if s is not None and not (s.gone() if isinstance(s, PushStream) else s.closed):
            return s
        pending = self._opening.get(key)
        if pending is None:
            pending = self._opening[key] = asyncio.ensure_future(self._open(task, kind, lane))
            pending.add_done_callback(lambda _: self._opening.pop(key, None))
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            # the open ended by close(), its waiter not cancelled: no CancelledError for a task
            # nobody cancelled; its transfer goes over ZeroMQ, which says the session is closed
            me = asyncio.current_task()
            if self._closed and pending.cancelled() and (me is None or not me.cancelling()):
                return None
            raise

    def _without(self, task: TaskId, kind: Kind, lane: int, why: str, level: int = logging.INFO) -> None:
        """Lane ``lane`` of ``kind`` to ``task`` (every lane of the kind for lane 0: its transfers
        go over ZeroMQ) gives none for a while (``RETRY_AFTER``), then is asked for again: a task
        that was starting, or at its cap, may offer one later."""
        key = (task, kind, lane)
        if key not in self._none:
            if lane:
                log.log(level, "bulk %s streams to %s: no lane %d (%s); its transfers use fewer", kind, task, lane, why)
            else:
                log.log(level, "bulk %s streams to %s: none (%s); its transfers go over ZeroMQ", kind, task, why)
        self._none[key] = time.monotonic() + RETRY_AFTER

    async def _open(self, task: TaskId, kind: Kind, lane: int) -> BulkStream | PushStream | None:
        addr = await self._address(task)
        if addr.scheme != "tcp":
            self._none[(task, kind, 0)] = float("inf")
            return None
        try:
            offer = await self._call(task, "bulk_offer", {"kind": kind})
        except ZmqflowError as exc:  # an older task (no such op), one at its cap, one busy: ZeroMQ does it
            self._without(task, kind, lane, f"{type(exc).__name__}: {exc}")
            return None
        if not _well_formed(offer):
            self._without(task, kind, lane, "it offers none" if offer is None else f"a malformed offer {offer!r:.80}")
            return None
        loop = asyncio.get_running_loop()
        fam = family(addr.host)
        sock = socket.socket(fam, socket.SOCK_STREAM)
        try:
            tune(sock)
            host = (await loop.getaddrinfo(addr.host, offer["port"], family=fam, type=socket.SOCK_STREAM))[0][4]
            await asyncio.wait_for(self._hello(sock, host, offer["token"]), _CONNECT_TIMEOUT)
        except (OSError, TimeoutError, ConnectionError) as exc:
            # a port the network does not let through (a pod's policy, a firewall): ZeroMQ it is
            sock.close()
            self._without(task, kind, lane, f"cannot open it on port {offer['port']}: {exc or type(exc).__name__}",
                          logging.WARNING)
            return None
        except BaseException:
            sock.close()
            raise
        cls = PushStream if kind == "push" else BulkStream
        s = self._streams[(task, kind, lane)] = cls(str(task), int(offer["handle"]), sock)
        return s

    @staticmethod
    async def _hello(sock: socket.socket, host: Any, token: bytes) -> None:
        """Connect, present the token, and wait for the task's word that the stream is open: a
        request naming it may not reach the task before its hello does."""
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, host)
        await loop.sock_sendall(sock, HELLO.pack(MAGIC, token))
        if await recv_exact(sock, 1) != OPENED:
            raise ConnectionError("the task did not open the stream")

    async def close(self) -> None:
        """Close every stream and end the opens in progress: their waiters get None."""
        self._closed = True
        streams, self._streams = list(self._streams.values()), {}
        for f in list(self._opening.values()):
            f.cancel()
        readers = []
        for s in streams:
            if isinstance(s, PushStream):
                s.close()
            else:
                readers.append(s.close())
        await asyncio.gather(*readers, *self._opening.values(), return_exceptions=True)
