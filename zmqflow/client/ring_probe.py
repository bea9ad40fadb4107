"""What a ring call shows besides its result: timeline spans, and who it waited for.

Each rank knows when each peer's data reached it. In the one-step exchange (small buckets) that is
every other rank's deposit; in the ring it is the left neighbour's first chunk, which the left sends
as soon as its call starts. Those arrivals, beside this rank's own start, feed a
:class:`~zmqflow.observe.stragglers.StragglerDetector` per ring: a slow rank is named by the ranks it
held up (in the ring, by its right neighbour). A deposit that was already waiting when this rank
started arrived "at the start": only lateness is measured, never earliness.
"""

from __future__ import annotations

import asyncio
import time

from ..observe import stragglers, timeline

__all__ = ["RingWatch", "CallProbe"]


class CallProbe:
    """One call's arrivals: this rank at its start, each peer when its first data was taken."""

    __slots__ = ("watch", "arrivals")

    def __init__(self, watch: "RingWatch", me: str):
        self.watch = watch
        self.arrivals = {me: time.monotonic()}

    def arrived(self, member: str) -> None:
        self.arrivals.setdefault(member, time.monotonic())

    def done(self) -> None:
        if len(self.arrivals) < 2:
            return
        found = self.watch.detector.observe(self.arrivals)
        if found is not None:
            stragglers.report(found)


class RingWatch:
    """A ring's straggler detector, and its timeline tracks (``ring``, ``ring wait``, ``ring send``,
    ``ring reduce`` on the ring's own task)."""

    def __init__(self, ring: str, task: str):
        self.task = task
        self.detector = stragglers.StragglerDetector(f"ring {ring!r}")

    def call(self) -> CallProbe:
        return CallProbe(self, self.task)

    def span(self, kind: str, name: str | None = None) -> object:
        return timeline.span(kind, name, self.task)

    def track_send(self, fut: asyncio.Future, seq: int, to: str) -> None:
        """A ``ring send`` span from now until ``fut`` (a deposit) is acknowledged; nothing when off."""
        if not timeline.enabled():
            return
        start = timeline.now_us()
        fut.add_done_callback(lambda f: timeline.complete("ring send", "send", start, self.task, {"seq": seq, "to": to}))
