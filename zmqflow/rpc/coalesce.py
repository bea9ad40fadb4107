"""Which small messages for one peer go out together, sans-IO: the caller sends and schedules.

A peer's first small message of a loop tick goes out at once, alone (a lone call waits for
nothing); the caller then schedules :meth:`Coalescer.end_tick` for the next tick (``call_soon``),
and every small message for that peer until then is held and handed back there, to go out as
one batch envelope (:mod:`..wire.batch`). A held group that would pass ``max_entries`` or
``max_bytes`` is handed back at once instead. Large messages never enter: the caller sends what
is held first (:meth:`take`, so the peer sees messages in the order they were made) and then the
large one, without waiting for the tick.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

__all__ = ["Coalescer", "SMALL_BYTES", "MAX_ENTRIES", "MAX_BYTES"]

SMALL_BYTES = 8 << 10  # a message (all its frames) up to this size may wait a tick for company
MAX_ENTRIES = 32  # per envelope sent (receivers accept more: wire.batch.BatchLimits); small enough that
# the receiver works on one envelope while the sender fills the next: ~2x the calls/s of 256 here
MAX_BYTES = 256 << 10


class _Tick:
    __slots__ = ("items", "nbytes")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.nbytes = 0


class Coalescer:
    """Per-peer groups of held small messages; O(1) per message."""

    def __init__(self, *, small_bytes: int = SMALL_BYTES, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        if small_bytes < 0 or max_entries < 2 or max_bytes < small_bytes:
            raise ValueError(f"need small_bytes >= 0, max_entries >= 2 and max_bytes >= small_bytes, got "
                             f"{small_bytes}, {max_entries}, {max_bytes}")
        self.small_bytes = small_bytes
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._ticks: dict[Hashable, _Tick] = {}

    def small(self, nbytes: int) -> bool:
        return nbytes <= self.small_bytes

    def add(self, peer: Hashable, item: Any, nbytes: int) -> tuple[list[Any] | None, bool]:
        """Offer a small message: (items to send now, whether to schedule ``end_tick(peer)``).

        Alone in its tick: ``([item], True)``, send it by itself. Else it is held: ``(None, False)``,
        or, when the held group is full, ``(group, False)``: send that group now; ``item`` is held."""
        tick = self._ticks.get(peer)
        if tick is None:
            self._ticks[peer] = _Tick()
            return [item], True
        items = tick.items
        if items and (len(items) >= self.max_entries or tick.nbytes + nbytes > self.max_bytes):
            full = items
            tick.items = [item]
            tick.nbytes = nbytes
            return full, False
        items.append(item)
        tick.nbytes += nbytes
        return None, False

    def hold(self, peer: Hashable) -> bool:
        """Open a tick for ``peer`` so that its next small messages are all held (a server answering a
        batch holds its replies and sends them with :meth:`end_tick`); False when one is open already."""
        if peer in self._ticks:
            return False
        self._ticks[peer] = _Tick()
        return True

    def take(self, peer: Hashable) -> list[Any]:
        """What is held for ``peer`` now (the tick stays open)."""
        tick = self._ticks.get(peer)
        if tick is None or not tick.items:
            return []
        items = tick.items
        tick.items = []
        tick.nbytes = 0
        return items

    def end_tick(self, peer: Hashable) -> list[Any]:
        """Close ``peer``'s tick; what was held, to send: one item alone, several as one batch."""
        tick = self._ticks.pop(peer, None)
        return [] if tick is None else tick.items

    def held(self, peer: Hashable) -> int:
        tick = self._ticks.get(peer)
        return 0 if tick is None else len(tick.items)
