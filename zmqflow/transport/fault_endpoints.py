"""The fault injector's endpoints: a connection and a listener that hand each message to it.

They wrap the inner transport's endpoints. Every send goes to the ``Router`` (the injector) which
decides what happens to it; a cut makes the connection report down, refuse sends, and lose what
arrives or was delayed across it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .base import DOWN, UP, Connection, Listener, OnFrames, OnState, SendFailed

__all__ = ["FaultyConnection", "FaultyListener", "Path", "Router"]

_POLL_S = 0.005  # a send waiting for room re-routes at this pace (the injector serves tests only)
Deliver = Callable[[Sequence[Any], int], bool]


class Path:
    """One direction of one client-server pair: where a reordered message waits for the next."""

    __slots__ = ("reordered",)

    def __init__(self) -> None:
        self.reordered: list[Callable[[], None]] = []


class Router(Protocol):
    """What the endpoints need of the injector."""

    def request_packet(self, conn: "FaultyConnection", frames: Sequence[Any]) -> Any: ...
    def reply_packet(self, listener: "FaultyListener", identity: bytes, frames: Sequence[Any]) -> Any: ...
    def route(self, packet: Any, path: Path, later: Deliver, epoch: int, now: Callable[[Sequence[Any]], bool]) -> bool: ...
    def is_cut(self, endpoint: str, identity: bytes) -> bool: ...
    def epoch_of(self, endpoint: str, identity: bytes) -> int: ...
    def forget(self, conn: "FaultyConnection") -> None: ...
    def unbind(self, listener: "FaultyListener") -> None: ...


class FaultyConnection:
    """A client's connection seen through the injector."""

    def __init__(self, net: "Router", endpoint: str, identity: bytes, name: str, on_frames: OnFrames,
                 on_state: OnState, loop: asyncio.AbstractEventLoop):
        self.endpoint, self.identity, self.name = endpoint, identity, name
        self._net, self._loop = net, loop
        self._on_frames, self._on_state = on_frames, on_state
        self.path = Path()
        self.inner: Connection | None = None
        self.cut = False
        self.epoch = 0  # bumped by each cut: what was delayed across it is lost
        self._uncut = asyncio.Event()
        self._uncut.set()

    def bind(self, inner: Connection) -> None:
        self.inner = inner

    def on_inner_frames(self, frames: list[Any]) -> None:
        if not self.cut:
            self._on_frames(frames)

    def on_inner_state(self, state: str) -> None:
        if not self.cut:
            self._on_state(state)

    def set_cut(self, cut: bool, *, report: bool = True) -> None:
        if cut == self.cut:
            return
        self.cut = cut
        if cut:
            self.epoch += 1
            self._uncut.clear()
            if report:
                self._on_state(DOWN)
        else:
            self._uncut.set()
            if self.inner is not None and self.inner.state == UP:
                self._on_state(UP)

    def send_now(self, frames: Sequence[Any], epoch: int) -> bool:
        """The inner send, unless a cut came between (then the message is lost, as on a real drop)."""
        if self.cut or epoch != self.epoch or self.inner is None:
            return True
        try:
            return self.inner.try_send(frames)
        except SendFailed:
            return True

    def try_send(self, frames: Sequence[Any]) -> bool:
        if self.cut:
            return False
        assert self.inner is not None
        packet = self._net.request_packet(self, frames)
        return self._net.route(packet, self.path, self.send_now, self.epoch, self.inner.try_send)

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        while True:
            if self.try_send(frames):
                return True
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            if self.cut:
                try:
                    await asyncio.wait_for(self._uncut.wait(), remaining)
                except TimeoutError:
                    return False
            else:  # the inner connection is not up yet: let it wait (then route again)
                await asyncio.sleep(min(remaining, _POLL_S))

    @property
    def monitored(self) -> bool:
        return True

    @property
    def state(self) -> str:
        if self.cut:
            return DOWN
        assert self.inner is not None
        return self.inner.state

    def refresh(self) -> bool:
        return self.inner.refresh() if self.inner is not None else False

    def close(self) -> None:
        self._net.forget(self)
        if self.inner is not None:
            self.inner.close()


class FaultyListener:
    """A server's listener seen through the injector."""

    def __init__(self, net: "Router", endpoint: str, name: str, on_frames: OnFrames):
        self.endpoint = endpoint
        self.name = name
        self._net = net
        self._on_frames = on_frames
        self.inner: Listener | None = None
        self._paths: dict[bytes, Path] = {}

    def bind(self, inner: Listener) -> None:
        self.inner = inner

    def on_inner_frames(self, frames: list[Any]) -> None:
        if not self._net.is_cut(self.endpoint, bytes(frames[0])):
            self._on_frames(frames)

    def send_now(self, frames: Sequence[Any], epoch: int) -> bool:
        if self.inner is None or self._net.epoch_of(self.endpoint, bytes(frames[0])) != epoch:
            return True
        try:
            return self.inner.try_send(frames)
        except SendFailed:
            return True

    def try_send(self, frames: Sequence[Any]) -> bool:
        assert self.inner is not None
        identity = bytes(frames[0])
        if self._net.is_cut(self.endpoint, identity):
            raise SendFailed(f"{self.endpoint}: peer {identity!r} is disconnected (injected)")
        packet = self._net.reply_packet(self, identity, frames)
        path = self._paths.setdefault(identity, Path())
        return self._net.route(packet, path, self.send_now, self._net.epoch_of(self.endpoint, identity), self.inner.try_send)

    async def send(self, frames: Sequence[Any], deadline: float) -> bool:
        while not self.try_send(frames):
            if self._loop_time() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def closed(self) -> bool:
        return self.inner is None or self.inner.closed

    def close(self) -> None:
        self._net.unbind(self)
        if self.inner is not None:
            self.inner.close()
