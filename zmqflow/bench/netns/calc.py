"""The arithmetic of the cluster benchmark: what the links allow, and what was measured over a
window in which every worker was busy. Pure functions, checked by unit tests.

The bound. A worker pulls the whole model (``M`` bytes, its link's download) and then pushes a
gradient of the same size (its upload); ps shard ``i`` holds ``S_i`` of the bytes, so it sends
``S_i/M`` of every pull (its upload) and receives that share of every push (its download). Each
link carries ``R`` bytes/s each way (full duplex). With ``T`` the aggregate pull+push rate:

* worker links: one round of a worker (pull, then push) takes at least ``M/R + M/R``, so each
  worker moves at most ``R`` of pull+push on average and ``T <= W * R``; a round that overlaps
  the two (``Session.push_pull``: the pull on the download while the push is on the upload) takes
  at least ``M/R``, and ``T <= 2 W R``;
* ps links: pulls are half of ``T`` and the busiest shard sends ``max S_i / M`` of them, so
  ``T/2 * max S_i / M <= R``, likewise pushes on its download: ``T <= 2 R M / max S_i``.

The bound is the smaller; "binds" names that side (both when equal). It is an upper bound: the
ps side reaches it only when workers' pulls and pushes interleave perfectly. The bytes counted
are payload; the link's rate counts frames, whose TCP/IP/Ethernet headers leave
:func:`payload_fraction` (0.956 at MTU 1500) of it for payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import InvalidArgument

__all__ = ["Bound", "Window", "link_bound", "payload_fraction", "window_rate"]

# (pull starts, pull ends = push starts, push ends), seconds; an overlapped round's pull and push
# both span (t0, t2)
Round = tuple[float, float, float]


@dataclass(frozen=True)
class Bound:
    """The most aggregate pull+push bytes/s the links allow, and which links set it."""

    bytes_per_s: float
    workers_bytes_per_s: float
    ps_bytes_per_s: float
    binds: str  # "workers", "ps" or "both"


@dataclass(frozen=True)
class Window:
    """Aggregate rates over the window in which every worker was past its warm-up and still running."""

    pull_bytes_per_s: float
    push_bytes_per_s: float
    seconds: float
    rounds: int  # rounds that overlap the window, all workers

    @property
    def total_bytes_per_s(self) -> float:
        return self.pull_bytes_per_s + self.push_bytes_per_s


def link_bound(rate_bits: float, workers: int, shard_bytes: Sequence[int], overlapped: bool = False) -> Bound:
    """The bound of the module docstring for links of ``rate_bits`` bit/s each way, ``workers``
    workers and a model of which ps shard ``i`` holds ``shard_bytes[i]`` bytes; ``overlapped``:
    workers push and pull at once."""
    if rate_bits <= 0:
        raise InvalidArgument(f"link rate must be positive, got {rate_bits} bit/s")
    if workers < 1:
        raise InvalidArgument(f"need at least one worker, got {workers}")
    if not shard_bytes or min(shard_bytes) < 0 or max(shard_bytes) == 0:
        raise InvalidArgument(f"shard_bytes must be non-negative with one shard holding bytes, got {list(shard_bytes)}")
    r = rate_bits / 8
    by_workers = workers * r * (2 if overlapped else 1)
    by_ps = 2 * r * sum(shard_bytes) / max(shard_bytes)
    if abs(by_workers - by_ps) <= 1e-9 * max(by_workers, by_ps):
        binds = "both"
    else:
        binds = "workers" if by_workers < by_ps else "ps"
    return Bound(min(by_workers, by_ps), by_workers, by_ps, binds)


def payload_fraction(mtu: int = 1500) -> float:
    """The share of a link's rate left for TCP payload: per frame of ``mtu`` bytes, 52 bytes of
    IP and TCP headers (timestamps on) go, and 14 of Ethernet header are counted by ``tc``."""
    if mtu <= 52:
        raise InvalidArgument(f"mtu must exceed 52 bytes, got {mtu}")
    return (mtu - 52) / (mtu + 14)


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def _share(nbytes: float, a: float, b: float, lo: float, hi: float) -> float:
    """The bytes of a phase that moved ``nbytes`` over ``(a, b)`` that fall in ``(lo, hi)``."""
    return nbytes * _overlap(a, b, lo, hi) / (b - a) if b > a else 0.0


def window_rate(rounds: Sequence[Sequence[Round]], phase_bytes: float, warm: float,
                overlapped: bool = False) -> Window:
    """Aggregate pull and push bytes/s of workers that each reported ``rounds`` (one list per
    worker; each pull and each push moved ``phase_bytes``), over the window from ``warm`` seconds
    after the last worker began to the moment the first worker stopped. A phase that straddles
    an edge counts pro rata, as if it moved its bytes evenly. ``overlapped``: each round's pull
    and push both span the whole round."""
    if not rounds or any(not r for r in rounds):
        raise InvalidArgument("every worker must report at least one round")
    lo = max(r[0][0] for r in rounds) + warm
    hi = min(r[-1][2] for r in rounds)
    if hi <= lo:
        raise InvalidArgument(f"no window in which every worker ran past {warm:g}s of warm-up: run longer")
    pulled = pushed = 0.0
    used = 0
    for worker in rounds:
        for t0, t1, t2 in worker:
            pull_ends, push_starts = (t2, t0) if overlapped else (t1, t1)
            pulled += _share(phase_bytes, t0, pull_ends, lo, hi)
            pushed += _share(phase_bytes, push_starts, t2, lo, hi)
            used += _overlap(t0, t2, lo, hi) > 0
    return Window(pulled / (hi - lo), pushed / (hi - lo), hi - lo, used)
