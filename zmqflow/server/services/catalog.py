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
from ...state.catalog import Catalog
from ...rpc import CallContext, Service, op

__all__ = ["CatalogService"]


class CatalogService(Service):
    name = "catalog"

    def __init__(self, spec: ClusterSpec):
        super().__init__()
        self.spec = spec
        self.catalog = Catalog([str(t) for t in shard_tasks(spec)])
        self._ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    @op
    def declare(self, ctx: CallContext, name: str, shape: list, dtype: str, part_rows: list, part_bytes: list,
                device: str | None = None, policy: str = "round_robin", optimizer: Any = None,
                initializer: Any = None, table: dict | None = None) -> dict[str, Any]:
        if device is not None and device not in self.spec:
            raise InvalidArgument(f"variable {name!r}: device {device!r} is not a task of the cluster ({self.spec.describe()})")
        return self.catalog.declare(name, shape, dtype, part_rows, part_bytes, device=device, policy=policy,
                                    optimizer=optimizer, initializer=initializer, table=table)

    @op
    def mark_ready(self, ctx: CallContext, name: str) -> dict[str, Any]:
        record = self.catalog.mark_ready(name)
        self._ready[name].set()
        return record

    @op
    async def lookup(self, ctx: CallContext, name: str, wait: bool = True) -> dict[str, Any]:
        """The record of ``name`` once it is created; waits until then (within the deadline) if ``wait``."""
        if not self.catalog.ready(name):
            if not wait:
                self._missing(name)
            loop = asyncio.get_running_loop()
            remaining = None if ctx.deadline is None else ctx.deadline - loop.time() - 0.1
            try:
                await asyncio.wait_for(self._ready[name].wait(), remaining)
            except TimeoutError:
                self._missing(name)
        return self.catalog.lookup(name)

    @staticmethod
    def _missing(name: str) -> None:
        raise NotFound(f"no variable named {name!r} has been created", name=name)

    @op
    def uninitialized(self, ctx: CallContext, names: list) -> list[str]:
        return self.catalog.uninitialized([str(n) for n in names])

    @op
    def records(self, ctx: CallContext, pending: bool = False) -> list[dict[str, Any]]:
        """Every ready record; with ``pending``, also those whose creator is still writing parts."""
        return [r for r in self.catalog.records.values() if r["ready"] or pending]
