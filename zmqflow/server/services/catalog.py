"""The catalog service: variable names and placements, on the first ps task (else the first task).

Records live on a ps task because ps tasks hold the state: any non-ps task may restart and find
every variable again by name.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from ...cluster import ClusterSpec, shard_tasks
from ...errors import InvalidArgument, NotFound
from ...state.catalog import Catalog, canonical_device
from ...state.limits import DEFAULT_STATE_LIMITS, StateLimits
from ...rpc import CallContext, Service, op
from ...wire.requests import cluster as rq

__all__ = ["CatalogService"]


class CatalogService(Service):
    name = "catalog"

    def __init__(self, spec: ClusterSpec, limits: StateLimits = DEFAULT_STATE_LIMITS):
        super().__init__()
        self.spec = spec
        self.catalog = Catalog([str(t) for t in shard_tasks(spec)], limits)
        # one event per name someone waits for, dropped when the last waiter leaves: lookups of
        # names that never come cannot pile up events
        self._ready: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = defaultdict(int)

    @op(rq.Declare)
    def declare(self, ctx: CallContext, req: rq.Declare) -> dict[str, Any]:
        name, device = req.name, req.device
        if device is not None:
            device = canonical_device(name, device)
        if device is not None and device not in self.spec:
            raise InvalidArgument(f"variable {name!r}: device {device!r} is not a task of the cluster ({self.spec.describe()})")
        return self.catalog.declare(name, req.shape, req.dtype, req.part_rows, req.part_bytes, device=device,
                                    policy=req.policy, optimizer=req.optimizer, initializer=req.initializer,
                                    table=req.table)

    @op(rq.ByName)
    def mark_ready(self, ctx: CallContext, req: rq.ByName) -> dict[str, Any]:
        record = self.catalog.mark_ready(req.name)
        event = self._ready.get(req.name)
        if event is not None:
            event.set()
        return record

    @op(rq.Lookup)
    async def lookup(self, ctx: CallContext, req: rq.Lookup) -> dict[str, Any]:
        """The record of ``name`` once it is created; waits until then (within the deadline, which
        the RPC server bounds for every request) if ``wait``."""
        name = req.name
        if not self.catalog.ready(name):
            if not req.wait:
                self._missing(name)
            loop = asyncio.get_running_loop()
            remaining = None if ctx.deadline is None else ctx.deadline - loop.time() - 0.1
            event = self._ready.setdefault(name, asyncio.Event())
            self._waiters[name] += 1
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                self._missing(name)
            finally:
                self._waiters[name] -= 1
                if not self._waiters[name]:
                    del self._waiters[name]
                    self._ready.pop(name, None)
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
