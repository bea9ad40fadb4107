"""The ring's membership rendezvous: which ranks form the next generation, and whose state wins.

Every task's ring service holds a :class:`Rendezvous`: the generation its rank is in and the
members of it. To (re)form, a rank reads every live member's ``ring.status`` and sends
``ring.join`` to the coordinator: the lowest-index rank of the newest generation (before the
first formation, of all the members, once every one answers). The coordinator gathers the joins
of every member of its generation it believes alive plus any newcomer, then answers them all with
the next generation: its number, its members in ring order, and the holder (the joiner with the
most advanced replica; ties go to the lowest index) whose state every member then adopts. A
member that does not join within the window (a longer one before the first formation, when ranks
may still be loading) is left out and joins later as a newcomer. Newcomers
waiting at the coordinator are counted (``waiting``), so the running ranks can agree, through
their next allreduce, to re-form at one step boundary.

A joiner's short status calls can miss a leader that is alive but slow to answer (a loaded
host); it then asks the next member. That member is connected to the leader and knows better:
while a member ranked before it answers at its generation or later, it refuses the join and
names that member (``join_through``), and the joiner goes there. Otherwise the newcomer would wait
at a rank that never re-forms for it, or two survivors would each form a generation alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...cluster import ClusterSpec, TaskId
from ...errors import DeadlineExceeded, InvalidArgument, Unavailable, ZmqflowError
from ...rpc import RpcClient
from ...wire.requests.cluster import Join

__all__ = ["Formation", "Rendezvous", "join_next_generation"]

_POLL_S = 0.02
_STATUS_TIMEOUT = 1.0
_JOIN_TRY_S = 30.0  # a newcomer asks again this often, in case it asked the wrong rank


@dataclass(frozen=True)
class Formation:
    """One generation of the ring: its number, its members in ring order, and the member whose
    replica (at ``step``) every other adopts."""

    generation: int
    members: list[str]
    holder: str
    step: int

    def to_wire(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members), "holder": self.holder, "step": self.step}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> "Formation":
        return cls(int(body["generation"]), [str(m) for m in body["members"]], str(body["holder"]), int(body["step"]))


@dataclass
class _Join:
    task: str
    generation: int
    step: int


@dataclass(eq=False)
class _Round:
    done: asyncio.Future
    joins: dict[str, _Join] = field(default_factory=dict)
    started: float | None = None  # when the first member of the generation joined: the window opens
    probed: set[str] = field(default_factory=set)  # members left out whose status was asked
    answering: set[str] = field(default_factory=set)  # ... and that answered: alive after all
    vetted_at: int | None = None  # the generation at which no earlier-ranked member was found leading


class Rendezvous:
    """One rank's view of the ring's membership, and the coordinator's side of the rendezvous.
    Lives on the server's loop; ``waiting`` is a plain int other threads may read."""

    def __init__(self) -> None:
        self.task = ""
        self.universe: list[str] = []
        self.window = 10.0
        self.first_window = 10.0
        self.generation = 0
        self.members: list[str] = []
        self.closed = False
        self.waiting = 0
        self.client: RpcClient | None = None  # this task's own: its connections tell who is down
        self.spec: ClusterSpec | None = None
        self._ready: asyncio.Event | None = None
        self._round: _Round | None = None
        self._gatherer: asyncio.Future | None = None
        self._vetting: asyncio.Future | None = None  # the one look at the earlier-ranked members under way

    def configure(self, task: str, universe: Sequence[str], client: RpcClient, spec: ClusterSpec, window: float,
                  first_window: float | None = None) -> None:
        """Called on the loop by the rank's elastic ring before it joins; joins wait for it."""
        self.task, self.universe, self.window = task, list(universe), float(window)
        self.client, self.spec = client, spec
        self.first_window = max(self.window, float(first_window if first_window is not None else window))
        self.closed = False
        self._ready_event().set()

    def _ready_event(self) -> asyncio.Event:
        if self._ready is None:
            self._ready = asyncio.Event()
        return self._ready

    def alive(self, task: str) -> bool:
        """Not known to be down: this rank's connection to ``task`` has not dropped (or is back)."""
        if task == self.task:
            return True
        return self.client is None or self.client.peer_state(_endpoint(self.spec, task)) != "down"

    def status(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members), "closed": self.closed}

    def view(self) -> list[str]:
        """The members this rank expects at a rendezvous: its generation's, or all before the first."""
        return self.members if self.generation else self.universe

    def adopt(self, formation: Formation) -> None:
        if formation.generation > self.generation:
            self.generation, self.members = formation.generation, list(formation.members)

    def close(self) -> None:
        """This rank's training is over: refuse joins, fail the ones waiting."""
        self.closed = True
        if self._gatherer is not None:
            self._gatherer.cancel()
        if self._round is not None and not self._round.done.done():
            self._round.done.set_exception(Unavailable(f"{self.task}: its ring has finished", task=self.task))

    # the coordinator -------------------------------------------------------------------
    async def join(self, task: str, generation: int, step: int, target: int) -> dict[str, Any]:
        """The next generation, once formed (``ring.join``; its arguments were checked at the edge)."""
        await self._ready_event().wait()
        if self.closed:
            raise Unavailable(f"{self.task}: its ring has finished; it takes no joins", task=self.task)
        if self.generation < target:  # restarted, or left behind: it cannot speak for generation `target`
            raise Unavailable(f"{self.task} is at ring generation {self.generation}, behind {target}; ask again",
                              task=self.task)
        if task not in self.universe:
            raise InvalidArgument(f"{task} is not a ring member ({', '.join(self.universe)})")
        await self._defer_to_leader()
        if self.closed:  # while it looked at the leader
            raise Unavailable(f"{self.task}: its ring has finished; it takes no joins", task=self.task)
        rnd = self._open()
        rnd.vetted_at = self.generation
        mine = rnd.joins[task] = _Join(task, int(generation), int(step))
        if rnd.started is None and task in self.view():
            rnd.started = asyncio.get_running_loop().time()
        try:
            return await asyncio.shield(rnd.done)
        except asyncio.CancelledError:  # its deadline passed: the joiner has gone to ask again elsewhere
            if not rnd.done.done() and rnd.joins.get(task) is mine:
                del rnd.joins[task]  # so this round does not count, or form with, a rank that never hears of it
            raise

    async def _defer_to_leader(self) -> None:
        """Refuse to coordinate, naming the member to join through, while a member ranked before
        this one in its generation is alive and leading. A joiner's survey missed that member (a
        status call too short for a loaded host) or saw a stale answer; this rank asks it for as
        long as the join window, and coordinates only once it is down, silent, restarted or closed."""
        if not self.generation or self.task not in self.members:
            return
        if self._round is not None and self._round.vetted_at == self.generation:
            return  # already coordinating this generation's successor: the others join it
        earlier = [t for t in self.members[:self.members.index(self.task)] if self.alive(t)]
        if not earlier:
            return
        if self._vetting is None:
            self._vetting = vetting = asyncio.ensure_future(self._leading(earlier))
            vetting.add_done_callback(self._vetted)
        found = await asyncio.shield(self._vetting)
        if found is not None:
            leader, generation = found
            raise Unavailable(f"{self.task} does not coordinate ring generation {self.generation}'s successor: "
                              f"{leader} leads (generation {generation}); join through it",
                              task=self.task, join_through=leader, generation=generation)

    def _vetted(self, vetting: asyncio.Future) -> None:
        if self._vetting is vetting:
            self._vetting = None
        if not vetting.cancelled():
            vetting.exception()  # retrieved: every waiter sees the same outcome

    async def _leading(self, earlier: list[str]) -> tuple[str, int] | None:
        """(the lowest-ranked of ``earlier`` alive at this generation or later, its generation), or
        None. Asked together; each answer is awaited in rank order, so the first leader found is
        the one to join through."""
        timeout = max(_STATUS_TIMEOUT, self.window)
        asks = [asyncio.ensure_future(self._status_of(t, timeout)) for t in earlier]
        try:
            for t, ask in zip(earlier, asks):
                status = await ask
                if status is not None and not status.get("closed") and status["generation"] >= self.generation:
                    return t, int(status["generation"])
            return None
        finally:
            for ask in asks:
                ask.cancel()

    def _open(self) -> _Round:
        if self._round is None:
            self._round = _Round(asyncio.get_running_loop().create_future())
            self._round.done.add_done_callback(_retrieve)
            self._gatherer = asyncio.ensure_future(self._gather(self._round))
        return self._round

    async def _gather(self, rnd: _Round) -> None:
        """Close the round once every live member has joined (or its window ends), then answer all."""
        loop = asyncio.get_running_loop()
        try:
            while not rnd.done.done():
                if rnd.started is None and not any(self.alive(t) for t in rnd.joins):
                    raise Unavailable(f"ring rendezvous at {self.task}: every rank waiting to join is gone", task=self.task)
                self.waiting = sum(1 for t in rnd.joins if t not in self.view() and self.alive(t))
                window = self.window if self.generation else self.first_window
                late = rnd.started is not None and loop.time() > rnd.started + window
                if self.task in rnd.joins:
                    expected = {t for t in {*self.view(), *rnd.joins} if self._present(rnd, t)}
                    if (late or expected <= rnd.joins.keys()) and await self._quorate(rnd, late):
                        break  # members still missing are left out; they can join the next generation
                elif late:
                    raise DeadlineExceeded(f"ring rendezvous at {self.task}: the coordinator itself did not join "
                                           f"within {window:g}s", task=self.task)
                await asyncio.sleep(_POLL_S)
            if not rnd.done.done():
                rnd.done.set_result(self._close_round(rnd).to_wire())
        except Exception as exc:  # a round that fails must still answer every joiner waiting on it
            if not rnd.done.done():
                rnd.done.set_exception(exc if isinstance(exc, ZmqflowError) else Unavailable(
                    f"ring rendezvous at {self.task} failed: {exc!r}", task=self.task))
        finally:
            self.waiting = 0
            if self._round is rnd:
                self._round = None

    def _present(self, rnd: _Round, task: str) -> bool:
        return self.alive(task) or task in rnd.answering

    async def _quorate(self, rnd: _Round, late: bool) -> bool:
        """Whether the round may close: it keeps a majority of this generation's members, or every
        member it leaves out is confirmed gone. A rank that was frozen (SIGSTOP, a long pause) sees
        every peer as down for a moment; this keeps it from forming a ring of its own while the
        others train on."""
        view = self.view()
        kept = [t for t in view if t in rnd.joins and self._present(rnd, t)]
        if 2 * len(kept) > len(view) or len(kept) == len(view):
            return True
        unasked = [t for t in view if t not in kept and t not in rnd.probed]
        for t, status in zip(unasked, await asyncio.gather(*(self._status_of(t) for t in unasked))):
            rnd.probed.add(t)
            if status is not None and status.get("closed"):  # its training is over: so is this ring's
                raise Unavailable(f"ring rendezvous at {self.task}: {t} has finished; the ring is over, "
                                  f"there is no generation to re-form", task=t)
            if status is None:
                continue
            if status["generation"] > self.generation:
                raise Unavailable(f"ring rendezvous at {self.task}: {t} is alive at generation {status['generation']}, "
                                  f"ahead of {self.generation}; join through it", task=t)
            rnd.answering.add(t)
        return late or all(t in rnd.joins for t in rnd.answering)

    async def _status_of(self, task: str, timeout: float = _STATUS_TIMEOUT) -> dict[str, Any] | None:
        """``task``'s ring status, asked now whatever the connection's state; None if it does not answer."""
        assert self.client is not None and self.spec is not None
        try:
            status = await self.client.call(_endpoint(self.spec, task), "ring", "status", timeout=timeout, name=task)
        except ZmqflowError:
            return None
        return status if _well_formed(status) else None

    def _close_round(self, rnd: _Round) -> Formation:
        order = {t: i for i, t in enumerate(self.universe)}
        joined = [j for j in rnd.joins.values() if self._present(rnd, j.task)]
        holder = min(joined, key=lambda j: (-j.step, order[j.task]))
        generation = max(self.generation, *(j.generation for j in joined)) + 1
        formation = Formation(generation, sorted((j.task for j in joined), key=order.__getitem__), holder.task, holder.step)
        self.adopt(formation)
        return formation


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # a round failed with no one left waiting: no "never retrieved" warning


