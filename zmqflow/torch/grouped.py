"""Several sharded tables at once: their lookups in one request a shard, their pushes in another.

A model with many tables (DLRM: one a categorical feature) looks each up before its forward and
pushes each at the step. Table by table, that is a request per table per shard; grouped, one a
shard (``AsyncSession.lookup_many`` and ``push_many``). Each table still waits for its own
pushes before its lookup, counts its own calls and gets a future of its own, so what each sees
is what its own ``lookup_async`` or ``push_held`` gives. Tables of different sessions are grouped
by session.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from .sharded import ShardedTable

__all__ = ["lookup_many_async", "push_held_many"]


def _by_session(tables: Sequence[ShardedTable]) -> list[list[int]]:
    """The indices of ``tables``, grouped by the session each calls through, in order."""
    groups: dict[int, list[int]] = {}
    for k, t in enumerate(tables):
        groups.setdefault(id(t.session), []).append(k)
    return list(groups.values())


def _share(parent: "concurrent.futures.Future[list[Any]]", n: int) -> "list[concurrent.futures.Future[Any]]":
    """A future for each of the ``n`` answers ``parent`` will hold, or for the error it raises."""
    children: list[concurrent.futures.Future[Any]] = [concurrent.futures.Future() for _ in range(n)]

    def settle(done: "concurrent.futures.Future[list[Any]]") -> None:
        if done.cancelled():
            for child in children:
                child.cancel()
            return
        error = done.exception()
        for k, child in enumerate(children):
            if not child.done():  # a child given up on (cancelled by its waiter) stays so
                if error is not None:
                    child.set_exception(error)
                else:
                    child.set_result(done.result()[k])

    parent.add_done_callback(settle)
    return children


def lookup_many_async(tables: Sequence[ShardedTable], ids: Sequence[np.ndarray],
                      create: bool) -> "list[concurrent.futures.Future[np.ndarray]]":
    """Start the lookups of each table's unique ``ids`` once its pushes from this process have
    landed, one request a shard for them all; a future for each table's rows."""
    futures: list[concurrent.futures.Future[np.ndarray]] = [None] * len(tables)  # type: ignore[list-item]
    for group in _by_session(tables):
        for k in group:
            tables[k].synchronize()
            tables[k].count(lookups=1, ids_looked_up=len(ids[k]))
        if len(group) == 1:
            k = group[0]
            futures[k] = tables[k].session.submit(tables[k].handle.lookup(ids[k], create=create))
            continue
        session = tables[group[0]].session
        parent = session.submit(session.async_session.lookup_many(
            [tables[k].handle for k in group], [ids[k] for k in group], create=create))
        for k, child in zip(group, _share(parent, len(group))):
            futures[k] = child
    return futures


def push_held_many(tables: Sequence[ShardedTable], scale: float | None = None) -> list[int]:
    """Each table's :meth:`ShardedTable.push_held`, one request a shard for them all; the passes
    each carried. A table holding inf or NaN is left out and fails as its own push would."""
    taken: list[tuple[ShardedTable, np.ndarray, np.ndarray]] = []
    passes = []
    for t in tables:
        got = t.take_held(scale)
        passes.append(0 if got is None else got[2])
        if got is not None and t.refuse_non_finite(got[1]) is None:
            taken.append((t, got[0], got[1]))
    for group in _by_session([t for t, _, _ in taken]):
        if len(group) == 1:
            t, ids, grads = taken[group[0]]
            t.push_async(ids, grads)
            continue
        members = [taken[k] for k in group]
        session = members[0][0].session
        fut = session.submit(_push(members))
        for t, ids, _ in members:
            t.adopt(fut, len(ids))
    return passes


async def _push(members: list[tuple[ShardedTable, np.ndarray, np.ndarray]]) -> int:
    """The grouped push; each table counts its rows updated before the future resolves."""
    session = members[0][0].session.async_session
    counts = await session.push_many([t.handle for t, _, _ in members], [i for _, i, _ in members],
                                     [g for _, _, g in members])
    for (t, _, _), n in zip(members, counts):
        t.count(rows_updated=n)
    return sum(counts)
