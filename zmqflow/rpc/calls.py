"""What a client keeps per peer and per call in flight, and the errors a call can end with.

Plain records and message texts, apart from the client that drives them, so that each error names
the peer, the op and (for keys) the key directory at fault in one place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..errors import ProtocolError, Unauthenticated, Unavailable, VersionMismatch
from ..transport.base import CONNECTING, Connection
from ..transport.curve import Keys
from ..wire import DecodeError

__all__ = ["Peer", "Pending", "protocol_error", "unauthenticated", "unreachable"]


@dataclass(eq=False)
class Peer:
    """The connection to one peer and what is in flight on it."""

    endpoint: str
    name: str
    conn: Connection = field(init=False)
    state: str = CONNECTING  # as last reported by the connection; only DOWN changes what a call does
    down_since: float = 0.0
    inflight: set[int] = field(default_factory=set)
    # set while the connection is up; a call made while it is down waits for it before sending:
    # a message written just after a drop can land in the dead pipe, unseen by either side
    up: asyncio.Event = field(default_factory=asyncio.Event)
    batching: bool = True  # small requests may share an envelope (off once the peer refused one)


@dataclass(slots=True)
class Pending:
    """One call in flight: its future, where it went, and whether it has left this process."""

    future: asyncio.Future
    peer: Peer
    service: str
    op: str
    sent: bool = False
    retry: asyncio.TimerHandle | None = None
    timeout: float = 0.0
    batch: int = 0  # the envelope it went out in, until the peer answers anything of it

    @property
    def what(self) -> str:
        """``service.op on peer`` for messages: formatted only when one is written, not per call."""
        return f"{self.service}.{self.op} on {self.peer.name}"


def unauthenticated(pending: Pending, keys: Keys | None) -> Unauthenticated:
    """Why a call to a peer that refused the handshake fails, naming the key at fault."""
    peer = pending.peer
    if keys is None:
        why = (f"{peer.name} requires CurveZMQ keys and this process has none "
               "(pass keys=DIR or set ZMQFLOW_KEYS=DIR)")
    else:
        why = (f"{peer.name} refused this process's key ({keys.role} {keys.name!r} from "
               f"{keys.directory}): the key is not on its allow-list, its own key is not the one this "
               "directory lists for it, or it runs without keys")
    return Unauthenticated(f"authentication failed: {why}; {pending.what} was not sent", task=peer.name)


def unreachable(pending: Pending, waited: float) -> Unavailable:
    """A call that never left: its peer was not reached within ``waited`` seconds."""
    peer = pending.peer
    where = peer.name if peer.name == peer.endpoint else f"{peer.name} at {peer.endpoint}"
    # a transport that resolves host names (ZeroMQ tcp) says when that is why the peer is not up
    host = getattr(peer.conn, "unresolved", None)
    if host:
        return Unavailable(f"{where} could not be reached within {waited:g}s: host {host} does not resolve; "
                           f"{pending.what} not sent", task=peer.name, host=host)
    return Unavailable(f"{where} could not be reached within {waited:g}s; {pending.what} not sent", task=peer.name)


def protocol_error(exc: DecodeError, pending: Pending) -> ProtocolError:
    """An unreadable reply to a call, as the call's error."""
    cls = VersionMismatch if isinstance(exc, VersionMismatch) else ProtocolError
    return cls(f"bad reply to {pending.what}: {exc}", task=pending.peer.name)
