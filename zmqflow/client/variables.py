"""Variables on parameter-server shards, seen from a client: declare, find, read, write, push.

A variable's record (from the catalog) says where each part lives. Reads and writes of big
variables are cut into row slices of at most ``SLICE_BYTES`` and bundled per shard into requests
of about that size, all sent at once: a 100 MB model moves as ~25 pipelined 4 MB requests, a
model of many small variables as one request per shard (per ``ITEMS_PER_REQUEST`` parts). A
synchronous part's gradient is kept in one request (one replica, one contribution), still in
frames of at most ``SLICE_BYTES``.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from ..state import init as _init
from ..state import optim as _optim
from ..cluster import TaskId
from ..errors import InvalidArgument
from ..observe import timeline
from ..transport.bulk import as_bytes
from .bulk_lanes import Lanes, streams
from .bulk_pull import Piece, pull_into
from .bulk_push import push_from
from .claims import declare_claimed, give_up, settle
from .port import SessionPort
from .placement import current_device, current_policy
from . import pull_plan
from .pull_plan import bundle
from .var_info import ITEMS_PER_REQUEST, SLICE_BYTES, VarInfo, check_out, checked_outs, landed, rows_of, runs_of_parts
from ..state.partition import num_partitions, row_splits
from ..wire.dtypes import dtype_name
from ..wire.requests import cluster as crq
from ..wire.requests import ps as rq


__all__ = ["SLICE_BYTES", "VarInfo", "check_out", "checked_grads", "gather_calls", "merged_answers", "AsyncVariable",
           "declare", "create_parts", "in_process", "pull", "push", "assign", "scatter"]

T = TypeVar("T")


def _pieces(info: VarInfo, part: int, x: np.ndarray, lanes: Lanes) -> list[Piece]:
    """Part ``part`` of a full-shape array ``x`` as bulk pieces, cut where ``lanes`` ends its transfers."""
    name, dtype = info.name, dtype_name(info.dtype)
    if not info.shape:
        lanes.whole(info.row_bytes)
        return [Piece(rq.PullItem(name, part, None, None), as_bytes(x), dtype)]
    _, r0, r1 = info.parts[part]
    return [Piece(rq.PullItem(name, part, a, b), as_bytes(rows_of(info, part, (a, b), x)), dtype)
            for a, b in lanes.rows(r1 - r0, info.row_bytes)]


async def _bulk_streams(sess: SessionPort, infos: Iterable[VarInfo], kind: str = "pull") -> dict[TaskId, Lanes]:
    """The bulk streams of ``kind`` of the tasks whose share of ``infos`` is big enough (``bulk_lanes.streams``)."""
    shares: dict[TaskId, int] = defaultdict(int)
    for info in infos:
        for p, (task, _, _) in enumerate(info.parts):
            shares[task] += info.part_bytes(p)
    return await streams(sess, shares, kind)


async def in_process(sess: SessionPort, tasks: set[TaskId]) -> set[TaskId]:
    """Those of ``tasks`` reached over inproc: a large reply from one is not a copy but the
    shard's own memory, shared with the client until the array goes."""
    if not tasks:
        return set()
    spec = await sess.cluster()
    return {t for t in tasks if spec.address(t).scheme == "inproc"}


async def gather_calls(calls: list[Any]) -> list[Any]:
    """Each coroutine's result, run together (no task when there is only one: scalar updates).
    On the first failure the rest are cancelled and awaited before it is raised, so none reads
    from or writes into a caller's arrays after the call has returned."""
    if len(calls) == 1:
        return [await calls[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in calls]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def _as_array(x: Any, info: VarInfo, what: str) -> np.ndarray:
    """``x`` as an array of the variable's full shape and dtype; python values are converted."""
    if isinstance(x, np.ndarray):
        if x.dtype != info.dtype:
            raise InvalidArgument(f"{what} of {info.name!r}: expected dtype {info.dtype}, got {x.dtype}")
    else:
        try:
            x = np.asarray(x, dtype=info.dtype)
        except (OverflowError, ValueError, TypeError) as exc:  # a value numpy cannot hold as the dtype
            raise InvalidArgument(f"{what} of {info.name!r}: cannot be held as {info.dtype}: {exc}") from None
    if x.shape != info.shape:
        if x.ndim == 0 and info.shape and what != "value":
            raise InvalidArgument(f"{what} of {info.name!r}: expected shape {list(info.shape)}, got a scalar")
        raise InvalidArgument(f"{what} of {info.name!r}: expected shape {list(info.shape)}, got {list(x.shape)}")
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)  # np.require costs ~1 us even when it has nothing to do


