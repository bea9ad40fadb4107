"""The fence a ps shard raises while it is restored from a checkpoint.

Recovery must not mix old and new state: a worker that pushes or pulls while some parts are
restored and others are not would train on a state no checkpoint ever held. So the chief fences
every shard first; a fenced shard refuses data ops with ``Recovering`` (a kind of
``Unavailable``: workers wait and retry) and fails the sync pushes waiting on it, while the
restore's own ops (create, restore_part, emb_restore, sweep) go through. Each fence bumps the
shard's recovery epoch, and only the matching ``unfence`` lifts it, so a late unfence from an
older recovery cannot open a newer one.

A request sent before the fence can still be on its way after the unfence (it was in a socket
buffer all along). Requests on one connection arrive in order, so the shard refuses the first
data op after the recovery from every client that used it before the fence and has not been
refused since: whatever that client sent before was computed on the state the restore
replaced. Fresh clients, and the one that lifted the fence, are not refused.

The clients that used data ops are remembered by routing id until the next fence; each new
connection has a new one. So when that set passes ``MAX_USED_PEERS`` (and then twice the size it
was last pruned to) the clients no longer connected are dropped from it, as the fence itself does:
a routing id that is gone can send nothing more, so it has nothing in flight to refuse.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ...errors import InvalidArgument, Recovering
from ...state.tables import HashTable
from ...state.store import PartKey, ShardStore
from ...rpc import CallContext, op
from ...wire.requests import ps as rq

__all__ = ["FenceOps", "FENCED_OPS", "MAX_USED_PEERS"]

MAX_USED_PEERS = 4096  # remembered routing ids before the unreachable ones are dropped

# Ops that read or change training state: refused while the shard is fenced.
FENCED_OPS = frozenset({"pull", "pull_bulk", "push_bulk", "assign", "scatter", "push", "global_step", "save",
                        "emb_lookup", "emb_push", "emb_lookup_many", "emb_push_many", "emb_evict", "emb_export",
                        "emb_export_delta"})


class FenceOps:
    """Mixed into the ps service, which provides ``store``, ``tables`` and ``_advanced``."""

    store: ShardStore
    tables: dict[PartKey, HashTable]
    _table_specs: dict[PartKey, tuple]
    _advanced: dict[PartKey, asyncio.Event]
    _reachable: Any = None  # routing id -> still connected; None: not known (nothing is dropped)

    def _fence_init(self) -> None:
        self.epoch = 0  # recoveries this shard has been through
        self.fenced = False
        self._used: set[bytes] = set()  # clients that used data ops since the last fence
        self._used_cap = MAX_USED_PEERS  # the size of _used at which the gone ones are dropped
        self._behind: set[bytes] = set()  # clients whose next data op is refused: they have not heard

    def check_fence(self, name: str, peer: bytes) -> None:
        if name not in FENCED_OPS:
            return
        if self.fenced:
            self._behind.discard(peer)  # it hears now; what it sent before arrived before this
            raise Recovering(f"ps.{name} refused: this shard is being restored from a checkpoint "
                             f"(recovery epoch {self.epoch}); retry when recovery ends", epoch=self.epoch, fenced=True)
        if peer in self._behind:
            self._behind.discard(peer)
            raise Recovering(f"ps.{name} refused: the first request since this shard was restored (recovery epoch "
                             f"{self.epoch}); it may have been computed on the state the restore replaced: read "
                             f"again", epoch=self.epoch, fenced=False)
        used = self._used
        if peer not in used:
            used.add(peer)
            if len(used) > self._used_cap:
                self._prune_used()

    def _prune_used(self) -> None:
        """Drop the clients no longer connected; the next prune waits for the set to double, so a
        shard with many live clients probes each of them only now and then."""
        if self._reachable is not None:
            self._used = {p for p in self._used if self._reachable(p)}
        self._used_cap = max(MAX_USED_PEERS, 2 * len(self._used))

    @op(rq.Empty)
    def fence(self, ctx: CallContext, req: rq.Empty) -> int:
        """Refuse data ops until ``unfence``; wake the sync pushes waiting here (they fail with
        ``Recovering``, and their pending gradients are dropped). Returns the new epoch."""
        self.epoch += 1
        self.fenced = True
        # clients still connected (the others can send nothing more): bounded by the live ones
        self._behind = {p for p in self._behind | self._used if self._reachable is None or self._reachable(p)}
        self._used = set()
        self._used_cap = MAX_USED_PEERS
        for p in self.store.parts.values():
            if p.sync is not None:
                p.sync.discard()  # gradients of a step that will never complete as it was
        for event in self._advanced.values():
            event.set()
        self._advanced.clear()
        return self.epoch

    @op(rq.Unfence)
    def unfence(self, ctx: CallContext, req: rq.Unfence) -> bool:
        """Lift the fence of recovery ``epoch``; False when a newer recovery holds it."""
        if req.epoch != self.epoch:
            return False
        self.fenced = False
        self._behind.discard(ctx.peer)  # the restorer knows: its earlier requests were all answered
        return True

    @op(rq.Sweep)
    def sweep(self, ctx: CallContext, req: rq.Sweep) -> list[list[Any]]:
        """Drop every part and table not in ``keep`` (``[[name, part], ...]``, what the catalog
        places here): parts a lost catalog no longer knows would otherwise hold memory forever.
        Returns the dropped ``[name, part]`` pairs."""
        if not self.fenced:
            raise InvalidArgument("ps.sweep drops parts: it runs only on a fenced shard (ps.fence first)")
        wanted = {(k.name, k.part) for k in req.keep}
        dropped = [key for key in list(self.store.parts) if key not in wanted]
        dropped += [key for key in list(self.tables) if key not in wanted]
        for key in dropped:
            self.store.parts.pop(key, None)
            self.tables.pop(key, None)
            self._table_specs.pop(key, None)
        return [[name, part] for name, part in dropped]

    def fence_state(self) -> dict[str, Any]:
        """The recovery epoch, whether fenced, and how many clients the next fence may refuse once."""
        return {"epoch": self.epoch, "fenced": self.fenced, "data_clients": len(self._used)}
