"""The catalog service: variable names and placements, on the first ps task (else the first task).

Records live on a ps task because ps tasks hold the state: any non-ps task may restart and find
every variable again by name.

A declaration of a record that is not ready gets the claim on it (the right to create its parts)
or waits: until the record is ready, the claim is given up or lapses (and this declarer has
something to build the parts from), or the request's deadline. The claim's holder is the caller
the RPC edge names (with keys, its key's name, never a field), and its token is handed to it
alone; ``mark_ready`` and ``abandon`` take both. A holder that abandons the record (a shard
refused a part) has the catalog drop the parts it made: ``ps.drop`` is the catalog task's alone,
so no client can drop a part of a variable in use, and none is dropped before its record's claim
is checked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ...cluster import ClusterSpec, shard_tasks
from ...errors import DeadlineExceeded, InvalidArgument, NotFound
from ...state.catalog import Catalog, canonical_device
from ...state.limits import DEFAULT_STATE_LIMITS, StateLimits
from ...rpc import CallContext, Service, op
from ...wire.requests import cluster as rq
from ...wire.requests import ps as psrq

__all__ = ["CatalogService", "MIN_LEASE", "MAX_LEASE", "DROP_TIMEOUT"]

log = logging.getLogger(__name__)

# A claim's lease is twice the declaring request's timeout (the session's): its holder's creates
# run within one, so a live holder finishes well inside it; bounded both ways.
MIN_LEASE = 1.0
MAX_LEASE = 3600.0
NO_DEADLINE_TIMEOUT = 30.0  # what a call made in-process, without a deadline, counts as its timeout
# a wait ends this long before its caller's deadline, so its own error (naming why) gets back first
WAIT_MARGIN = 0.1
DROP_TIMEOUT = 10.0  # the most an abandon waits for a shard to drop the parts (it is not left holding them)

# ``call(task, service, op, body, timeout=...)``: the task's own client to the cluster's tasks
CallTask = Callable[..., Awaitable[Any]]


def _now() -> float:
    """The loop's clock (which deadlines are on); the same clock outside a loop."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class CatalogService(Service):
    name = "catalog"

    def __init__(self, spec: ClusterSpec, limits: StateLimits = DEFAULT_STATE_LIMITS, call: CallTask | None = None):
        """``call`` reaches the shards to drop an abandoned record's parts; without it (a catalog
        outside a server) they stay where they are."""
        super().__init__()
        self.spec = spec
        self._call = call
        self.catalog = Catalog([str(t) for t in shard_tasks(spec)], limits)
        # one event per name someone waits for, dropped when the last waiter leaves: lookups of
        # names that never come cannot pile up events
        self._ready: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = defaultdict(int)

    @op(rq.Declare)
    def declare(self, ctx: CallContext, req: rq.Declare) -> "dict[str, Any] | Coroutine[Any, Any, dict[str, Any]]":
        """The record and the caller's claim on it (null when it is ready); a declaration of a
        record whose claim another holds waits (the answer is then a coroutine)."""
        name, device = req.name, req.device
        if device is not None:
            device = canonical_device(name, device)
        if device is not None and device not in self.spec:
            raise InvalidArgument(f"variable {name!r}: device {device!r} is not a task of the cluster ({self.spec.describe()})")
        now = _now()
        timeout = NO_DEADLINE_TIMEOUT if ctx.deadline is None else ctx.deadline - now
        lease = min(max(2 * timeout, MIN_LEASE), MAX_LEASE)
        reply = self._declare_once(ctx, req, device, now, lease)
        return reply if reply is not None else self._declare_waiting(ctx, req, device, lease, timeout)

    def _declare_once(self, ctx: CallContext, req: rq.Declare, device: str | None, now: float,
                      lease: float) -> dict[str, Any] | None:
        """The reply when the record is ready or the caller gets the claim; None to wait."""
        creator = req.name not in self.catalog.records
        if creator and req.initializer is None and not req.has_value:
            raise InvalidArgument(f"variable {req.name!r}: a first declaration names an initializer or holds an "
                                  "initial value (has_value): its parts must not be made from nothing", name=req.name)
        record = self.catalog.declare(req.name, req.shape, req.dtype, req.part_rows, req.part_bytes, device=device,
                                      policy=req.policy, optimizer=req.optimizer, initializer=req.initializer,
                                      table=req.table)
        if record["ready"]:
            return {**record, "claim": None, "overwrite": False}
        held = self.catalog.claim(req.name, ctx.source, now, lease, creator=creator, has_value=req.has_value,
                                  defaulted=req.defaulted)
        return None if held is None else {**record, "claim": held.token, "overwrite": held.overwrite}

    async def _declare_waiting(self, ctx: CallContext, req: rq.Declare, device: str | None, lease: float,
                               timeout: float) -> dict[str, Any]:
        """Declare again each time the record changes or the claim lapses, until the caller gets
        the record ready or the claim; DeadlineExceeded, naming why, just before its deadline."""
        name = req.name
        end = None if ctx.deadline is None else ctx.deadline - WAIT_MARGIN
        while True:
            now = _now()
            reply = self._declare_once(ctx, req, device, now, lease)
            if reply is not None:
                return reply
            # a declarer that could take the claim wakes when it lapses; any wakes when it is given up
            held = self.catalog.holder(name)
            lapses = held.until if held is not None and self.catalog.may_claim(name, req.has_value) else None
            if end is not None and now >= end:
                raise DeadlineExceeded(self._not_ready(name, req.has_value, now, timeout), name=name)
            until = min((t for t in (end, lapses) if t is not None), default=None)
            await self._wait(name, None if until is None else until - now)

    def _not_ready(self, name: str, has_value: bool, now: float, timeout: float) -> str:
        """Why a declaration of ``name`` waited until its deadline, and for whom."""
        held = self.catalog.holder(name)
        start = f" within {timeout:.3g}s"
        if held is not None and held.until > now:
            return (f"variable {name!r} is being created by {held.owner!r} and did not become ready{start}: declare "
                    f"it again (its claim lapses in {held.until - now:.3g}s if that declarer is gone)")
        why = "the declarer that holds its claim gave it up or is gone"
        if not self.catalog.may_claim(name, has_value):
            why += ("; this declaration has no initial value and the record names no initializer (its creator gave "
                    "a value), so it cannot create the parts: declare it with its value")
        return f"variable {name!r} did not become ready{start}: {why}"

    @op(rq.MarkReady)
    def mark_ready(self, ctx: CallContext, req: rq.MarkReady) -> dict[str, Any]:
        record = self.catalog.mark_ready(req.name, req.claim, ctx.source)
        self._wake(req.name)
        return record

    @op(rq.Abandon)
    def abandon(self, ctx: CallContext, req: rq.Abandon) -> "bool | Coroutine[Any, Any, bool]":
        """The claim's holder gives it up (``keep``: the record stays; else the parts its holder
        made are dropped, then the record goes, and what it counted); the declarations waiting on
        it try again. True when the record went."""
        if req.keep or self._call is None:
            gone = self.catalog.abandon(req.name, req.claim, ctx.source, keep=req.keep)
            self._wake(req.name)
            return gone
        parts = self.catalog.claimed_parts(req.name, req.claim, ctx.source)  # refuses all but the holder, at once
        return self._drop_then_abandon(ctx, req, parts)

    async def _drop_then_abandon(self, ctx: CallContext, req: rq.Abandon, parts: list[tuple[str, int]]) -> bool:
        """Drop the parts the holder made while the record still stands (a declaration waiting on
        it cannot make them again meanwhile), then abandon it. A shard that does not answer keeps
        its part: a later declaration of the name there is refused until a recovery sweeps it."""
        assert self._call is not None
        per_task: dict[str, list[psrq.Pair]] = defaultdict(list)
        for task, part in parts:
            per_task[task].append(psrq.Pair(req.name, part))
        left = DROP_TIMEOUT if ctx.deadline is None else ctx.deadline - _now() - WAIT_MARGIN
        timeout = min(max(left, MIN_LEASE), DROP_TIMEOUT)
        answers = await asyncio.gather(*(self._call(task, "ps", "drop", psrq.Drop(items=items, owner=ctx.source),
                                                    timeout=timeout) for task, items in per_task.items()),
                                       return_exceptions=True)
        for task, answer in zip(per_task, answers):
            if isinstance(answer, BaseException):
                log.warning("could not drop the parts of abandoned %r on %s: %s", req.name, task, answer)
        gone = self.catalog.abandon(req.name, req.claim, ctx.source, keep=False)
        self._wake(req.name)
        return gone

    def _wake(self, name: str) -> None:
        """Wake whoever waits on ``name``; a later waiter waits on a new event."""
        event = self._ready.pop(name, None)
        if event is not None:
            event.set()

    async def _wait(self, name: str, timeout: float | None) -> None:
        """Until ``name`` changes (ready, claim given up, record gone) or ``timeout`` passes."""
        event = self._ready.setdefault(name, asyncio.Event())
        self._waiters[name] += 1
        try:
            await asyncio.wait_for(event.wait(), None if timeout is None else max(timeout, 0.0))
        except TimeoutError:
            pass
        finally:
            self._waiters[name] -= 1
            if not self._waiters[name]:  # nobody waits on any event of the name
                del self._waiters[name]
                self._ready.pop(name, None)

    @op(rq.Lookup)
    async def lookup(self, ctx: CallContext, req: rq.Lookup) -> dict[str, Any]:
        """The record of ``name`` once it is created; waits until then (within the deadline, which
        the RPC server bounds for every request) if ``wait``."""
        name = req.name
        if not self.catalog.ready(name):
            if not req.wait:
                self._missing(name)
            end = None if ctx.deadline is None else ctx.deadline - WAIT_MARGIN
            while not self.catalog.ready(name):
                left = None if end is None else end - _now()
                if left is not None and left <= 0:
                    self._missing(name)
                await self._wait(name, left)
        return self.catalog.lookup(name)

    @staticmethod
    def _missing(name: str) -> None:
        raise NotFound(f"no variable named {name!r} has been created", name=name)

    @op(rq.Uninitialized)
    def uninitialized(self, ctx: CallContext, req: rq.Uninitialized) -> list[str]:
        return self.catalog.uninitialized(req.names)

    @op(rq.Records)
    def records(self, ctx: CallContext, req: rq.Records) -> list[dict[str, Any]]:
        """Every ready record; with ``pending``, also those whose creator is still writing parts."""
        return [r for r in self.catalog.records.values() if r["ready"] or req.pending]
