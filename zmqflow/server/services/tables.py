"""Embedding-table ops of the ps service: static parts live in the shard's store, dynamic parts
are hash tables. Ids arrive de-duplicated and already mapped to the part by the client, checked
as 1-D integer arrays at the edge (:mod:`zmqflow.wire.requests.ps`)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ...errors import InvalidArgument, ResourceExhausted, VariableConflict
from ...state.limits import StateLimits, check_count, table_capacity
from ...state.sparse import int64_ids
from ...state.tables import HashTable
from ...state.store import PartKey, ShardStore
from ...rpc import CallContext, op
from ...wire.dtypes import dtype_from_name
from ...wire.requests import ps as rq

__all__ = ["TableOps"]


class TableOps:
    """Mixed into the ps service, which provides ``store`` and ``tables``."""

    store: ShardStore
    tables: dict[PartKey, HashTable]
    _table_specs: dict[PartKey, tuple]
    limits: StateLimits

    def create_part(self, ctx: CallContext, name: str, part: int, shape: list[int], rows: list[int], dtype: str,
                    **kwargs: Any) -> "bool | Coroutine[Any, Any, bool]":
        raise NotImplementedError  # the ps service's: checked, and built off the loop when big

    def note_maker(self, ctx: CallContext | None, key: PartKey) -> None:
        raise NotImplementedError  # the ps service's: whose declaration a part is, for ps.drop

    @op(rq.EmbCreate)
    def emb_create(self, ctx: CallContext, req: rq.EmbCreate) -> "bool | Coroutine[Any, Any, bool]":
        """A static part as a store part (built off the loop when big); a dynamic part as a hash
        table with a finite capacity (the limits' default when the request names none)."""
        name, part = req.name, req.part
        if req.kind == "static":
            return self.create_part(ctx, name, part, [req.num_embeddings or 0, req.dim], [0, req.rows], req.dtype,
                                    num_parts=req.num_parts, optimizer=req.optimizer, initializer=req.initializer,
                                    salt=part + 1)
        key = (name, part)
        spec = (req.dim, req.dtype, req.min_frequency, req.capacity, req.num_parts)
        if key in self.tables:
            if self._table_specs[key] != spec:
                raise VariableConflict(f"embedding {name!r} part {part} exists as (dim, dtype, min_frequency, capacity, "
                                       f"parts) {self._table_specs[key]}; declared as {spec}")
            self.note_maker(ctx, key)
            return False
        limits = self.limits
        check_count(name, len(self.store.parts) + len(self.tables), limits.max_variables, "this shard")
        dtype = dtype_from_name(req.dtype)
        capacity = table_capacity(name, req.capacity, HashTable.row_size(req.dim, dtype, req.optimizer), limits)
        self.tables[key] = HashTable(req.dim, dtype, initializer=req.initializer, optimizer=req.optimizer,
                                     min_frequency=req.min_frequency, capacity=capacity, seed_salt=part + 1,
                                     max_pending=limits.max_pending_admission, room=self._room)
        self._table_specs[key] = spec
        self.note_maker(ctx, key)
        return True

    def _room(self) -> int:
        """Bytes the shard's budget has left for more table rows: each part's capacity is checked
        alone, so parts that would fill together stop growing here, at the budget."""
        return self.limits.max_shard_bytes - self._held()

    def _held(self) -> int:
        """Bytes the shard holds in variables (with their slots) and table rows."""
        return self.store.held_bytes() + sum(t.nbytes for t in self.tables.values())

    def _starved(self, name: str, part: int, table: HashTable) -> None:
        """A dynamic part that holds no row and has no room for one: every lookup would read zeros
        and every push be dropped, for as long as the shard's other parts hold its budget."""
        held = self._held()
        raise ResourceExhausted(
            f"embedding {name!r} (part {part}): this shard's byte budget of {self.limits.max_shard_bytes} bytes is "
            f"held by its other variables and tables ({held} bytes), so the table cannot hold a row of "
            f"{table.row_bytes} bytes: give the other tables a capacity, evict their rows, place this one on "
            "another shard, or raise the budget (--max-shard-bytes)", name=name, part=part,
            limit=self.limits.max_shard_bytes)

    def _check_room(self, name: str, part: int, table: HashTable, creates: bool) -> None:
        """ResourceExhausted where a lookup that creates rows finds a table holding none and no room
        for one (it would read zeros, silently, for as long as the others hold the budget)."""
        if creates and not len(table) and self._room() < table.row_bytes:
            self._starved(name, part, table)

    def _table(self, name: str, part: int) -> HashTable | None:
        return self.tables.get((name, part))

    @op(rq.EmbLookup)
    def emb_lookup(self, ctx: CallContext, req: rq.EmbLookup) -> np.ndarray:
        return self._lookup_of(req.name, req.part, req.ids, req.create)()

    @op(rq.EmbLookupMany)
    def emb_lookup_many(self, ctx: CallContext, req: rq.EmbLookupMany) -> list[np.ndarray]:
        """Several parts' lookups (a model's tables on this shard) in one request. Every item is
        checked first: a lookup with ``create`` changes a hash table, so an item refused must find
        the ones before it not yet done. One check needs the items before done: an empty dynamic
        table with no room left, as the rows an earlier item made may leave it, is refused there,
        as its own lookup after theirs would be."""
        lookups = [self._lookup_of(it.name, it.part, it.ids, req.create) for it in req.items]
        return [lookup() for lookup in lookups]

    def _lookup_of(self, name: str, part: int, ids: np.ndarray, create: bool) -> Callable[[], np.ndarray]:
        """The lookup of part-local ``ids`` in a part, checked, to run when called."""
        ids = int64_ids(ids, f"emb_lookup of {name!r}")
        table = self._table(name, part)
        if table is not None:
            self._check_room(name, part, table, create and ids.size > 0)

            def lookup() -> np.ndarray:  # an earlier item of the request may have taken the room
                self._check_room(name, part, table, create and ids.size > 0)
                return table.lookup(ids, create=create)
            return lookup
        p = self.store.get(name, part)
        if ids.size and (ids.min() < 0 or ids.max() >= p.nrows):
            bad = ids[(ids < 0) | (ids >= p.nrows)][0]
            raise InvalidArgument(f"embedding {p.label}: row {int(bad)} out of range [0, {p.nrows})")
        return lambda: np.take(p.value, ids, axis=0)  # a new array, as indexing makes, in half its time

    @op(rq.EmbPush)
    def emb_push(self, ctx: CallContext, req: rq.EmbPush) -> int:
        return self._push_of(req.name, req.part, req.ids, req.grads, req.step)()

    @op(rq.EmbPushMany)
    def emb_push_many(self, ctx: CallContext, req: rq.EmbPushMany) -> list[int]:
        """Several parts' sparse gradients in one request, applied in order once every item is
        checked; the rows applied per item."""
        pushes = [self._push_of(it.name, it.part, it.ids, it.grads, req.step) for it in req.items]
        return [push() for push in pushes]

    def _push_of(self, name: str, part: int, ids: np.ndarray, grads: np.ndarray,
                 step: int | None) -> Callable[[], int]:
        """The push of a part's gradients, checked, to run when called: the rows it applies."""
        ids = int64_ids(ids, f"emb_push of {name!r}")
        table = self._table(name, part)
        if table is not None:
            table.check_push(ids, grads, step)
            return lambda: table.push(ids, grads, step)
        update = self.store.sparse(name, part, ids, grads, "sparse gradient")

        def apply() -> int:
            self.store.apply(update)
            return len(ids)
        return apply

    @op(rq.EmbIds)
    def emb_stats(self, ctx: CallContext, req: rq.EmbIds) -> dict[str, Any]:
        table = self._table(req.name, req.part)
        if table is not None:
            return table.stats()
        p = self.store.get(req.name, req.part)
        return {"rows": p.nrows, "bytes": p.nbytes}

    @op(rq.EmbEvict)
    def emb_evict(self, ctx: CallContext, req: rq.EmbEvict) -> int:
        table = self._table(req.name, req.part)
        if table is None:
            raise InvalidArgument(f"embedding {req.name!r} is static: only dynamic tables evict rows")
        return table.evict(req.older_than_step, req.older_than_seconds)

    @op(rq.EmbExport)
    def emb_export(self, ctx: CallContext, req: rq.EmbExport) -> dict[str, Any]:
        """A page of this part's rows: ``ids`` (part-local rows for static tables) and ``rows``."""
        table = self._table(req.name, req.part)
        start, limit = req.start, req.limit
        if table is not None:  # its page is a copy already
            ids, rows, more = table.export_page(start, limit, req.after)
            return {"ids": ids, "rows": rows, "more": more}
        p = self.store.get(req.name, req.part)  # a static part's page: its rows as they lie, copied out
        if req.after is not None:
            raise InvalidArgument(f"emb_export of {p.label}: 'after' pages a dynamic table; a static one pages by "
                                  "'start'")
        total = p.nrows
        ids = np.arange(min(start, total), min(start + limit, total), dtype=np.int64)
        return {"ids": ids, "rows": p.value[start: start + limit].copy(), "more": start + limit < total}