# declaring ----------------------------------------------------------------------------------


async def declare(
    sess: SessionPort,
    name: str,
    initial_value: Any = None,
    *,
    shape: Any = None,
    dtype: Any = None,
    initializer: Any = None,
    optimizer: Any = None,
    partitioner: Any = None,
) -> VarInfo:
    """Get-or-create: the catalog records (or returns) the placement. The declarer it hands the
    claim to creates the parts (from the record's initializer, else its value) and marks the
    record ready; any other waits for that (``claims``). A declaration by shape alone (neither a
    value nor an initializer: zeros) gives way to one with a value until the parts are made."""
    value = None
    if initial_value is not None:
        value = initial_value if isinstance(initial_value, np.ndarray) else np.asarray(initial_value, dtype=dtype or "float32")
        if dtype is not None and np.dtype(dtype) != value.dtype:
            value = value.astype(dtype)
        if shape is not None and tuple(shape) != value.shape:
            raise InvalidArgument(f"variable {name!r}: shape {list(shape)} disagrees with the initial value's {list(value.shape)}")
        value = np.require(value, requirements="C")
    dt = value.dtype if value is not None else np.dtype(dtype or "float32")
    dname = dtype_name(dt)
    if shape is None and value is None:
        raise InvalidArgument(f"variable {name!r}: give an initial value or a shape")
    full = tuple(int(d) for d in (value.shape if value is not None else (shape if isinstance(shape, (list, tuple)) else (shape,))))
    if any(d < 0 for d in full):
        raise InvalidArgument(f"variable {name!r}: negative dimension in shape {list(full)}")
    n = num_partitions(partitioner, full, dt)
    splits = row_splits(full[0], n) if full else [(0, 1)]
    row_bytes = math.prod(full[1:]) * dt.itemsize if full else dt.itemsize
    opt_spec = None if optimizer is None else optimizer.spec() if hasattr(optimizer, "spec") else optimizer
    _optim.from_spec(opt_spec)  # refuse a bad optimizer before anything is recorded
    init_spec = None
    if value is None:
        init_spec = _init.from_spec(initializer if initializer is not None else _init.zeros()).spec()
    device = current_device()
    request = crq.Declare(
        name=name,
        shape=list(full),
        dtype=dname,
        part_rows=[list(r) for r in splits],
        part_bytes=[(b - a) * row_bytes for a, b in splits],
        device=None if device is None else str(device),
        policy=current_policy().name,
        optimizer=opt_spec,
        initializer=init_spec,
        has_value=value is not None,
        defaulted=value is None and initializer is None,
    )

    async def create(record: dict[str, Any], info: VarInfo, claim: str) -> bool:
        # the parts come from the record's initializer where it names one (the first declaration's), else from
        # this declarer's value: never from nothing, which a shard would make zeros
        source = value if info.initializer is None else None
        if source is None and info.initializer is None:
            await give_up(sess, name, claim, keep=True)
            raise InvalidArgument(f"variable {name!r} is not created yet and its first declaration gave an initial "
                                  "value: declare it with its value to create it")
        # a record this value took over from a declaration by shape alone: parts made meanwhile hold zeros
        over = _overwrite(sess, info, source) if record.get("overwrite") and source is not None else None
        return await settle(sess, name, claim, _creates(sess, info, source), over)

    return await declare_claimed(sess, "variable", name, request, VarInfo.from_record, create)


def _overwrite(sess: SessionPort, info: VarInfo, value: np.ndarray) -> Callable[[], Awaitable[None]]:
    """Writes ``value`` over every part (after they are created, before the record is ready)."""
    return lambda: assign(sess, info, value, "set")


def _creates(sess: SessionPort, info: VarInfo, value: np.ndarray | None) -> list[Awaitable[Any]]:
    """One create per part, on its shard, from ``value`` (rows of it) or the record's initializer."""
    n = len(info.parts)
    calls = []
    for i, (task, r0, r1) in enumerate(info.parts):
        body = rq.Create(
            name=info.name, part=i, shape=list(info.shape), rows=[r0, r1], dtype=dtype_name(info.dtype), num_parts=n,
            optimizer=info.optimizer, initializer=info.initializer,
            value=None if value is None else value[r0:r1] if info.shape else value,
        )
        calls.append(sess.call_task(task, "ps", "create", body))
    return calls


async def create_parts(sess: SessionPort, info: VarInfo, value: np.ndarray | None) -> None:
    """Create every part on its shard (get-or-create: parts that exist are kept as they are)."""
    await asyncio.gather(*_creates(sess, info, value))


# moving values ------------------------------------------------------------------------------


