"""Embedding tables served sharded, seen from a client: lookups and sparse pushes.

Ids are de-duplicated here; each shard that owns some of them gets exactly one request, all at
once, and shards owning none get none. Gradients for repeated ids are summed here, so each shard
receives only its unique ids and their rows: nothing is ever densified.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..state import init as _init
from ..state import optim as _optim
from ..cluster import TaskId, shard_tasks
from ..errors import InvalidArgument
from .claims import declare_claimed, settle
from .embedding_delta import export_delta
from ..observe import timeline
from .port import SessionPort
from .placement import current_device, current_policy
from ..state.owners import hash_owner, static_owner, static_part_rows
from ..state.partition import Partitioner
from ..state.kernels import segment_sum
from ..state.sparse import groups, int64_ids, strictly_increasing, unique_inverse, unique_sum
from ..wire.dtypes import dtype_from_name, dtype_name
from ..wire.requests import Request
from ..wire.requests import cluster as crq
from ..wire.requests import ps as rq


__all__ = ["TableInfo", "AsyncEmbedding", "declare_embedding", "create_table_parts", "COMBINERS", "uniques",
           "push_step"]

COMBINERS = ("sum", "mean", "sqrtn")


@dataclass(frozen=True, eq=False)
class TableInfo:
    name: str
    num_embeddings: int | None  # None: a dynamic (hash) table
    dim: int
    dtype: np.dtype
    strategy: str  # mod, div or hash
    tasks: tuple[TaskId, ...]
    part_rows: tuple[int, ...]

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "TableInfo":
        t = r.get("table")
        if not t:
            raise InvalidArgument(f"{r['name']!r} is a variable, not an embedding table")
        return cls(r["name"], t["num_embeddings"], t["dim"], dtype_from_name(r["dtype"]), t["strategy"],
                   tuple(TaskId.parse(p["task"]) for p in r["parts"]), tuple(p["rows"][1] for p in r["parts"]))

    @property
    def parts(self) -> int:
        return len(self.tasks)

    def owners(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, id within the part) for unique, validated ids."""
        if self.num_embeddings is None:
            return hash_owner(ids, self.parts), ids
        return static_owner(ids, self.num_embeddings, self.parts, self.strategy)

    def global_ids(self, part: int, local: np.ndarray) -> np.ndarray:
        if self.num_embeddings is None:
            return local
        if self.strategy == "mod":
            return local * self.parts + part
        return local + sum(self.part_rows[:part])


