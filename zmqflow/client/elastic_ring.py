"""Rings whose membership re-forms when a rank dies or returns.

``ElasticRing`` (and ``AsyncElasticRing``) re-form: each generation of members, agreed through
the ring services' rendezvous (:mod:`zmqflow.server.services.rendezvous`), gets a fresh ring named by its
generation, so chunks of an old generation never mix into a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cluster import TaskId
from ..errors import ConfigError
from ..observe import timeline
from ..server.services.rendezvous import Formation, Rendezvous, join_next_generation
from ..server.task import AsyncServer, Server
from .ring import AsyncRing, default_members
from .ring_blocking import Ring

__all__ = ["ElasticRing", "AsyncElasticRing", "Formation", "DEFAULT_JOIN_WINDOW"]

DEFAULT_JOIN_WINDOW = 10.0

class AsyncElasticRing:
    """A ring whose membership re-forms. ``form(step)`` joins the next generation (blocking until
    the coordinator closes it) and leaves ``ring`` an :class:`AsyncRing` over its members; the
    caller then copies the holder's state to everyone. All ranks of ``members`` (by default the
    chief and the workers) share one ring service rendezvous per task. A member that does not join
    within ``join_window`` seconds of the first (``first_join_window`` before the first formation)
    is left out, and joins the next generation."""

    def __init__(self, server: AsyncServer, members: Sequence["TaskId | str"] | None = None, *, name: str = "elastic",
                 join_window: float = DEFAULT_JOIN_WINDOW, first_join_window: float | None = None, **ring_kwargs: Any):
        self.server = server
        self.universe = [TaskId.parse(m) for m in members] if members is not None else default_members(server.spec)
        if server.task not in self.universe:
            raise ConfigError(f"task {server.task} is not a member of the ring ({', '.join(map(str, self.universe))})")
        self.name = name
        self.ring_kwargs = ring_kwargs
        self.ring: AsyncRing | None = None
        self.formation: Formation | None = None
        self.state: Rendezvous = server.service("ring").rendezvous
        self.state.configure(str(server.task), [str(t) for t in self.universe], server.client, server.spec,
                             join_window, first_join_window)

    @timeline.traced("ring", "negotiate")
    async def form(self, step: int, timeout: float) -> Formation:
        """Join the next generation; ``step`` is how far this replica is (-1: none worth keeping)."""
        formation = await join_next_generation(self.state, step, timeout)
        old = self.ring
        self.ring = AsyncRing(self.server, formation.members, name=f"{self.name}/g{formation.generation}",
                              **self.ring_kwargs)  # each generation agrees on its own same-host path
        self.formation = formation
        if old is not None:
            old.release()
            self.server.service("ring").retire(old.name)
        return formation

    @property
    def generation(self) -> int:
        return self.formation.generation if self.formation else 0

    @property
    def members(self) -> list[TaskId]:
        return [TaskId.parse(m) for m in self.formation.members] if self.formation else []

    @property
    def leader(self) -> TaskId | None:
        """The lowest-index member of the current generation: its coordinator."""
        return TaskId.parse(self.formation.members[0]) if self.formation else None

    @property
    def holder_rank(self) -> int:
        """The rank whose state the others adopt after this formation."""
        assert self.formation is not None
        return self.formation.members.index(self.formation.holder)

    def joiners(self) -> int:
        """Ranks waiting to join, as the leader counts them (0 on the other ranks)."""
        return self.state.waiting if self.leader == self.server.task else 0

    async def leave(self, timeout: float = 5.0) -> None:
        """Tell the current generation's members this rank is done (see :meth:`AsyncRing.leave`)."""
        if self.ring is not None:
            await self.ring.leave(timeout)

    def close(self) -> None:
        """Training is over here: refuse joins and drop the last generation's boxes."""
        self.state.close()
        if self.ring is not None:
            self.ring.release()
            self.server.service("ring").retire(self.ring.name)


class ElasticRing:
    """The blocking :class:`AsyncElasticRing` on a :class:`Server`; ``ring`` is a blocking :class:`Ring`."""

    def __init__(self, server: Server, members: Sequence["TaskId | str"] | None = None, **kwargs: Any):
        self._server = server

        async def make() -> AsyncElasticRing:  # the rendezvous state belongs to the loop thread
            return AsyncElasticRing(server.async_server, members, **kwargs)

        self._async: AsyncElasticRing = server.loop_thread.call(make(), timeout=10.0)
        self.ring: Ring | None = None

    generation = property(lambda self: self._async.generation)
    members = property(lambda self: self._async.members)
    leader = property(lambda self: self._async.leader)
    holder_rank = property(lambda self: self._async.holder_rank)
    formation = property(lambda self: self._async.formation)

    def form(self, step: int, timeout: float) -> Formation:
        formation = self._server.loop_thread.call(self._async.form(step, timeout), timeout=timeout + 5.0)
        assert self._async.ring is not None
        self.ring = Ring.over(self._server, self._async.ring)
        return formation

    def joiners(self) -> int:
        return self._async.joiners()  # reads one int the loop thread keeps current

    def close(self) -> None:
        async def close() -> None:
            await self._async.leave()
            self._async.close()

        self._server.loop_thread.call(close(), timeout=15.0)
