"""The parameter-server shard service: the async layer over :class:`ShardStore` and sync replicas.

Every op validates and applies in one go on the loop (atomic on the shard). Sync pushes wait,
without blocking the loop, until their step has been applied, and past their deadline name the
replicas that did not push.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import DeadlineExceeded, InvalidArgument, Recovering
from ...state.tables import HashTable
from ...state.store import PartKey, ShardStore, part_label
from ...state.sync import READY, STALE
from ...rpc import CallContext, Service, op
from .fence import FenceOps
from .snapshots import SnapshotOps
from .tables import TableOps

__all__ = ["PsService"]

log = logging.getLogger(__name__)

# A waiting sync push gives up this long before its caller's deadline, so its own error (naming
# the missing replicas) reaches the caller instead of a bare timeout.
_SYNC_MARGIN = 0.25


class PsService(Service, TableOps, SnapshotOps, FenceOps):
    name = "ps"

    def __init__(self, replicas: list[str] | None = None, reachable: Callable[[bytes], bool] | None = None):
        super().__init__()
        self._fence_init()
        self._reachable = reachable
        self._pushers: dict[str, bytes] = {}  # replica name -> the routing id it last pushed from
        self._gone: set[str] = set()  # replicas whose steps were completed without them
        self.store = ShardStore()
        self.tables: dict[PartKey, HashTable] = {}
        self._table_specs: dict[PartKey, tuple] = {}
        self.replicas = list(replicas or [])
        self._advanced: dict[PartKey, asyncio.Event] = defaultdict(asyncio.Event)

    def state(self) -> str | None:
        if self.fenced:
            return f"recovering (epoch {self.epoch})"
        return f"restored (epoch {self.epoch})" if self.epoch else None

    def admit(self, ctx: CallContext) -> None:
        self.check_fence(ctx.op, ctx.peer)

    @op
    def status(self, ctx: CallContext) -> dict[str, Any]:
        return {
            **self.fence_state(),
            "variables": len(self.store.parts),
            "bytes": self.store.nbytes + sum(t.nbytes for t in self.tables.values()),
            "global_step": self._step(),
            "tables": {part_label(k): t.stats() for k, t in self.tables.items()},
        }

    @op
    def global_step(self, ctx: CallContext) -> int:
        return self._step()

    def _step(self) -> int:
        steps = [p.sync.step for p in self.store.parts.values() if p.sync is not None]
        return max(steps, default=0)

    @op
    def variables(self, ctx: CallContext) -> list[dict[str, Any]]:
        return [p.describe() for p in self.store.parts.values()]

    @op
    def create(self, ctx: CallContext, name: str, part: int, shape: list, rows: list, dtype: str, num_parts: int = 1,
               optimizer: Any = None, initializer: Any = None, value: np.ndarray | None = None) -> bool:
        return self.store.create(name, part, shape, rows, dtype, num_parts=num_parts, optimizer=optimizer,
                                 initializer=initializer, value=value)

    @op
    def pull(self, ctx: CallContext, items: list) -> list[np.ndarray]:
        """Read-only views of ``[[name, part, start, stop], ...]``, in order, sent zero-copy (a write
        meanwhile goes to a copy of the part: ``Part.own``)."""
        return [self.store.view(*_item(it, 4, "pull")) for it in items]

    @op
    def assign(self, ctx: CallContext, items: list, mode: str = "set") -> int:
        """``[[name, part, start, stop, value], ...]``, all checked before any is written."""
        checked = [_item(it, 5, "assign") for it in items]
        for name, part, start, stop, value in checked:
            self._check_rows(name, part, start, stop, value, mode)
        for name, part, start, stop, value in checked:
            self.store.assign(name, part, value, mode, start, stop)
        return len(checked)

    @op
    def scatter(self, ctx: CallContext, name: str, part: int, indices: np.ndarray, rows: np.ndarray, mode: str = "add") -> int:
        self.store.scatter(name, part, indices, rows, mode)
        return int(len(indices))

    @op
    async def push(self, ctx: CallContext, dense: list | None = None, sparse: list | None = None, step: int | None = None) -> dict[str, Any]:
        """Apply gradients: ``dense`` as ``[[name, part, start, stop, grad], ...]``, ``sparse`` as
        ``[[name, part, indices, rows], ...]``. Async parts apply at once; sync parts wait for their step,
        and the answer names the replicas whose gradients that step averaged (every pusher of the
        step hears the same)."""
        # admitted before a fence that ran while this waited to start: it must not land after it
        self.check_fence("push", ctx.peer)
        by_part: dict[PartKey, dict[str, Any]] = defaultdict(lambda: {"dense": {}, "sparse": None})
        for it in dense or []:
            name, part, start, stop, grad = _item(it, 5, "push")
            p = self.store.get(name, part)
            a, b = (0, p.nrows) if start is None else (start, stop)
            self._check_rows(name, part, a if p.full_shape else None, b if p.full_shape else None, grad, "gradient")
            by_part[(name, part)]["dense"][(a, b)] = grad
        for it in sparse or []:
            name, part, indices, rows = _item(it, 4, "push")
            p = self.store.get(name, part)
            self.store._sparse_args(p, indices, rows, f"sparse gradient of {p.label}")  # validate only
            by_part[(name, part)]["sparse"] = (indices, rows)
        waits: list[tuple[PartKey, int]] = []
        stale = False
        for key, grads in by_part.items():
            p = self.store.get(*key)
            if p.sync is None:
                self._apply(key, grads["dense"], grads["sparse"])
                continue
            if step is None:
                raise InvalidArgument(f"variable {p.label} is synchronous: pushes must carry the pusher's step")
            mine = min(int(step), p.sync.step)
            self._pushers[ctx.source or "anonymous"] = ctx.peer
            self._gone.discard(ctx.source or "anonymous")
            outcome = p.sync.offer(int(step), ctx.source or "anonymous", grads["dense"], grads["sparse"])
            if outcome == STALE:
                stale = True
            elif outcome == READY:
                mean_dense, mean_sparse = p.sync.take()
                self._apply(key, mean_dense, mean_sparse)
                self._advanced.pop(key, asyncio.Event()).set()
            elif p.sync.drop_dead and set(p.sync.missing(self.replicas)) <= self._gone and self._drop_dead(key):
                pass  # every replica still missing is one already known gone: no need to wait for it
            else:
                waits.append((key, mine))
        for key, mine in waits:
            await self._wait_step(ctx, key, mine)
        syncs = [s for k in by_part if (s := self.store.get(*k).sync) is not None]
        return {"step": max(s.step for s in syncs) if syncs else None, "stale": stale,
                "replicas": sorted({r for s in syncs for r in s.last_contributors}) if syncs else None}

    def _apply(self, key: PartKey, dense: dict, sparse: Any) -> None:
        for (a, b), grad in dense.items():
            p = self.store.get(*key)
            self.store.apply_dense(key[0], key[1], grad, a if p.full_shape else None, b if p.full_shape else None)
        if sparse is not None:
            self.store.apply_sparse(key[0], key[1], *sparse)

    async def _wait_step(self, ctx: CallContext, key: PartKey, mine: int) -> None:
        p = self.store.get(*key)
        loop = asyncio.get_running_loop()
        epoch = self.epoch
        while p.sync is not None and p.sync.step <= mine:
            if self.epoch != epoch:  # a recovery began: this step will never complete as it was
                raise Recovering(f"step {mine} of {part_label(key)} was abandoned: the shard is being restored "
                                 f"from a checkpoint (recovery epoch {self.epoch})", epoch=self.epoch)
            event = self._advanced[key]
            remaining = None if ctx.deadline is None else ctx.deadline - loop.time() - _SYNC_MARGIN
            if remaining is not None and remaining <= 0:
                missing = p.sync.missing(self.replicas) or ["(unknown)"]
                raise DeadlineExceeded(
                    f"step {mine} of {part_label(key)} was not completed: {len(p.sync.contributors)} of "
                    f"{p.sync.replicas_to_aggregate} gradients arrived; no push from {', '.join(missing)}",
                    missing=missing,
                )
            try:
                await asyncio.wait_for(event.wait(), remaining if not p.sync.drop_dead else min(remaining or 0.5, 0.5))
            except TimeoutError:
                if p.sync.drop_dead and p.sync.step <= mine:
                    self._drop_dead(key)
                continue

    def _drop_dead(self, key: PartKey) -> bool:
        """Finish the pending step when every replica that has not pushed is known to be gone
        (checked on the connection each last pushed from: a restarted replica counts again from
        its first push)."""
        p = self.store.get(*key)
        sync = p.sync
        if sync is None or not sync.contributors or self._reachable is None:
            return False
        missing = sync.missing(self.replicas)
        gone = [m for m in missing if m in self._pushers and not self._reachable(self._pushers[m])]
        if not missing or len(gone) < len(missing):
            return False
        if not set(gone) <= self._gone:  # said once per replica lost, not on every step without it
            log.warning("%s: step %d completes with %d of %d replicas; gone: %s", p.label, sync.step,
                        len(sync.contributors), sync.replicas_to_aggregate, ", ".join(gone))
            self._gone |= set(gone)
        mean_dense, mean_sparse = sync.take()
        self._apply(key, mean_dense, mean_sparse)
        self._advanced.pop(key, asyncio.Event()).set()
        return True

    def _check_rows(self, name: str, part: int, start: int | None, stop: int | None, value: Any, what: str) -> None:
        p = self.store.get(name, part)
        if not isinstance(value, np.ndarray):
            raise InvalidArgument(f"{what} of {p.label}: expected an array, got {type(value).__name__}")
        if value.dtype != p.dtype:
            raise InvalidArgument(f"{what} of {p.label}: expected dtype {p.dtype}, got {value.dtype}")
        if p.full_shape:
            a = 0 if start is None else start
            b = p.nrows if stop is None else stop
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= p.nrows):
                raise InvalidArgument(f"{what} of {p.label}: rows [{start}, {stop}) outside [0, {p.nrows})")
            expected = (b - a, *p.full_shape[1:])
        else:
            expected = ()
        if tuple(value.shape) != expected:
            raise InvalidArgument(f"{what} of {p.label}: expected shape {list(expected)}, got {list(value.shape)}")


def _item(item: Any, n: int, what: str) -> list[Any]:
    if not isinstance(item, list) or len(item) != n or not isinstance(item[0], str) or not isinstance(item[1], int):
        raise InvalidArgument(f"{what}: each item must be a list of {n} fields starting with name and part, got {item!r}")
    return item