async def declare_embedding(sess: SessionPort, name: str, num_embeddings: int | None, dim: int, *,
                            partitions: Any = None, partition_strategy: str = "mod", dtype: Any = "float32",
                            initializer: Any = None, optimizer: Any = None, min_frequency: int = 1,
                            capacity: int | None = None) -> TableInfo:
    dynamic = num_embeddings is None
    if not isinstance(dim, int) or dim < 1:
        raise InvalidArgument(f"embedding {name!r}: dim must be a positive int, got {dim!r}")
    if not dynamic and (not isinstance(num_embeddings, int) or num_embeddings < 1):
        raise InvalidArgument(f"embedding {name!r}: num_embeddings must be a positive int or None, got {num_embeddings!r}")
    if not dynamic and partition_strategy not in ("mod", "div"):
        raise InvalidArgument(f"embedding {name!r}: partition_strategy must be 'mod' or 'div', got {partition_strategy!r}")
    if not dynamic and (min_frequency != 1 or capacity is not None):
        raise InvalidArgument(f"embedding {name!r}: min_frequency and capacity apply to dynamic tables (num_embeddings=None)")
    for what, value, may_be_none in (("min_frequency", min_frequency, False), ("capacity", capacity, True)):
        if not (value is None and may_be_none) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            # checked before the catalog record: a record whose parts no shard will make blocks the name
            raise InvalidArgument(f"embedding {name!r}: {what} must be a positive int"
                                  f"{' or None' if may_be_none else ''}, got {value!r}")
    dt = np.dtype(dtype)
    spec = await sess.cluster()
    if partitions is None:
        n = len(shard_tasks(spec))
    elif isinstance(partitions, Partitioner):
        n = partitions.count((num_embeddings or max(capacity or 1, 1), dim), dt)
    elif isinstance(partitions, int) and not isinstance(partitions, bool) and partitions >= 1:
        n = partitions
    else:
        raise InvalidArgument(f"embedding {name!r}: partitions must be a positive int or a partitioner, got {partitions!r}")
    rows = [0] * n if dynamic else static_part_rows(num_embeddings, min(n, num_embeddings), partition_strategy)
    opt_spec = None if optimizer is None else optimizer.spec() if hasattr(optimizer, "spec") else optimizer
    if isinstance(_optim.from_spec(opt_spec), _optim.SyncReplicas):
        raise InvalidArgument(f"embedding {name!r}: tables take asynchronous sparse updates; SyncReplicas is for variables")
    init_spec = _init.from_spec(initializer if initializer is not None else _init.zeros()).spec()
    table = {
        "kind": "hash" if dynamic else "static",
        "strategy": "hash" if dynamic else partition_strategy,
        "num_embeddings": num_embeddings,
        "dim": dim,
        "min_frequency": int(min_frequency),
        "capacity": capacity,
    }
    device = current_device()
    request = crq.Declare(
        name=name,
        shape=[num_embeddings or 0, dim],
        dtype=dtype_name(dt),
        part_rows=[[0, r] for r in rows],
        part_bytes=[r * dim * dt.itemsize for r in rows],
        device=None if device is None else str(device),
        policy=current_policy().name,
        optimizer=opt_spec,
        initializer=init_spec,
        table=table,
    )

    async def create(record: dict[str, Any], info: TableInfo, claim: str) -> bool:
        # a table's parts come from the record's initializer, whoever holds the claim to create them
        return await settle(sess, name, claim, _table_creates(sess, info, record))

    return await declare_claimed(sess, "embedding", name, request, TableInfo.from_record, create)


def _table_creates(sess: SessionPort, info: TableInfo, record: dict[str, Any]) -> list[Awaitable[Any]]:
    """One create per part of a table, on its shard, from the record's initializer."""
    t = record["table"]
    return [
        sess.call_task(task, "ps", "emb_create", rq.EmbCreate(
            name=info.name, part=p, kind=t["kind"], dim=info.dim, dtype=dtype_name(info.dtype),
            rows=info.part_rows[p], num_embeddings=info.num_embeddings, num_parts=info.parts,
            optimizer=record.get("optimizer"), initializer=record.get("initializer"),
            min_frequency=t["min_frequency"], capacity=t["capacity"],
        ))
        for p, task in enumerate(info.tasks)
    ]


async def create_table_parts(sess: SessionPort, info: TableInfo, record: dict[str, Any]) -> None:
    """Create every part of a table on its shard (get-or-create: parts that exist are kept)."""
    await asyncio.gather(*_table_creates(sess, info, record))