@timeline.traced("pull")
async def pull(sess: SessionPort, infos: list[VarInfo], timeout: float | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every part's rows, in requests of about SLICE_BYTES all sent at once, each with ``timeout``
    (the session's by default). ``out`` maps names to arrays to fill (reused by a caller that
    reads the same variables every step: no fresh pages to fault in); each reply is copied in as
    it lands, while the others are still in flight. A one-part variable not in ``out`` (up to
    WHOLE_PULL_BYTES) comes whole and is the received frame itself (writeable, nothing copied;
    read-only from an inproc shard, whose frame is the shard's own memory: a write to the part
    goes to a copy meanwhile, ``Part.own``); others get new arrays. A task whose share is at least
    ``bulk_pull.BULK_FROM`` bytes sends its parts on its bulk stream where it offers one: they
    land in their arrays, copied by no one. Every reply's shape and dtype are checked against
    what the session knows of the part: VariableConflict when the part has changed since."""
    given = checked_outs(infos, out, "pulled")
    plan = pull_plan.kept(sess, infos, given)
    bulk_to = {} if plan is not None else await _bulk_streams(sess, infos)
    if plan is None:
        plan = pull_plan.make(infos, given, bulk_to)
        pull_plan.keep(sess, plan, given)  # where no shard's share could take a bulk stream
    outs = plan.targets(given)
    shared = await in_process(sess, set(plan.whole_tasks))
    bulk: dict[TaskId, list[Piece]] = defaultdict(list)
    for info in infos if bulk_to else ():
        for p, (task, _, _) in enumerate(info.parts):
            if task in bulk_to:  # straight into its rows
                bulk[task] += _pieces(info, p, outs[info.name], bulk_to[task])  # type: ignore[arg-type]
    where = plan.where

    def place(task: TaskId, keys: tuple[int, ...], arrays: list[np.ndarray]) -> None:
        for key, arr in zip(keys, arrays):
            info, p, chunk = where[key]
            target = outs[info.name]
            landed(info, p, chunk, target, arr, task)
            if target is not None:
                continue
            if task in shared:
                arr.flags.writeable = False
            outs[info.name] = arr

    async def fetch(task: TaskId, keys: tuple[int, ...], call: Awaitable[list[np.ndarray]]) -> None:
        place(task, keys, await call)

    calls = [fetch(task, keys, sess.call_task(task, "ps", "pull", req, timeout=timeout, size=size))
             for task, keys, req, size in plan.calls]
    for task, pieces in bulk.items():
        calls += [pull_into(sess, task, stream, batch, timeout) for stream, batch in bulk_to[task].spread(pieces)]
    await gather_calls(calls)
    return outs  # type: ignore[return-value]  # every None was replaced by its reply


async def assign(sess: SessionPort, info: VarInfo, x: Any, mode: str, timeout: float | None = None) -> None:
    x = _as_array(x, info, "value")
    if len(info.parts) == 1 and x.nbytes <= SLICE_BYTES:  # a scalar or small variable: one item, no bundling
        (a, b), = info.chunks(0)
        await sess.call_task(info.parts[0][0], "ps", "assign", rq.Assign(items=[rq.RowsItem(info.name, 0, a, b, x)], mode=mode),
                             timeout=timeout)
        return
    items = []
    for p, (task, _, _) in enumerate(info.parts):
        for chunk in info.chunks(p):
            rows = rows_of(info, p, chunk, x)
            items.append((task, rows.nbytes, rq.RowsItem(info.name, p, chunk[0], chunk[1], rows)))
    await gather_calls([
        sess.call_task(task, "ps", "assign", rq.Assign(items=batch, mode=mode), timeout=timeout)
        for task, batches in bundle(items).items() for batch in batches
    ])


def _split_sparse(info: VarInfo, indices: Any, rows: Any, what: str) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Global row indices (and their rows) per part, as part-local indices; checked first."""
    if not info.shape:
        raise InvalidArgument(f"{what} of {info.name!r}: a scalar variable has no rows")
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise InvalidArgument(f"{what} of {info.name!r}: indices must be a 1-D integer array, got {idx.dtype} {list(idx.shape)}")
    idx = idx.astype(np.int64, copy=False)
    x = rows if isinstance(rows, np.ndarray) else np.asarray(rows, dtype=info.dtype)
    expected = (len(idx), *info.shape[1:])
    if x.dtype != info.dtype:
        raise InvalidArgument(f"{what} of {info.name!r}: expected dtype {info.dtype}, got {x.dtype}")
    if x.shape != expected:
        raise InvalidArgument(f"{what} of {info.name!r}: expected rows of shape {list(expected)}, got {list(x.shape)}")
    bad = (idx < 0) | (idx >= info.shape[0])
    if bad.any():
        raise InvalidArgument(f"{what} of {info.name!r}: index {int(idx[bad][0])} out of range [0, {info.shape[0]})")
    starts = np.array([r0 for _, r0, _ in info.parts])
    owner = np.searchsorted(starts, idx, side="right") - 1
    out = []
    for p in np.unique(owner):
        mask = owner == p
        out.append((int(p), idx[mask] - starts[p], x[mask]))  # a boolean index copies, C-ordered
    return out


async def scatter(sess: SessionPort, info: VarInfo, indices: Any, rows: Any, mode: str,
                  timeout: float | None = None) -> None:
    parts = _split_sparse(info, indices, rows, f"scatter_{mode}")
    await gather_calls([
        sess.call_task(info.parts[p][0], "ps", "scatter", rq.Scatter(name=info.name, part=p, indices=i, rows=r, mode=mode),
                       timeout=timeout)
        for p, i, r in parts
    ])


def checked_grads(grads: Mapping[VarInfo, Any]) -> dict[VarInfo, Any]:
    """Every gradient checked as :func:`push` checks it, before anything is sent: dense ones as
    arrays of their variable's shape and dtype, sparse ones (checked) and ``None`` as given."""
    out: dict[VarInfo, Any] = {}
    for info, grad in grads.items():
        if isinstance(grad, tuple):
            _split_sparse(info, grad[0], grad[1], "sparse gradient")
        elif grad is not None:
            grad = _as_array(grad, info, "gradient")
        out[info] = grad
    return out


@timeline.traced("push")
async def push(sess: SessionPort, grads: Mapping[VarInfo, Any], step: int | None,
               timeout: float | None = None, learning_rate: float | None = None) -> dict[str, Any]:
    """Dense gradients (arrays) or sparse ones (``(indices, rows)``) through each variable's
    optimizer (at ``learning_rate`` in place of its own, where given); ``None``: no gradient this
    step (a sync variable's round counts this replica and adds nothing; an async one is left
    alone), as for each part of a sync variable that a sparse gradient's rows miss. A task's async
    dense share from ``bulk_pull.BULK_FROM`` bytes goes out on its push stream where it offers one
    (:mod:`.bulk_push`), the rest over ZeroMQ."""
    async_items: list[tuple[TaskId, int, rq.RowsItem]] = []
    sync_dense: dict[TaskId, list[rq.RowsItem]] = defaultdict(list)
    sync_sparse: dict[TaskId, list[rq.SparseItem]] = defaultdict(list)
    async_sparse: dict[TaskId, list[rq.SparseItem]] = defaultdict(list)
    absent: dict[TaskId, list[rq.PartItem]] = defaultdict(list)
    dense = {info: _as_array(grad, info, "gradient") for info, grad in grads.items()
             if grad is not None and not isinstance(grad, tuple)}
    # an async array of more than one element goes from its rows on a push stream; a counter (one
    # element) over ZeroMQ, whose answer carries its count (a stream's answer carries none)
    streamed = {info for info in dense if not info.sync and math.prod(info.shape) > 1}
    bulk_to = await _bulk_streams(sess, streamed, "push")
    bulk: dict[TaskId, list[Piece]] = defaultdict(list)
    for info, grad in grads.items():
        if grad is None:
            for p, (task, _, _) in enumerate(info.parts if info.sync else ()):
                absent[task].append(rq.PartItem(info.name, p))
            continue
        if isinstance(grad, tuple):
            touched = _split_sparse(info, grad[0], grad[1], "sparse gradient")
            for p, i, r in touched:
                (sync_sparse if info.sync else async_sparse)[info.parts[p][0]].append(rq.SparseItem(info.name, p, i, r))
            if info.sync and len(touched) < len(info.parts):  # a part none of the rows is in still counts this replica
                hit = {p for p, _, _ in touched}
                for p, (task, _, _) in enumerate(info.parts):
                    if p not in hit:
                        absent[task].append(rq.PartItem(info.name, p))
            continue
        g = dense[info]
        for p, (task, r0, r1) in enumerate(info.parts):
            if task in bulk_to and info in streamed:
                bulk[task] += _pieces(info, p, g, bulk_to[task])
                continue
            for chunk in info.chunks(p):
                rows = rows_of(info, p, chunk, g)
                item = rq.RowsItem(info.name, p, chunk[0], chunk[1], rows)
                if info.sync:
                    sync_dense[task].append(item)
                else:
                    async_items.append((task, rows.nbytes, item))
    calls = []
    for task, batches in bundle(async_items).items():
        calls += [sess.call_task(task, "ps", "push", rq.Push(dense=b, step=step, learning_rate=learning_rate),
                                 timeout=timeout) for b in batches]
    for task, items in async_sparse.items():
        body = rq.Push(sparse=items, step=step, learning_rate=learning_rate)
        calls.append(sess.call_task(task, "ps", "push", body, timeout=timeout))
    for task in set(sync_dense) | set(sync_sparse) | set(absent):
        lists = (sync_dense.get(task, []), sync_sparse.get(task, []), absent.get(task, []))
        if sum(map(len, lists)) <= ITEMS_PER_REQUEST:  # one request, as nearly always
            bodies = [rq.Push(dense=lists[0], sparse=lists[1], absent=lists[2], step=step, learning_rate=learning_rate)]
        else:  # thousands of parts: several requests, a part's items in one (runs_of_parts)
            bodies = [rq.Push(**{field: run}, step=step, learning_rate=learning_rate)
                      for field, items in zip(("dense", "sparse", "absent"), lists)
                      for run in runs_of_parts(items) if run]
        calls += [sess.call_task(task, "ps", "push", body, timeout=timeout) for body in bodies]
    for task, pieces in bulk.items():
        calls += [push_from(sess, task, stream, batch, timeout, learning_rate)
                  for stream, batch in bulk_to[task].spread(pieces)]
    return merged_answers(await gather_calls(calls))


def merged_answers(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Push answers as one: the highest synchronous step, whether any was stale, every replica
    the steps averaged, and the ``global_step`` the push counted (None where no answer named one)."""
    steps = [r["step"] for r in results if r.get("step") is not None]
    replicas = [r["replicas"] for r in results if isinstance(r.get("replicas"), list)]
    counted = [r["global_step"] for r in results if isinstance(r.get("global_step"), int)]
    return {"step": max(steps) if steps else None, "stale": any(r.get("stale") for r in results),
            "replicas": sorted({str(x) for rs in replicas for x in rs}) if replicas else None,
            "global_step": max(counted) if counted else None}


class AsyncVariable:
    """A handle on a variable found by name; every method is a coroutine."""

    def __init__(self, session: SessionPort, info: VarInfo):
        self._session = session
        self.info = info

    name = property(lambda self: self.info.name)
    shape = property(lambda self: self.info.shape)
    dtype = property(lambda self: self.info.dtype)

    @property
    def partitions(self) -> list[dict[str, Any]]:
        """Each part's task and row range ``[start, stop)``."""
        return self.info.describe()

    @property
    def optimizer(self) -> "_optim.Optimizer | _optim.SyncReplicas | None":
        """What the shards apply a push with (``zf.optim``; None for a plain add)."""
        return _optim.from_spec(self.info.optimizer)

    # Every method takes ``timeout=``: the deadline of each of its requests (they are sent at
    # once), the session's by default. A shard that does not answer in time: DeadlineExceeded.
    async def read(self, *, out: np.ndarray | None = None, timeout: float | None = None) -> np.ndarray:
        """The current value; with ``out``, written into it (and ``out`` returned)."""
        given = None if out is None else {self.info.name: out}
        return (await pull(self._session, [self.info], timeout, given))[self.info.name]

    async def assign(self, x: Any, *, timeout: float | None = None) -> None:
        await assign(self._session, self.info, x, "set", timeout)

    async def assign_add(self, x: Any, *, timeout: float | None = None) -> None:
        await assign(self._session, self.info, x, "add", timeout)

    async def assign_sub(self, x: Any, *, timeout: float | None = None) -> None:
        await assign(self._session, self.info, x, "sub", timeout)

    async def scatter_add(self, indices: Any, rows: Any, *, timeout: float | None = None) -> None:
        await scatter(self._session, self.info, indices, rows, "add", timeout)

    async def scatter_update(self, indices: Any, rows: Any, *, timeout: float | None = None) -> None:
        await scatter(self._session, self.info, indices, rows, "update", timeout)

    async def push(self, grad: Any, *, step: int | None = None, timeout: float | None = None,
                   learning_rate: float | None = None) -> int | None:
        """Apply the variable's optimizer to ``grad`` (or ``(indices, rows)``), at ``learning_rate``
        in place of its own where given; returns the new step when synchronous, or the global step
        it counted (``AsyncSession.push``)."""
        return await self._session.push({self: grad}, step=step, timeout=timeout, learning_rate=learning_rate)

    def __repr__(self) -> str:
        return f"<AsyncVariable {self.name!r} shape={list(self.shape)} {self.dtype} parts={len(self.info.parts)}>"
