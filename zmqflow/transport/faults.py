"""A fault-injecting transport: drop, delay, duplicate, reorder, hold, and disconnect, by rule.

``FaultInjector`` wraps another transport (by default a private ``LocalTransport``) and looks at
every message on its way out: requests as a connection sends them, replies as a listener does. Each
message is matched against the rules in the order they were added; the first live rule that
matches acts on it, and a message no rule matches goes through untouched. A rule matches on the
direction, the op (``"ps.push"`` or ``"push"``), the server (its endpoint or task name), the client
(identity or source), and any predicate on the ``Packet``; it can skip the first matches, fire a
number of times, and fire with a probability drawn from ``random.Random(seed)``, so a seeded run
injects the same faults into the same messages every time. That is ps-lite's drop switch, aimed:
"drop the first reply to ps.push", "delay requests to ps:1 by 0.2 s", "hold this push until the
shard is fenced". ``disconnect`` cuts a server off from its clients (or one of them): their
connections report down, sends to it are refused, replies and messages in flight are lost, and
``reconnect`` brings it back as a restart would.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .base import OnFrames, OnState, Transport
from .fault_endpoints import Deliver, FaultyConnection, FaultyListener, Path
from .local import LocalTransport
from .options import SocketOptions

__all__ = ["FaultInjector", "Packet", "Rule", "REQUEST", "REPLY"]

REQUEST, REPLY = "request", "reply"
_ACTIONS = ("drop", "delay", "duplicate", "reorder", "hold")


@dataclass(frozen=True, slots=True)
class Packet:
    """What a rule sees of a message. A reply's service and op are those of its request."""

    direction: str  # REQUEST (client -> server) or REPLY (server -> client)
    endpoint: str  # the server's endpoint
    server: str  # the server's task name where known, else its endpoint
    client: str  # the client's routing identity
    source: str  # the requesting client's declared source ("" when none)
    kind: str | None  # the header's kind: "req", "rep", "err"; None when unreadable
    id: int | None
    service: str | None
    op: str | None
    frames: tuple[Any, ...]

    @property
    def what(self) -> str:
        return f"{self.service}.{self.op}"


@dataclass(eq=False)
class Rule:
    """One fault: ``action`` on the messages ``when`` accepts, after ``skip``, ``times`` at most."""

    action: str
    when: Callable[[Packet], bool]
    seconds: float = 0.0
    times: int | None = None
    skip: int = 0
    probability: float = 1.0
    seen: int = 0  # messages that matched
    fired: int = 0  # messages acted on
    held: list[Callable[[], None]] = field(default_factory=list)
    active: bool = True

    @property
    def spent(self) -> bool:
        return not self.active or (self.times is not None and self.fired >= self.times)

    def release(self) -> int:
        """Let the messages a ``hold`` rule parked go on (in order); returns how many. Holds no more."""
        self.active = False
        held, self.held = self.held, []
        for go in held:
            go()
        return len(held)

    def cancel(self) -> None:
        """Stop acting (messages already parked or delayed stay so)."""
        self.active = False


def _header(frame: Any) -> dict:
    try:
        head = msgpack.unpackb(bytes(memoryview(frame)), raw=False, strict_map_key=False)
    except Exception:  # a malformed message is the RPC layer's to judge, not ours
        return {}
    return head if isinstance(head, dict) else {}


def _send_if_still_waiting(path: Path, go: Callable[[], None]) -> None:
    """A reordered message that no later one overtook goes on its own."""
    if go in path.reordered:
        path.reordered.remove(go)
        go()


def _matcher(direction: str | None, op: str | None, server: str | None, client: str | None,
             when: Callable[[Packet], bool] | None) -> Callable[[Packet], bool]:
    def match(p: Packet) -> bool:
        if direction is not None and p.direction != direction:
            return False
        if op is not None and op != p.op and op != p.what:
            return False
        if server is not None and server not in (p.server, p.endpoint):
            return False
        if client is not None and client not in (p.client, p.source):
            return False
        return when is None or bool(when(p))

    return match



