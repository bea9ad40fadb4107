"""``ServerLimits``: every resource a request can make a task hold, capped, in one typed place.

Each layer enforces its own part (the codec: sizes, counts and nesting of messages; the RPC
server: deadlines and requests in flight per peer; the shard store, catalog and tables: elements,
bytes and counts of variables); this dataclass is what an operator sets, on ``AsyncServer`` and
``Server`` (``limits=``) or with ``zmqflow serve`` flags. A refusal is ``ResourceExhausted``
naming the thing at fault and the limit, and changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..rpc.dedup import MAX_KEPT_BYTES, MAX_PEER_KEPT_BYTES
from ..rpc.server import MAX_DEADLINE, MAX_IN_FLIGHT
from ..state.limits import DEFAULT_STATE_LIMITS, StateLimits, physical_memory
from .services.worker import MAX_RUN_THREADS
from ..wire.codec import DEFAULT_LIMITS, Limits

__all__ = ["ServerLimits", "ROUTER_HEADROOM"]

# How far over the codec's frame limit libzmq's MAXMSGSIZE sits on the task's ROUTER: frames in
# between are answered with ResourceExhausted; bigger ones are cut by libzmq (a disconnect).
ROUTER_HEADROOM = 64 << 20
MAX_ZMQ_SIZE = (1 << 63) - 1  # libzmq takes MAXMSGSIZE as int64

_W, _S = DEFAULT_LIMITS, DEFAULT_STATE_LIMITS


@dataclass(frozen=True)
class ServerLimits:
    """Limits of one task server; the defaults let real models through (a single tensor of
    several GiB, a 10M x 64 table over four shards, 64 MiB frames)."""

    # requests (rpc/server.py)
    max_deadline: float = MAX_DEADLINE  # seconds any request may run; the deadline of one naming none
    max_in_flight: int = MAX_IN_FLIGHT  # handlers one peer may have running at once
    # plain functions worker.run has running on threads, counted until each thread ends: a
    # deadline cancels the call, not the thread (server/services/worker.py)
    max_run_threads: int = MAX_RUN_THREADS
    # bytes of replies kept to answer retries (rpc/dedup.py): in all, and per peer (routing identity)
    max_kept_bytes: int = MAX_KEPT_BYTES
    max_peer_kept_bytes: int = MAX_PEER_KEPT_BYTES
    # messages (wire/codec.py; the router's MAXMSGSIZE follows max_frame_bytes)
    max_frame_bytes: int = _W.max_frame_bytes
    max_message_bytes: int = _W.max_message_bytes
    max_header_bytes: int = _W.max_header_bytes
    max_frames: int = _W.max_frames
    max_container_len: int = _W.max_container_len
    max_depth: int = _W.max_depth
    # state (state/limits.py)
    max_variable_elements: int = _S.max_variable_elements
    max_variable_bytes: int = _S.max_variable_bytes
    max_shard_bytes: int = field(default_factory=physical_memory)
    max_variables: int = _S.max_variables
    table_capacity: int = _S.table_capacity
    max_table_capacity: int = _S.max_table_capacity
    max_pending_admission: int = _S.max_pending_admission

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"ServerLimits.{f.name} must be a positive finite number, got {value!r}")

    @classmethod
    def from_wire(cls, limits: Limits) -> "ServerLimits":
        """The defaults, with the codec's limits taken from ``limits``."""
        return cls(**{f.name: getattr(limits, f.name) for f in dataclasses.fields(Limits)})

    def wire(self) -> Limits:
        return Limits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Limits)})

    def state(self) -> StateLimits:
        return StateLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StateLimits)})

    @property
    def router_max_msg_bytes(self) -> int:
        """libzmq's per-frame cap on the task's ROUTER: a bit over the largest frame the codec takes."""
        return min(max(self.max_frame_bytes, self.max_header_bytes) + ROUTER_HEADROOM, MAX_ZMQ_SIZE)
