"""Socket options, chosen on purpose; every value here has a reason written beside it."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

__all__ = ["SocketOptions", "DEFAULT_OPTIONS", "apply_common", "apply_router", "apply_dealer"]


@dataclass(frozen=True, slots=True)
class SocketOptions:
    # LINGER 0: close() must never block process exit on a peer that is gone. Delivery at
    # shutdown is guaranteed by replies, not by lingering (LINGER does not guarantee it anyway).
    linger_ms: int = 0
    # High-water marks count messages, not bytes. We size them from a byte budget per peer and
    # the largest message we send (tensors are sliced to ``slice_bytes`` by the layers above).
    byte_budget: int = 1 << 30
    slice_bytes: int = 4 << 20
    # ZMTP heartbeats: a stopped or partitioned peer is declared disconnected after
    # ``heartbeat_timeout_ms`` instead of staying "routable" for minutes. The ZeroMQ I/O thread
    # answers pings without the GIL, so a busy Python peer is not mistaken for a dead one.
    heartbeat_ivl_ms: int = 500
    heartbeat_timeout_ms: int = 1500
    heartbeat_ttl_ms: int = 1500
    # Reconnect quickly after a restart, backing off to at most 250 ms for peers that stay away:
    # a restarted task is back within a quarter second of serving (a connect attempt costs little).
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 250
    # Hard cap on one frame, enforced by libzmq (the peer is disconnected past it). The codec's
    # own limit is lower, so an oversized frame below this cap still gets an error reply.
    max_msg_bytes: int = 4 << 30
    # The task's ROUTER takes frames from anyone: its cap is a bit over the codec's largest frame
    # (2 GiB, a whole part in a create or restore), so a frame just over that limit still gets an
    # error reply and a larger one is cut by libzmq before it is buffered. The cap is per frame
    # (libzmq checks each frame's size prefix); the codec bounds the message as a whole.
    router_max_msg_bytes: int = (2 << 30) + (64 << 20)
    # libzmq caps each part's size, not a message's part count: a peer could send millions of
    # empty parts. A channel keeps at most this many parts of a message (the rest are read and
    # dropped, with no object each); it is above the codec's frame limit (4096) plus a router's
    # routing id, so a message cut here is one the codec refuses anyway, naming its limit.
    max_msg_parts: int = 4098
    # Frames below this size are copied by pyzmq (faster than pinning a buffer); above it they
    # travel zero-copy. 64 KiB is libzmq's and pyzmq's measured crossover.
    copy_threshold: int = zmq.COPY_THRESHOLD

    @property
    def hwm(self) -> int:
        return max(64, self.byte_budget // self.slice_bytes)


DEFAULT_OPTIONS = SocketOptions()


def apply_common(sock: zmq.Socket, opts: SocketOptions) -> None:
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.hwm)
    sock.setsockopt(zmq.RCVHWM, opts.hwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, opts.heartbeat_ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.heartbeat_timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, opts.heartbeat_ttl_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_msg_bytes)
    sock.copy_threshold = opts.copy_threshold


def apply_router(sock: zmq.Socket, opts: SocketOptions) -> None:
    """The task's ROUTER: refuse silent drops, and let a restarted peer take its identity back."""
    apply_common(sock, opts)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.router_max_msg_bytes)
    # ROUTER_MANDATORY: a reply to a peer that is gone raises EHOSTUNREACH (counted) instead of
    # vanishing; a full pipe raises Again instead of dropping.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # ROUTER_HANDOVER: a peer that restarts with the same routing id takes over the old
    # connection instead of being locked out while the ROUTER still holds the dead one.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)


def apply_dealer(sock: zmq.Socket, opts: SocketOptions, identity: bytes) -> None:
    """A DEALER to one peer: queue only on a live connection, reconnect fast."""
    apply_common(sock, opts)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    # IMMEDIATE: do not queue requests into a connection that is not up; a send to a peer
    # that is down fails with Again, so the caller learns "unavailable" instead of having
    # stale requests delivered after their deadline.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, opts.reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, opts.reconnect_ivl_max_ms)