# the joiner ---------------------------------------------------------------------------
async def join_next_generation(state: Rendezvous, step: int, timeout: float) -> Formation:
    """Join the ring's next generation through its coordinator; returns it once formed. ``step``
    is how far this rank's replica is (-1: it holds none worth keeping)."""
    client, spec = state.client, state.spec
    assert client is not None and spec is not None, "configure() the rendezvous first"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = "no member answered"
    delay = 0.05
    redirect: tuple[str, int] | None = None
    while (remaining := deadline - loop.time()) > 0:
        if redirect is not None:  # a member that knows better named the coordinator: no survey can miss it
            (coordinator, target), redirect = redirect, None
        else:
            views = await _survey(state, min(_STATUS_TIMEOUT, remaining))
            coordinator, target, last = _coordinator(state, views)
        if coordinator is not None:
            body = Join(task=state.task, generation=state.generation, step=int(step), target=target)
            try:
                reply = await client.call(_endpoint(spec, coordinator), "ring", "join", body,
                                          timeout=max(0.05, min(deadline - loop.time(), _JOIN_TRY_S)), name=coordinator)
            except (Unavailable, DeadlineExceeded) as exc:
                last = str(exc)
                redirect = _redirect(state, exc)
            else:
                formation = Formation.from_wire(reply)
                if state.task in formation.members:
                    state.adopt(formation)
                    return formation
                # left out (the coordinator saw it down, or it came too late): the next generation takes it
                last = f"left out of ring generation {formation.generation}"
        await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
        delay = min(2 * delay, 0.5)
    raise DeadlineExceeded(f"{state.task}: no ring generation formed within {timeout:g}s; last: {last}", task=state.task)


