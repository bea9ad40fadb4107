"""Several sharded tables at once: their lookups in one request a shard, their pushes in another.

A model with many tables (DLRM: one a categorical feature) looks each up before its forward and
pushes each at the step. Table by table, that is a request per table per shard; grouped, one a
shard (``AsyncSession.lookup_many`` and ``push_many``). Each table still waits for its own
pushes before its lookup, counts its own calls and gets a future of its own, so what each sees,
rows or an error, is what its own ``lookup_async`` or ``push_held`` gives. Tables of different
sessions are grouped by session.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..client.embedding_many import lookup_each, push_each
from .sharded import ShardedTable

__all__ = ["lookup_many_async", "push_held_many"]


def _by_session(tables: Sequence[ShardedTable]) -> list[list[int]]:
    """The indices of ``tables``, grouped by the session each calls through, in order."""
    groups: dict[int, list[int]] = {}
    for k, t in enumerate(tables):
        groups.setdefault(id(t.session), []).append(k)
    return list(groups.values())


def _share(parent: "concurrent.futures.Future[list[Any]]", n: int) -> "list[concurrent.futures.Future[Any]]":
    """A future for each of the ``n`` answers ``parent`` will hold (each a result, or the error
    that table met), or for the error ``parent`` itself raises."""
    children: list[concurrent.futures.Future[Any]] = [concurrent.futures.Future() for _ in range(n)]

    def settle(done: "concurrent.futures.Future[list[Any]]") -> None:
        if done.cancelled():  # the session's loop went away with it: each table says so at its wait
            for child in children:
                child.cancel()
            return
        error = done.exception()
        answers = None if error is not None else done.result()
        for k, child in enumerate(children):
            answer = error if answers is None else answers[k]
            try:
                if isinstance(answer, BaseException):
                    child.set_exception(answer)
                else:
                    child.set_result(answer)
            except concurrent.futures.InvalidStateError:  # given up on (cancelled) by its waiter
                pass

    parent.add_done_callback(settle)
    return children


def lookup_many_async(tables: Sequence[ShardedTable], ids: Sequence[np.ndarray],
                      create: bool) -> "list[concurrent.futures.Future[np.ndarray]]":
    """Start the lookups of each table's unique ``ids`` once its pushes from this process have
    landed, one request a shard for them all; a future for each table's rows (or its error)."""
    for t, i in zip(tables, ids):  # every wait first: an error of one starts nothing
        t.synchronize()
        t.count(lookups=1, ids_looked_up=len(i))
    futures: list[concurrent.futures.Future[np.ndarray]] = [None] * len(tables)  # type: ignore[list-item]
    for group in _by_session(tables):
        if len(group) == 1:
            k = group[0]
            futures[k] = tables[k].session.submit(tables[k].handle.lookup(ids[k], create=create))
            continue
        session = tables[group[0]].session
        parent = session.submit(lookup_each(session.async_session, [tables[k].handle for k in group],
                                            [ids[k] for k in group], create=create))
        for k, child in zip(group, _share(parent, len(group))):
            futures[k] = child
    return futures


def push_held_many(tables: Sequence[ShardedTable], scale: float | None = None) -> list[int]:
    """Each table's :meth:`ShardedTable.push_held`, one request a shard for them all; the passes
    each carried. Each table's push succeeds or fails as its own would: one holding inf or NaN
    is left out and fails at its next wait, and one a shard refuses fails alone."""
    passes = [0] * len(tables)
    for group in _by_session(tables):  # a group's gradients are taken only as it is sent
        members: list[tuple[ShardedTable, np.ndarray, np.ndarray]] = []
        for k in group:
            got = tables[k].take_held(scale)
            if got is not None:
                passes[k] = got[2]
                if tables[k].refuse_non_finite(got[1]) is None:
                    members.append((tables[k], got[0], got[1]))
        if len(members) == 1:
            t, ids, grads = members[0]
            t.push_async(ids, grads)
        elif members:
            session = members[0][0].session
            parent = session.submit(_push(members))
            for (t, ids, _), child in zip(members, _share(parent, len(members))):
                t.adopt(child, len(ids))
    return passes


async def _push(members: list[tuple[ShardedTable, np.ndarray, np.ndarray]]) -> list[Any]:
    """The grouped push: each table's rows updated (counted before the futures resolve), or its error."""
    session = members[0][0].session.async_session
    results = await push_each(session, [t.handle for t, _, _ in members], [i for _, i, _ in members],
                              [g for _, _, g in members])
    for (t, _, _), n in zip(members, results):
        if not isinstance(n, BaseException):
            t.count(rows_updated=n)
    return results