class FaultInjector:
    """A transport that injects the faults its rules describe into ``inner``'s traffic.

    Rules are added with ``drop``, ``delay``, ``duplicate``, ``reorder`` and ``hold`` (each returns
    its ``Rule``: count what it did, ``release`` what it holds, ``cancel`` it). Matching keywords:
    ``direction`` (REQUEST or REPLY), ``op`` (``"ps.push"`` or ``"push"``), ``server`` (endpoint or
    task name), ``client`` (identity or source), ``when`` (any predicate on the Packet), ``skip``
    (let the first n matches pass), ``times`` (act at most n times), ``probability`` (drawn from
    the injector's seeded generator). ``log`` lists every (action, Packet) in order.
    """

    envelopes = False  # its rules act on one request at a time: clients send each alone, never batched

    def __init__(self, inner: Transport | None = None, *, seed: int = 0):
        self.inner: Transport = inner if inner is not None else LocalTransport()
        self.rng = random.Random(seed)
        self.rules: list[Rule] = []
        self.log: list[tuple[str, Packet]] = []
        self._names: dict[str, str] = {}  # endpoint -> the task name it was bound for
        self._listeners: dict[str, FaultyListener] = {}
        self._conns: dict[tuple[str, bytes], list[FaultyConnection]] = {}
        self._calls: dict[tuple[str, bytes, int], tuple[str | None, str | None, str]] = {}
        self._cuts: list[tuple[str, str | None]] = []

    # rules --------------------------------------------------------------------------------
    def add(self, action: str, *, seconds: float = 0.0, direction: str | None = None, op: str | None = None,
            server: str | None = None, client: str | None = None, when: Callable[[Packet], bool] | None = None,
            skip: int = 0, times: int | None = None, probability: float = 1.0) -> Rule:
        if action not in _ACTIONS:
            raise ValueError(f"unknown fault {action!r}; use one of {', '.join(_ACTIONS)}")
        if direction not in (None, REQUEST, REPLY):
            raise ValueError(f"direction must be {REQUEST!r} or {REPLY!r}, got {direction!r}")
        rule = Rule(action, _matcher(direction, op, server, client, when), seconds, times, skip, probability)
        self.rules.append(rule)
        return rule

    def drop(self, **match: Any) -> Rule:
        """Lose the matching messages (the sender thinks they went)."""
        return self.add("drop", **match)

    def delay(self, seconds: float, **match: Any) -> Rule:
        """Deliver the matching messages ``seconds`` later (lost if their connection drops meanwhile)."""
        return self.add("delay", seconds=seconds, **match)

    def duplicate(self, **match: Any) -> Rule:
        """Deliver the matching messages twice, back to back."""
        return self.add("duplicate", **match)

    def reorder(self, seconds: float = 1.0, **match: Any) -> Rule:
        """Hold each matching message back until the next one on its path has gone (so the two
        arrive swapped), or ``seconds`` at most when none follows."""
        return self.add("reorder", seconds=seconds, **match)

    def hold(self, **match: Any) -> Rule:
        """Park the matching messages until ``rule.release()``: a message in flight for as long
        as the test needs, across whatever the test does meanwhile."""
        return self.add("hold", **match)

    def clear(self) -> None:
        """Remove every rule (what they hold stays held until released)."""
        self.rules.clear()

    # disconnects --------------------------------------------------------------------------
    def disconnect(self, server: str, *, client: str | None = None, for_s: float | None = None) -> int:
        """Cut ``server`` (endpoint or task name) off from its clients (or from ``client`` only):
        their connections report down at once, what is in flight is lost, new sends are refused,
        the server cannot reach them. After ``for_s`` (or at ``reconnect``) they come back up."""
        self._cuts.append((server, client))
        conns = self._matching(server, client)
        for conn in conns:
            conn.set_cut(True)
        if for_s is not None:
            asyncio.get_running_loop().call_later(for_s, functools.partial(self.reconnect, server, client=client))
        return len(conns)

    def reconnect(self, server: str, *, client: str | None = None) -> int:
        """Undo ``disconnect``: the connections come back up, as after a restart."""
        self._cuts = [c for c in self._cuts if c != (server, client)]
        conns = [c for c in self._matching(server, client) if not self._cut_by_rule(c)]
        for conn in conns:
            conn.set_cut(False)
        return len(conns)

    def _matching(self, server: str, client: str | None) -> list[FaultyConnection]:
        out = []
        for (endpoint, identity), conns in self._conns.items():
            names = (endpoint, self._names.get(endpoint))
            if (server in names or any(server == c.name for c in conns)) and (client is None or client == identity.decode(errors="replace")):
                out.extend(conns)
        return out

    def _cut_by_rule(self, conn: FaultyConnection) -> bool:
        names = (conn.endpoint, conn.name, self._names.get(conn.endpoint))
        who = conn.identity.decode(errors="replace")
        return any(server in names and client in (None, who) for server, client in self._cuts)

    # the Router the endpoints call ---------------------------------------------------------
    def request_packet(self, conn: FaultyConnection, frames: Sequence[Any]) -> Packet:
        head = _header(frames[0]) if frames else {}
        rid, svc, op, src = head.get("id"), head.get("svc"), head.get("op"), head.get("src") or ""
        if isinstance(rid, int):
            self._calls[(conn.endpoint, conn.identity, rid)] = (svc, op, src)
        server = self._names.get(conn.endpoint, conn.name)
        return Packet(REQUEST, conn.endpoint, server, conn.identity.decode(errors="replace"), src, head.get("k"), rid,
                      svc, op, tuple(frames))

    def reply_packet(self, listener: FaultyListener, identity: bytes, frames: Sequence[Any]) -> Packet:
        head = _header(frames[1]) if len(frames) > 1 else {}
        rid = head.get("id")
        svc, op, src = self._calls.get((listener.endpoint, identity, rid), (None, None, "")) if isinstance(rid, int) else (None, None, "")
        return Packet(REPLY, listener.endpoint, listener.name, identity.decode(errors="replace"), src, head.get("k"), rid,
                      svc, op, tuple(frames))

    def route(self, packet: Packet, path: Path, later: Deliver, epoch: int, now: Callable[[Sequence[Any]], bool]) -> bool:
        """Act on one outgoing message; True when it counts as sent."""
        rule = self._rule_for(packet)
        frames = list(packet.frames)
        if rule is None:
            if not now(frames):
                return False
            while path.reordered:  # what was held back goes right behind this one
                path.reordered.pop(0)()
            return True
        self.log.append((rule.action, packet))
        loop = asyncio.get_running_loop()
        go = lambda: later(frames, epoch)  # noqa: E731 - a parked delivery
        if rule.action == "delay":
            loop.call_later(rule.seconds, go)
        elif rule.action == "duplicate":
            if not now(frames):
                return False
            go()
        elif rule.action == "reorder":
            path.reordered.append(go)
            loop.call_later(rule.seconds, _send_if_still_waiting, path, go)
        elif rule.action == "hold":
            rule.held.append(go)
        return True  # dropped, or on its way later

    def _rule_for(self, packet: Packet) -> Rule | None:
        for rule in self.rules:
            if rule.spent or not rule.when(packet):
                continue
            rule.seen += 1
            if rule.seen <= rule.skip:
                continue
            if rule.probability < 1.0 and self.rng.random() >= rule.probability:
                continue
            rule.fired += 1
            return rule
        return None

    def is_cut(self, endpoint: str, identity: bytes) -> bool:
        return any(c.cut for c in self._conns.get((endpoint, identity), ()))

    def epoch_of(self, endpoint: str, identity: bytes) -> int:
        return max((c.epoch for c in self._conns.get((endpoint, identity), ())), default=0)

    def forget(self, conn: FaultyConnection) -> None:
        conns = self._conns.get((conn.endpoint, conn.identity), [])
        if conn in conns:
            conns.remove(conn)
        if not conns:
            self._conns.pop((conn.endpoint, conn.identity), None)

    def unbind(self, listener: FaultyListener) -> None:
        if self._listeners.get(listener.endpoint) is listener:
            del self._listeners[listener.endpoint]

    def open_count(self) -> tuple[int, int]:
        """(listeners, connections) still open through the injector."""
        return len(self._listeners), sum(map(len, self._conns.values()))

    # the Transport ------------------------------------------------------------------------
    async def listen(
        self, endpoint: str, on_frames: OnFrames, *, loop: asyncio.AbstractEventLoop, options: SocketOptions, name: str
    ) -> FaultyListener:
        listener = FaultyListener(self, endpoint, name, on_frames)
        listener.bind(await self.inner.listen(endpoint, listener.on_inner_frames, loop=loop, options=options, name=name))
        listener.endpoint = endpoint  # the key clients know it by
        self._listeners[endpoint] = listener
        self._names[endpoint] = name
        return listener

    def connect(
        self,
        endpoint: str,
        identity: bytes,
        on_frames: OnFrames,
        on_state: OnState,
        *,
        loop: asyncio.AbstractEventLoop,
        options: SocketOptions,
        name: str,
    ) -> FaultyConnection:
        conn = FaultyConnection(self, endpoint, identity, name, on_frames, on_state, loop)
        conn.bind(self.inner.connect(endpoint, identity, conn.on_inner_frames, conn.on_inner_state,
                                     loop=loop, options=options, name=name))
        self._conns.setdefault((endpoint, identity), []).append(conn)
        if self._cut_by_rule(conn):
            conn.set_cut(True, report=False)
        return conn