def uniques(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(the unique ids of ``flat``, sorted; each id's index among them, or None where ``flat`` is
    already unique and sorted, as torch's layer sends them: its own uniques)."""
    return (flat, None) if strictly_increasing(flat) else unique_inverse(flat)


def push_step(step: Any, what: str) -> int | None:
    """A push's ``step`` as an int, or None; InvalidArgument unless an integer >= 0."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0):
        raise InvalidArgument(f"{what}: step must be an integer >= 0, got {step!r}")
    return None if step is None else int(step)


class AsyncEmbedding:
    """A handle on an embedding table; every method is a coroutine."""

    def __init__(self, session: SessionPort, info: TableInfo):
        self._session = session
        self.info = info

    name = property(lambda self: self.info.name)
    dim = property(lambda self: self.info.dim)
    session = property(lambda self: self._session, doc="the session this handle calls through")

    @property
    def partitions(self) -> list[dict[str, Any]]:
        return [{"task": str(t), "rows": r} for t, r in zip(self.info.tasks, self.info.part_rows)]

    def check_ids(self, ids: Any, what: str) -> np.ndarray:
        """``ids`` flat, as int64, each in the table's range (InvalidArgument naming ``what`` if not)."""
        flat = int64_ids(np.asarray(ids).reshape(-1), f"{what} of {self.name!r}")
        num = self.info.num_embeddings
        if num is not None and flat.size and (flat.min() < 0 or flat.max() >= num):  # two reductions, no masks
            bad = (flat < 0) | (flat >= num)
            raise InvalidArgument(f"{what} of {self.name!r}: id {int(flat[bad][0])} out of range [0, {num})")
        return flat

    def check_grads(self, ids: Any, grads: Any) -> np.ndarray:
        """``grads`` for ``ids`` (of their shape, plus the table's width) as (ids, dim) rows."""
        g = np.asarray(grads)
        if g.dtype != self.info.dtype:
            raise InvalidArgument(f"push of {self.name!r}: gradients must be {self.info.dtype}, got {g.dtype}")
        if g.shape != (*np.shape(ids), self.dim):
            raise InvalidArgument(f"push of {self.name!r}: gradients must have shape {[*np.shape(ids), self.dim]}, "
                                  f"got {list(g.shape)}")
        return g.reshape(-1, self.dim)

    def split(self, uniq: np.ndarray) -> list[tuple[int, Any, np.ndarray]]:
        """(part, which of ``uniq`` it owns, their part-local ids) for each part owning some of
        the unique, checked ids ``uniq``."""
        part, local = self.info.owners(uniq)
        present = [0] if len(self.info.tasks) == 1 else np.flatnonzero(np.bincount(part)).tolist()
        if len(present) == 1:  # one part owns them all: a view, no mask to build
            return [(present[0], slice(None), local)]
        splits = []
        for p in present:
            mask = part == p
            splits.append((p, mask, local[mask]))  # a boolean index copies, C-ordered
        return splits

    def reply_bytes(self, ids: np.ndarray) -> int:
        """The size of a lookup's answer for ``ids``: what the receiver may expect."""
        return len(ids) * self.info.dim * self.info.dtype.itemsize

    def assemble(self, n: int, answers: list[tuple[Any, Any]]) -> np.ndarray:
        """The rows of ``n`` unique ids from each part's ``(mask, rows)`` answer: a one-part
        answer as it came, where it is what was asked for (a received frame's view, read-only)."""
        rows = answers[0][1] if len(answers) == 1 else None
        if isinstance(rows, np.ndarray) and rows.shape == (n, self.dim) and rows.dtype == self.info.dtype:
            return rows
        rows = np.empty((n, self.dim), self.info.dtype)
        for mask, got in answers:
            rows[mask] = got
        return rows

    async def _per_part(self, uniq: np.ndarray, op: str, create: bool = True, rows: np.ndarray | None = None,
                        timeout: float | None = None, step: int | None = None) -> list[tuple[Any, Any]]:
        """``emb_lookup`` (``rows`` None) or ``emb_push`` of ``rows`` to each part owning some ids."""
        splits = self.split(uniq)
        calls = []
        for p, mask, ids in splits:
            body: Request = (rq.EmbLookup(name=self.name, part=p, ids=ids, create=create) if rows is None else
                             rq.EmbPush(name=self.name, part=p, ids=ids, grads=rows[mask], step=step))
            size = self.reply_bytes(ids) if rows is None else 0
            calls.append(self._session.call_task(self.info.tasks[p], "ps", op, body, timeout=timeout, size=size))
        results = await asyncio.gather(*calls)
        return [(mask, r) for (_, mask, _), r in zip(splits, results)]

    # Every method takes ``timeout=``: the deadline of each of its requests (the session's by
    # default). A shard that does not answer in time: DeadlineExceeded.
    @timeline.traced("pull", "embedding lookup")
    async def lookup(self, ids: Any, *, create: bool = True, timeout: float | None = None) -> np.ndarray:
        """Rows for ``ids`` of any integer shape: an array of shape ``(*ids.shape, dim)``."""
        shape = np.shape(ids)
        flat = self.check_ids(ids, "lookup")
        if flat.size == 0:
            return np.zeros((*shape, self.dim), self.info.dtype)
        rows, inverse = await self._unique_rows(flat, create, timeout)
        return self.spread(rows, inverse, shape)

    def spread(self, rows: np.ndarray, inverse: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
        """The rows of the unique ids ``rows`` given back for each id (``inverse``; None: the ids
        were their own uniques), in the ids' ``shape``; the caller's own (a received view copied)."""
        if inverse is None:
            return (rows if rows.flags.writeable else rows.copy()).reshape(*shape, self.dim)
        # ``take`` gathers a new array, twice as fast as indexing
        return np.take(rows, inverse, axis=0).reshape(*shape, self.dim)

    async def _unique_rows(self, flat: np.ndarray, create: Any,
                           timeout: float | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(the rows of ``flat``'s unique ids, read-only where they are a received frame; each
        id's index among them, or None where ``flat`` is its own uniques)."""
        uniq, inverse = uniques(flat)
        answers = await self._per_part(uniq, "emb_lookup", bool(create), timeout=timeout)
        return self.assemble(len(uniq), answers), inverse

    async def lookup_sparse(self, ids: Any, segment_ids: Any, weights: Any = None, combiner: str = "mean",
                            num_segments: int | None = None, *, create: bool = True,
                            timeout: float | None = None) -> np.ndarray:
        """TF's embedding_lookup_sparse: rows combined per segment by ``sum``, ``mean`` or ``sqrtn``.
        The rows come from :meth:`lookup`, ``create`` included: with False, an id a dynamic table
        does not hold reads zeros and is neither created nor counted towards admission (serving)."""
        if combiner not in COMBINERS:
            raise InvalidArgument(f"combiner must be one of {', '.join(COMBINERS)}, got {combiner!r}")
        flat = self.check_ids(ids, "lookup_sparse")
        seg = np.asarray(segment_ids).reshape(-1)
        if seg.shape != flat.shape or (seg.size and (seg.dtype.kind not in "iu" or seg.min() < 0)):
            raise InvalidArgument(f"segment_ids must be non-negative ints, one per id ({flat.size}), got {seg.shape}")
        w = np.ones(flat.size, np.float64) if weights is None else np.asarray(weights, np.float64).reshape(-1)
        if w.shape != flat.shape:
            raise InvalidArgument(f"weights must have one value per id ({flat.size}), got {w.shape}")
        n = int(num_segments) if num_segments is not None else (int(seg.max()) + 1 if seg.size else 0)
        if n < 0 or (seg.size and int(seg.max()) >= n):
            raise InvalidArgument(f"lookup_sparse of {self.name!r}: num_segments {n} must be >= 0 and above every "
                                  f"segment id (the largest is {int(seg.max()) if seg.size else None})")
        seg = seg.astype(np.int64, copy=False)  # checked above: each in [0, n)
        summed = np.zeros((n, self.dim))
        if flat.size:
            rows, inverse = await self._unique_rows(flat, create, timeout)
            rows = rows.astype(np.float64)  # summed in float64, then cast to the table's type once
            # each segment's rows, scaled by their weights, summed in one pass read from the unique rows
            present, order, starts = groups(seg)
            summed[present] = segment_sum(rows, order if inverse is None else np.take(inverse, order), starts,
                                          None if weights is None else np.take(w, order))
        if combiner != "sum":
            norm = np.bincount(seg, weights=w if combiner == "mean" else w * w, minlength=n)
            norm = norm if combiner == "mean" else np.sqrt(norm)
            summed = np.divide(summed, norm[:, None], out=np.zeros_like(summed), where=norm[:, None] != 0)
        return summed.astype(self.info.dtype)

    @timeline.traced("push", "embedding push")
    async def push(self, ids: Any, grads: Any, *, step: int | None = None, timeout: float | None = None) -> int:
        """Sparse gradients: duplicates summed here, each shard gets its unique ids only. Returns
        how many rows were updated (rows a dynamic table has not admitted are dropped and counted).
        ``step`` (the training's global step) is what a dynamic table records as the rows' change
        step, for :meth:`export_delta`; without it each part counts its pushes."""
        flat = self.check_ids(ids, "push")
        g = self.check_grads(ids, grads)
        if flat.size == 0:
            return 0
        uniq, summed = unique_sum(flat, g)
        step = push_step(step, f"push of {self.name!r}")
        return sum(int(r) for _, r in await self._per_part(uniq, "emb_push", rows=summed, timeout=timeout, step=step))

    async def export_delta(self, since_step: int, directory: str, *, timeout: float | None = None) -> str:
        """Write the rows of this dynamic table changed at steps >= ``since_step`` (ids, current
        values) and the ids dropped since, one safetensors file per part, then a manifest;
        returns the manifest's path. ``directory`` must lie in the shards' checkpoint roots."""
        if self.info.num_embeddings is not None:
            raise InvalidArgument(f"export_delta of {self.name!r}: a static table does not track changed rows; "
                                  f"use export()")
        return await export_delta(self._session, self.name, self.info.tasks, since_step, directory, dim=self.dim,
                                  dtype=dtype_name(self.info.dtype), timeout=timeout)

    async def stats(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(
            self._session.call_task(t, "ps", "emb_stats", rq.EmbIds(name=self.name, part=p), timeout=timeout)
            for p, t in enumerate(self.info.tasks)
        )))

    async def size(self, *, timeout: float | None = None) -> int:
        """Rows held, over all shards."""
        return sum(s["rows"] for s in await self.stats(timeout=timeout))

    async def evict(self, older_than: "int | float | datetime.timedelta | None" = None, *,
                    older_than_steps: int | None = None, older_than_seconds: float | None = None,
                    timeout: float | None = None) -> int:
        """Drop rows of a dynamic table not updated in the last N pushes (an int) or for a while
        (a timedelta, or ``older_than_seconds``). Returns how many were dropped."""
        if isinstance(older_than, datetime.timedelta):
            older_than_seconds = older_than.total_seconds()
        elif isinstance(older_than, int) and not isinstance(older_than, bool):
            older_than_steps = older_than
        elif older_than is not None:
            raise InvalidArgument("older_than is a number of pushes (int) or a datetime.timedelta")
        if older_than_steps is None and older_than_seconds is None:
            raise InvalidArgument("evict needs older_than, older_than_steps or older_than_seconds")
        for what, value in (("older_than_steps", older_than_steps), ("older_than_seconds", older_than_seconds)):
            if value is not None and not value >= 0:  # a negative age would drop every row
                raise InvalidArgument(f"evict of {self.name!r}: {what} must be >= 0, got {value!r}")
        counts = await asyncio.gather(*(
            self._session.call_task(t, "ps", "emb_evict", rq.EmbEvict(
                name=self.name, part=p, older_than_step=older_than_steps, older_than_seconds=older_than_seconds),
                timeout=timeout)
            for p, t in enumerate(self.info.tasks)
        ))
        return int(sum(counts))

    async def export(self, page: int = 1 << 16, *, timeout: float | None = None) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        """``(ids, rows)`` shard by shard, a page at a time, for serving (``timeout``: per page).
        A dynamic table, which may change while it is exported, pages by the last id returned:
        every row held throughout comes once; rows made or dropped meanwhile may or may not."""
        dynamic = self.info.num_embeddings is None
        for p, task in enumerate(self.info.tasks):
            start, after = 0, None
            while True:
                body = (rq.EmbExport(name=self.name, part=p, after=after, limit=page) if dynamic and after is not None
                        else rq.EmbExport(name=self.name, part=p, start=start, limit=page))
                got = await self._session.call_task(task, "ps", "emb_export", body, timeout=timeout)
                if len(got["ids"]):
                    yield self.info.global_ids(p, got["ids"]), got["rows"]
                    after = int(got["ids"][-1])
                if not got["more"]:
                    break
                start += len(got["ids"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.info.num_embeddings is None else f"{self.info.num_embeddings} x"
        return f"<AsyncEmbedding {self.name!r} {kind} {self.dim} {self.info.strategy} parts={self.info.parts}>"