async def _survey(state: Rendezvous, timeout: float) -> dict[str, dict[str, Any]]:
    """The ring status of every other member this rank does not know to be down."""
    assert state.client is not None and state.spec is not None
    others = [t for t in state.universe if t != state.task and state.alive(t)]
    calls = [state.client.call(_endpoint(state.spec, t), "ring", "status", timeout=timeout, name=t) for t in others]
    results = await asyncio.gather(*calls, return_exceptions=True)
    return {t: r for t, r in zip(others, results) if _well_formed(r)}


def _redirect(state: Rendezvous, exc: ZmqflowError) -> tuple[str, int] | None:
    """(member, generation) that a refusing rank named to join through instead, if any."""
    to, generation = exc.details.get("join_through"), exc.details.get("generation")
    if isinstance(to, str) and to in state.universe and type(generation) is int:
        return to, generation
    return None


def _well_formed(status: Any) -> bool:
    """A ring status as this version sends it; anything else counts as no answer."""
    return isinstance(status, dict) and isinstance(status.get("generation"), int) and not isinstance(
        status.get("generation"), bool)


def _coordinator(state: Rendezvous, views: dict[str, dict[str, Any]]) -> tuple[str | None, int, str]:
    """(coordinator, its generation, why none) from the others' status and this rank's own."""
    closed = sorted(t for t, v in views.items() if v.get("closed"))
    gens = {t: int(v["generation"]) for t, v in views.items() if not v.get("closed")}
    gens[state.task] = state.generation
    target = max(gens.values())
    if target == 0:
        if closed:
            raise Unavailable(f"the ring has finished ({', '.join(closed)} closed); {state.task} has no ring to join",
                              task=closed[0])
        missing = [t for t in state.universe if t not in gens]
        if missing:  # before the first formation every member must be there to agree on one coordinator
            return None, 0, f"waiting for {', '.join(missing)} to answer"
    order = state.universe.index
    return min((t for t, g in gens.items() if g == target), key=order), target, ""


def _endpoint(spec: ClusterSpec, task: str) -> str:
    return spec.address(TaskId.parse(task)).endpoint
