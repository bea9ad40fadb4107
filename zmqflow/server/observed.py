"""What a task's metrics read at scrape time: its counters, its shard's sizes, steps and tables.

Read from the scraping thread while the loop runs: only ints and copies of dicts are taken, so a
scrape sees each number as it was at one moment, never a half-changed structure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..observe.metrics import MAX_LABELS, OTHER, Sample
from ..rpc import Counters, Service
from .services.ps import PsService

__all__ = ["probe"]


def probe(counters: Counters, services: dict[str, Service]) -> Callable[[], Iterator[Sample]]:
    """A task's lazily read samples (labels after ``task``): its RPC counters and its shard."""

    def samples() -> Iterator[Sample]:
        c = counters
        for kind, value in (("error_replies", c.errors), ("dropped", c.dropped),
                            ("undeliverable", c.undeliverable), ("late_replies", c.late_replies)):
            yield "rpc_problems_total", (kind,), value
        ps = services.get("ps")
        if isinstance(ps, PsService):
            yield from _shard(ps)

    return samples


def _shard(ps: PsService) -> Iterator[Sample]:
    parts = list(ps.store.parts.values())
    tables = list(ps.tables.items())
    yield "variables", (), len(parts)
    yield "shard_bytes", ("variables",), sum(p.nbytes for p in parts)  # the copy: the loop may add parts meanwhile
    yield "shard_bytes", ("tables",), sum(t.nbytes for _, t in tables)
    for mode, n in list(ps.pushes_applied.items()):
        yield "pushes_applied_total", (mode,), n
    yield "stale_gradients_total", (), ps.stale_gradients
    yield "sync_rounds_total", (), ps.sync_rounds
    for replica, n in list(ps.sync_missing.items()):
        yield "sync_missing_total", (replica,), n
    yield "global_step", (), max((p.sync.step for p in parts if p.sync is not None), default=0)
    per_table: dict[str, list[int]] = {}
    names = sorted({name for (name, _), _ in tables})
    keep = set(names[:MAX_LABELS - 1]) if len(names) > MAX_LABELS else set(names)
    for (name, _), t in tables:
        st = per_table.setdefault(name if name in keep else OTHER, [0, 0, 0])
        st[0] += len(t)
        st[1] += t.evicted
        st[2] += t.dropped_pushes
    for name, (rows, evicted, dropped) in per_table.items():
        yield "table_rows", (name,), rows
        yield "table_evictions_total", (name,), evicted
        yield "table_dropped_pushes_total", (name,), dropped
    yield "shard_save_seconds", (), ps.save_seconds
