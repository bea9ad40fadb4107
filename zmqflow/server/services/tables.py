"""Embedding-table ops of the ps service: static parts live in the shard's store, dynamic parts
are hash tables. Ids arrive de-duplicated and already mapped to the part by the client."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InvalidArgument, VariableConflict
from ...state.tables import HashTable
from ...state.store import PartKey, ShardStore
from ...rpc import CallContext, op
from ...wire.dtypes import dtype_from_name

__all__ = ["TableOps"]


class TableOps:
    """Mixed into the ps service, which provides ``store`` and ``tables``."""

    store: ShardStore
    tables: dict[PartKey, HashTable]
    _table_specs: dict[PartKey, tuple]

    @op
    def emb_create(self, ctx: CallContext, name: str, part: int, kind: str, dim: int, dtype: str, rows: int = 0,
                   num_embeddings: int | None = None, num_parts: int = 1, optimizer: Any = None,
                   initializer: Any = None, min_frequency: int = 1, capacity: int | None = None) -> bool:
        if kind == "static":
            return self.store.create(name, part, [int(num_embeddings or 0), dim], [0, rows], dtype, num_parts=num_parts,
                                     optimizer=optimizer, initializer=initializer, salt=part + 1)
        if kind != "hash":
            raise InvalidArgument(f"embedding {name!r}: unknown table kind {kind!r} (static, hash)")
        key = (name, int(part))
        spec = (int(dim), dtype, int(min_frequency), capacity, int(num_parts))
        if key in self.tables:
            if self._table_specs[key] != spec:
                raise VariableConflict(f"embedding {name!r} part {part} exists as (dim, dtype, min_frequency, capacity, "
                                       f"parts) {self._table_specs[key]}; declared as {spec}")
            return False
        self.tables[key] = HashTable(dim, dtype_from_name(dtype), initializer=initializer, optimizer=optimizer,
                                     min_frequency=min_frequency, capacity=capacity, seed_salt=part + 1)
        self._table_specs[key] = spec
        return True

    def _table(self, name: str, part: int) -> HashTable | None:
        return self.tables.get((name, int(part)))

    @op
    def emb_lookup(self, ctx: CallContext, name: str, part: int, ids: np.ndarray, create: bool = True) -> np.ndarray:
        ids = _ids(ids, name)
        table = self._table(name, part)
        if table is not None:
            return table.lookup(ids, create=bool(create))
        p = self.store.get(name, part)
        if ids.size and (ids.min() < 0 or ids.max() >= p.nrows):
            raise InvalidArgument(f"embedding {p.label}: row {int(ids.max())} out of range [0, {p.nrows})")
        return p.value[ids]

    @op
    def emb_push(self, ctx: CallContext, name: str, part: int, ids: np.ndarray, grads: np.ndarray) -> int:
        ids = _ids(ids, name)
        table = self._table(name, part)
        if table is None:
            self.store.apply_sparse(name, part, ids, grads)
            return len(ids)
        if not isinstance(grads, np.ndarray) or grads.dtype != table.dtype or grads.shape != (len(ids), table.dim):
            got = f"{grads.dtype} {list(grads.shape)}" if isinstance(grads, np.ndarray) else type(grads).__name__
            raise InvalidArgument(f"embedding {name!r}: gradients must be {table.dtype} {[len(ids), table.dim]}, got {got}")
        return table.push(ids, grads)

    @op
    def emb_stats(self, ctx: CallContext, name: str, part: int) -> dict[str, Any]:
        table = self._table(name, part)
        if table is not None:
            return table.stats()
        p = self.store.get(name, part)
        return {"rows": p.nrows, "bytes": p.nbytes}

    @op
    def emb_evict(self, ctx: CallContext, name: str, part: int, older_than_step: int | None = None,
                  older_than_seconds: float | None = None) -> int:
        table = self._table(name, part)
        if table is None:
            raise InvalidArgument(f"embedding {name!r} is static: only dynamic tables evict rows")
        return table.evict(older_than_step, older_than_seconds)

    @op
    def emb_export(self, ctx: CallContext, name: str, part: int, start: int = 0, limit: int = 1 << 16) -> dict[str, Any]:
        """A page of this part's rows: ``ids`` (part-local rows for static tables) and ``rows``."""
        table = self._table(name, part)
        if table is not None:
            ids, rows = table.export()
        else:
            p = self.store.get(name, part)
            ids, rows = np.arange(p.nrows, dtype=np.int64), p.value
        end = min(len(ids), start + limit)
        return {"ids": ids[start:end].copy(), "rows": rows[start:end].copy(), "more": end < len(ids)}


def _ids(ids: Any, name: str) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgument(f"embedding {name!r}: ids must be a 1-D integer array")
    return ids.astype(np.int64, copy=False)
