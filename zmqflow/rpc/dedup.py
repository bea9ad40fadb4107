"""Which requests a server has already seen, per peer, so a retried or duplicated one runs once.

A client that retries sends the same frames under the same request id, so the server keys its
record by (peer routing identity, request id). A restarted task reuses its routing identity, so
clients number their requests from a random point of 2**62 (``RpcClient``): a new incarnation's
ids are not its predecessor's. As a second guard the record holds a hash of each request's header
frame: a known id whose header differs starts that peer's record afresh. Sans-IO: the caller
passes the loop time and says how replies go out.

Each id is ``IN_FLIGHT`` (a duplicate is ignored: the one reply goes out when the handler ends),
a tuple of the reply's frames (a duplicate gets them again), or ``DONE`` (the reply was not kept,
too big or over a budget below: a duplicate is told the call ran). A refusal is a reply like any other: a duplicate of a
refused request (or a retry that crossed the refusal) gets the refusal, never a run the client
was told did not happen. The record is bounded: ``per_peer`` ids per peer (oldest
forgotten first) and peers idle for ``idle_s`` or whose connection is gone are dropped at sweeps.

The replies kept are bounded in bytes too, per peer (``max_peer_bytes``) and for the whole server
(``max_bytes``), since every routing identity a peer makes up gets a record of its own. Over a
budget, the oldest kept replies (of that peer; for the server's, of the peers keeping the most) are
let go down to three quarters of it, their ids staying ``DONE``: a retry of one is told the call
ran, never run again, so a request that is not idempotent still runs at most once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Dedup", "IN_FLIGHT", "DONE", "PER_PEER", "MAX_KEPT_REPLY", "MAX_KEPT_BYTES", "MAX_PEER_KEPT_BYTES",
           "IDLE_S"]

IN_FLIGHT = "in-flight"
DONE = "done"
PER_PEER = 4096  # ids remembered per peer: far more than a client retries at once
MAX_KEPT_REPLY = 64 * 1024  # replies up to this size are kept for a duplicate
# Bytes of kept replies. A retry comes within seconds of its request, so what must be kept is the
# replies to the requests a peer has in flight over a retry interval or two: 16 MiB is 256 replies
# of the largest size kept (and thousands of usual small ones) per peer, and 64 MiB for the server
# caps the whole record however many identities connect, a small share of a task's memory.
MAX_KEPT_BYTES = 64 << 20
MAX_PEER_KEPT_BYTES = 16 << 20
IDLE_S = 300.0  # a peer silent this long is forgotten (longer than any retry runs)
SWEEP_S = 30.0

# [header hash, IN_FLIGHT | DONE | tuple of reply frames, bytes kept]: a list, so that the reply is
# stored in place (one dict access per request on the server's hot path, not two)
Entry = list


class _PeerLog:
    """One peer's ids: a dict for lookups, and a ring of the same ids in arrival order, so the
    oldest is forgotten in O(1) without an ordered dict's per-key links."""

    __slots__ = ("ids", "ring", "pos", "last", "kept")

    def __init__(self, now: float) -> None:
        self.ids: dict[int, Entry] = {}
        self.ring: list[int] = []  # grows to ``per_peer``, then wraps at ``pos``
        self.pos = 0
        self.last = now
        self.kept = 0  # bytes of the replies kept

    def clear(self) -> None:
        self.ids.clear()
        self.ring.clear()
        self.pos = 0
        self.kept = 0

    def shed(self, target: int) -> int:
        """Let go of the oldest kept replies until at most ``target`` bytes are kept (their ids
        stay ``DONE``); returns the bytes let go."""
        ring, ids = self.ring, self.ids
        freed = 0
        for i in range(len(ring)):
            if self.kept <= target:
                break
            entry = ids.get(ring[(self.pos + i) % len(ring)])  # oldest first: the ring starts at ``pos``
            if entry is not None and entry[2]:
                freed += entry[2]
                self.kept -= entry[2]
                entry[1], entry[2] = DONE, 0
        return freed


class Dedup:
    """The bounded record of recent request ids, per peer; O(1) per request."""

    def __init__(self, *, per_peer: int = PER_PEER, max_kept_reply: int = MAX_KEPT_REPLY, idle_s: float = IDLE_S,
                 sweep_s: float = SWEEP_S, max_bytes: int = MAX_KEPT_BYTES,
                 max_peer_bytes: int = MAX_PEER_KEPT_BYTES) -> None:
        if per_peer < 1 or max_bytes < 1 or max_peer_bytes < 1:
            raise ValueError(f"per_peer, max_bytes and max_peer_bytes must be >= 1, got {per_peer}, {max_bytes}, "
                             f"{max_peer_bytes}")
        self.per_peer = per_peer
        self.max_kept_reply = max_kept_reply
        self.max_bytes = max_bytes
        self.max_peer_bytes = max_peer_bytes
        self.kept = 0  # bytes of replies kept, all peers
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
            self.kept -= log.kept
            log.clear()  # the same id with other content: the client started over under this identity
        ids[rid] = [key, IN_FLIGHT, 0]
        ring = log.ring
        if len(ring) < self.per_peer:
            ring.append(rid)
        else:  # forget the oldest id
            pos = log.pos
            old = ids.pop(ring[pos], None)
            if old is not None and old[2]:
                log.kept -= old[2]
                self.kept -= old[2]
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
        over = log.kept + nbytes > self.max_peer_bytes or self.kept + nbytes > self.max_bytes
        if nbytes > self.max_kept_reply or (over and not self._room(log, nbytes)):
            seen[1] = DONE
        else:  # copies: a reply may view memory the handler goes on changing (a pulled variable)
            seen[1] = tuple([f if f.__class__ is bytes else memoryview(f).tobytes() for f in frames])
            seen[2] = nbytes
            log.kept += nbytes
            self.kept += nbytes

    def _room(self, log: _PeerLog, nbytes: int) -> bool:
        """Whether a reply of ``nbytes`` over a budget fits once the oldest replies kept are let go
        (down to three quarters of the budget, so that this runs once per quarter of it, not per reply)."""
        if log.kept + nbytes > self.max_peer_bytes:
            self.kept -= log.shed(self.max_peer_bytes * 3 // 4 - nbytes)
        if self.kept + nbytes > self.max_bytes:
            target = self.max_bytes * 3 // 4 - nbytes
            for other in sorted(self._peers.values(), key=lambda p: p.kept, reverse=True):
                if self.kept <= target or not other.kept:
                    break
                self.kept -= other.shed(max(0, other.kept - (self.kept - target)))
        return log.kept + nbytes <= self.max_peer_bytes and self.kept + nbytes <= self.max_bytes

    def sweep_due(self, now: float) -> bool:
        return now >= self._next_sweep

    def sweep(self, now: float, alive: Callable[[bytes], bool]) -> int:
        """Drop peers idle for ``idle_s`` or no longer connected; returns how many."""
        self._next_sweep = now + self.sweep_s
        gone = [p for p, log in self._peers.items() if now - log.last > self.idle_s or not alive(p)]
        for p in gone:
            self.kept -= self._peers.pop(p).kept
        return len(gone)

    def peers(self) -> int:
        return len(self._peers)

    def size(self, peer: bytes) -> int:
        log = self._peers.get(peer)
        return 0 if log is None else len(log.ids)
