"""Replies, read and matched to the calls they answer: the reply half of :class:`.client.RpcClient`.

A reply (alone, unreadable, or an entry of a batch envelope) ends a call only when it came from the
peer the call was sent to: request ids are unique to the client, not to a peer, so a buggy or
hostile server answering an id it was never sent must not complete, or fail, another peer's call.
Such a reply is counted as late, as one that came after its call ended is.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ZmqflowError
from ..wire import ERROR, REPLY, REQUEST, DecodeError, Limits, Message, decode, raise_error
from ..wire.batch import batch_id, decode_batch
from .calls import Peer, Pending, protocol_error
from .counters import Counters

__all__ = ["Replies"]

log = logging.getLogger(__name__)


class Replies:
    """What the client does with each message a peer sends back; the client supplies the state."""

    counters: Counters
    limits: Limits
    _pending: dict[int, Pending]
    # envelopes sent whose peer has answered nothing of them yet: (peer, [(request id, frames)])
    _batches: dict[int, tuple[Peer, list[tuple[int, list[Any]]]]]

    def _finish(self, rid: int, *, result: Any = None, exc: BaseException | None = None) -> None:
        raise NotImplementedError

    def _send_one(self, peer: Peer, rid: int, frames: list[Any], nbytes: int | None = None) -> None:
        raise NotImplementedError

    def _on_reply(self, peer: Peer, frames: list[Any]) -> None:
        counters = self.counters
        counters.msgs_in += 1
        counters.bytes_in += sum(map(len, frames))
        try:
            msg = decode(frames, self.limits)
        except DecodeError as exc:
            if exc.kind is None and frames and batch_id(frames[0]) is not None:
                self._on_batch(peer, frames)
            else:
                self._undecodable(peer, exc)
            return
        self._on_message(peer, msg)

    def _on_batch(self, peer: Peer, frames: list[Any]) -> None:
        """Replies that came in one envelope: each is read and matched on its own."""
        try:
            batch = decode_batch(frames, self.limits)
        except DecodeError as exc:
            self.counters.dropped += 1
            log.warning("dropped an unreadable batch of replies from %s: %s", peer.name, exc)
            return
        for entry in batch.entries:
            try:
                msg = decode(entry, self.limits)
            except DecodeError as exc:
                self._undecodable(peer, exc)
                continue
            self._on_message(peer, msg)

    def _undecodable(self, peer: Peer, exc: DecodeError) -> None:
        pending = self._pending.get(exc.request_id) if exc.request_id is not None else None
        if pending is not None and pending.peer is peer:  # only the peer a call went to can fail it
            self._finish(exc.request_id, exc=protocol_error(exc, pending))  # type: ignore[arg-type]
        else:
            self.counters.dropped += 1
            log.warning("dropped an unreadable reply from %s: %s", peer.name, exc)

    def _on_message(self, peer: Peer, msg: Message) -> None:
        pending = self._pending.get(msg.id)
        # a reply counts only from the peer its call went to: ids are this client's, not per peer
        if pending is None or msg.kind == REQUEST or pending.peer is not peer:
            refused = self._batches.get(msg.id) if msg.kind == ERROR else None
            if refused is not None and refused[0] is peer:
                del self._batches[msg.id]
                self._unbatch(refused, msg)
            else:
                self.counters.late_replies += 1
            return
        if msg.kind == REPLY:
            self._finish(msg.id, result=msg.body)
        elif msg.kind == ERROR:
            try:
                raise_error(msg, context=f"from {pending.what}")
            except ZmqflowError as exc:
                self._finish(msg.id, exc=exc)

    def _unbatch(self, refused: tuple[Peer, list[tuple[int, list[Any]]]], msg: Message) -> None:
        """The peer refused an envelope whole (none of it ran): its requests go again, one by one,
        and so does everything else for that peer from now on."""
        peer, items = refused
        peer.batching = False
        err = msg.error or {}
        log.warning("%s refused a batch of %d requests (%s: %s); sending requests to it one by one", peer.name,
                    len(items), err.get("code", ""), str(err.get("message", ""))[:200])
        for rid, frames in items:
            pending = self._pending.get(rid)
            if pending is not None and pending.batch == msg.id:
                pending.sent = False
                pending.batch = 0
                if pending.future.done():  # cancelled by its caller: not sent again
                    self._finish(rid)
                else:
                    self._send_one(peer, rid, frames)
