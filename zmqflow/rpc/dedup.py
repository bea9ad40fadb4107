"""Which requests a server has already seen, per peer, so a retried or duplicated one runs once.

A client that retries sends the same frames under the same request id, so the server keys its
record by (peer routing identity, request id). A restarted task reuses its routing identity, so
clients number their requests from a random point of 2**62 (``RpcClient``): a new incarnation's
ids are not its predecessor's. As a second guard the record holds a hash of each request's header
frame: a known id whose header differs starts that peer's record afresh. Sans-IO: the caller
passes the loop time and says how replies go out.

Each id is ``IN_FLIGHT`` (a duplicate is ignored: the one reply goes out when the handler ends),
a tuple of the reply's frames (a duplicate gets them again), or ``DONE`` (the reply was too big to
keep: a duplicate is told the call ran). A refusal is a reply like any other: a duplicate of a
refused request (or a retry that crossed the refusal) gets the refusal, never a run the client
was told did not happen. The record is bounded: ``per_peer`` ids per peer (oldest
forgotten first) and peers idle for ``idle_s`` or whose connection is gone are dropped at sweeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Dedup", "IN_FLIGHT", "DONE", "PER_PEER", "MAX_KEPT_REPLY", "IDLE_S"]

IN_FLIGHT = "in-flight"
DONE = "done"
PER_PEER = 4096  # ids remembered per peer: far more than a client retries at once
MAX_KEPT_REPLY = 64 * 1024  # replies up to this size are kept for a duplicate
IDLE_S = 300.0  # a peer silent this long is forgotten (longer than any retry runs)
SWEEP_S = 30.0

# [header hash, IN_FLIGHT | DONE | tuple of reply frames]: a list, so that the reply is stored
# in place (one dict access per request on the server's hot path, not two)
Entry = list


class _PeerLog:
    """One peer's ids: a dict for lookups, and a ring of the same ids in arrival order, so the
    oldest is forgotten in O(1) without an ordered dict's per-key links."""

    __slots__ = ("ids", "ring", "pos", "last")

    def __init__(self, now: float) -> None:
        self.ids: dict[int, Entry] = {}
        self.ring: list[int] = []  # grows to ``per_peer``, then wraps at ``pos``
        self.pos = 0
        self.last = now

    def clear(self) -> None:
        self.ids.clear()
        self.ring.clear()
        self.pos = 0


class Dedup:
    """The bounded record of recent request ids, per peer; O(1) per request."""

    def __init__(self, *, per_peer: int = PER_PEER, max_kept_reply: int = MAX_KEPT_REPLY, idle_s: float = IDLE_S,
                 sweep_s: float = SWEEP_S) -> None:
        if per_peer < 1:
            raise ValueError(f"per_peer must be >= 1, got {per_peer}")
        self.per_peer = per_peer
        self.max_kept_reply = max_kept_reply
        self.idle_s = idle_s
        self.sweep_s = sweep_s
        self._peers: dict[bytes, _PeerLog] = {}
        self._next_sweep = 0.0
        self.duplicates = 0  # requests answered from (or ignored because of) the record

    def begin(self, peer: bytes, rid: int, header: Any, now: float) -> Any:
        """Note a request; None when it is new (run it), else what the record holds for it."""
        log = self._peers.get(peer)
        if log is None:
            log = self._peers[peer] = _PeerLog(now)
        log.last = now
        key = hash(header if header.__class__ is bytes else bytes(header))
        ids = log.ids
        seen = ids.get(rid)
        if seen is not None:
            if seen[0] == key:
                self.duplicates += 1
                return seen[1]
            log.clear()  # the same id with other content: the client started over under this identity
        ids[rid] = [key, IN_FLIGHT]
        ring = log.ring
        if len(ring) < self.per_peer:
            ring.append(rid)
        else:  # forget the oldest id
            pos = log.pos
            ids.pop(ring[pos], None)
            ring[pos] = rid
            log.pos = pos + 1 if pos + 1 < len(ring) else 0
        return None

    def finish(self, peer: bytes, rid: int, frames: Sequence[Any], nbytes: int) -> None:
        """Keep the reply to ``rid`` (its frames without the routing identity) for a duplicate."""
        log = self._peers.get(peer)
        if log is None:
            return
        seen = log.ids.get(rid)
        if seen is None or seen[1] is not IN_FLIGHT:
            return
        if nbytes > self.max_kept_reply:
            seen[1] = DONE
        else:  # copies: a reply may view memory the handler goes on changing (a pulled variable)
            seen[1] = tuple([f if f.__class__ is bytes else memoryview(f).tobytes() for f in frames])

    def sweep_due(self, now: float) -> bool:
        return now >= self._next_sweep

    def sweep(self, now: float, alive: Callable[[bytes], bool]) -> int:
        """Drop peers idle for ``idle_s`` or no longer connected; returns how many."""
        self._next_sweep = now + self.sweep_s
        gone = [p for p, log in self._peers.items() if now - log.last > self.idle_s or not alive(p)]
        for p in gone:
            del self._peers[p]
        return len(gone)

    def peers(self) -> int:
        return len(self._peers)

    def size(self, peer: bytes) -> int:
        log = self._peers.get(peer)
        return 0 if log is None else len(log.ids)
