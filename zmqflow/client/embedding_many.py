"""Several embedding tables in one round trip a shard: a model's lookups, then its pushes.

A recommendation model reads a batch's ids from each of its tables (DLRM has one a categorical
feature, 26 for Criteo) and pushes each a gradient. Table by table, that is a request per table
per shard, each paying its Python and message costs at both ends. Here each table's ids are
checked, made unique (a push's rows summed) and split by part exactly as its own call does, and
then every part one shard holds goes in one ``emb_lookup_many`` (``emb_push_many``) request; a
shard named by one part only gets the plain ``emb_lookup`` (``emb_push``). The shard checks every
item before it does any, so a refused request changes nothing there; its items then go again one
by one, so that only the table at fault fails. Each table's answer, or error, is what its own
:meth:`AsyncEmbedding.lookup` (``push``) would give.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cluster import TaskId
from ..errors import InvalidArgument, NotFound, ProtocolError, ZmqflowError
from ..observe import timeline
from ..state.sparse import unique_sum
from ..wire.requests import Request
from ..wire.requests import ps as rq
from .embedding import AsyncEmbedding, push_step, uniques
from .port import SessionPort

__all__ = ["lookup_many", "push_many", "lookup_each", "push_each"]

# one request's item: (which table, part, which of the table's unique ids, their part-local ids)
_Item = tuple[int, int, Any, np.ndarray]


def _check(session: SessionPort, tables: Sequence[AsyncEmbedding], given: Sequence[tuple[str, Sequence[Any]]],
           what: str) -> None:
    """InvalidArgument unless ``tables`` are handles of ``session``'s, one for each of ``given``."""
    if isinstance(tables, AsyncEmbedding) or not all(isinstance(t, AsyncEmbedding) for t in tables):
        raise InvalidArgument(f"{what}: tables must be a sequence of embedding tables (AsyncEmbedding)")
    if not tables:
        raise InvalidArgument(f"{what}: no tables")
    for name, values in given:
        if len(values) != len(tables):
            raise InvalidArgument(f"{what}: {len(tables)} tables but {len(values)} {name}")
    other = next((t for t in tables if t.session is not session), None)
    if other is not None:
        raise InvalidArgument(f"{what}: embedding {other.name!r} is another session's handle; call that session's")


def _by_task(tables: Sequence[AsyncEmbedding], uniq: Sequence[np.ndarray]) -> dict[TaskId, list[_Item]]:
    """Each shard's items: every part of every table that owns some of its unique ids."""
    groups: dict[TaskId, list[_Item]] = {}
    for k, (emb, u) in enumerate(zip(tables, uniq)):
        if len(u):
            for p, mask, local in emb.split(u):
                groups.setdefault(emb.info.tasks[p], []).append((k, p, mask, local))
    return groups


def _chunks(items: list[_Item]) -> list[list[_Item]]:
    return [items[i:i + rq.MAX_TABLE_ITEMS] for i in range(0, len(items), rq.MAX_TABLE_ITEMS)]


def _answers(got: Any, n: int, op: str, task: TaskId) -> list[Any]:
    if not isinstance(got, list) or len(got) != n:
        raise ProtocolError(f"{op} to {task} answered {type(got).__name__} for {n} items")
    return got


# What a shard refuses before it does any item of a request: then the items go again one by one,
# so that only the table at fault fails, as its own call would have.
_REFUSALS = (InvalidArgument, NotFound)


async def _each(task: TaskId, chunk: list[_Item], ask: Any) -> list[Any]:
    """Each item's answer, or the error its table's own call would have met."""
    try:
        return await ask(task, chunk)
    except _REFUSALS as exc:
        if len(chunk) == 1:
            return [exc]
        alone = await asyncio.gather(*(_each(task, [item], ask) for item in chunk))
        return [got[0] for got in alone]
    except ZmqflowError as exc:  # the shard's or the link's, met by every item of the request
        return [exc] * len(chunk)


async def _gather(groups: dict[TaskId, list[_Item]], ask: Any) -> dict[int, list[tuple[Any, Any]]]:
    """Every shard's requests at once; each table's ``(mask, answer or error)`` per part, by
    table index."""
    chunks = [(task, chunk) for task, items in groups.items() for chunk in _chunks(items)]
    results = await asyncio.gather(*(_each(task, chunk, ask) for task, chunk in chunks))
    answers: dict[int, list[tuple[Any, Any]]] = {}
    for (_, chunk), got in zip(chunks, results):
        for (k, _, mask, _), answer in zip(chunk, got):
            answers.setdefault(k, []).append((mask, answer))
    return answers


def _error(answers: list[tuple[Any, Any]]) -> BaseException | None:
    return next((a for _, a in answers if isinstance(a, BaseException)), None)


def _first(results: list[Any]) -> list[Any]:
    """``results`` when none is an error; else the first error (in table order) is raised."""
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return results


@timeline.traced("pull", "embedding lookup_many")
async def lookup_many(session: SessionPort, tables: Sequence[AsyncEmbedding], ids: Sequence[Any], *,
                      create: bool = True, timeout: float | None = None) -> list[np.ndarray]:
    """``[tables[k].lookup(ids[k]) for k ...]`` in one request a shard: the rows of each table's
    ids, of shape ``(*ids[k].shape, dim)``. A table may appear more than once. A table's error
    (the first, in table order) is raised; the other tables' lookups are done all the same."""
    return _first(await lookup_each(session, tables, ids, create=create, timeout=timeout))


async def lookup_each(session: SessionPort, tables: Sequence[AsyncEmbedding], ids: Sequence[Any], *,
                      create: bool = True, timeout: float | None = None) -> list[Any]:
    """:func:`lookup_many` giving each table's rows, or the error its own lookup would have met."""
    _check(session, tables, [("id arrays", ids)], "lookup_many")
    shapes = [np.shape(x) for x in ids]
    flats = [emb.check_ids(x, "lookup_many") for emb, x in zip(tables, ids)]
    found = [uniques(f) if f.size else (f, None) for f in flats]
    groups = _by_task(tables, [u for u, _ in found])

    async def ask(task: TaskId, items: list[_Item]) -> list[Any]:
        size = sum(tables[k].reply_bytes(local) for k, _, _, local in items)
        if len(items) == 1:
            k, p, _, local = items[0]
            body: Request = rq.EmbLookup(name=tables[k].name, part=p, ids=local, create=bool(create))
            return [await session.call_task(task, "ps", "emb_lookup", body, timeout=timeout, size=size)]
        body = rq.EmbLookupMany(items=[rq.LookupItem(name=tables[k].name, part=p, ids=local)
                                       for k, p, _, local in items], create=bool(create))
        got = await session.call_task(task, "ps", "emb_lookup_many", body, timeout=timeout, size=size)
        return _answers(got, len(items), "emb_lookup_many", task)

    answers = await _gather(groups, ask)
    out: list[Any] = []
    for k, (emb, (uniq, inverse)) in enumerate(zip(tables, found)):
        if not len(uniq):
            out.append(np.zeros((*shapes[k], emb.dim), emb.info.dtype))
        else:
            error = _error(answers[k])
            out.append(error if error is not None else
                       emb.spread(emb.assemble(len(uniq), answers[k]), inverse, shapes[k]))
    return out


@timeline.traced("push", "embedding push_many")
async def push_many(session: SessionPort, tables: Sequence[AsyncEmbedding], ids: Sequence[Any],
                    grads: Sequence[Any], *, step: int | None = None, timeout: float | None = None) -> list[int]:
    """``[tables[k].push(ids[k], grads[k]) for k ...]`` in one request a shard: the rows each
    updated. Every table's ids and gradients are checked before anything is sent. A table's error
    (the first, in table order) is raised; the other tables' pushes are applied all the same."""
    return _first(await push_each(session, tables, ids, grads, step=step, timeout=timeout))


async def push_each(session: SessionPort, tables: Sequence[AsyncEmbedding], ids: Sequence[Any],
                    grads: Sequence[Any], *, step: int | None = None, timeout: float | None = None) -> list[Any]:
    """:func:`push_many` giving each table's rows updated, or the error its own push would have met."""
    _check(session, tables, [("id arrays", ids), ("gradient arrays", grads)], "push_many")
    step = push_step(step, "push_many")
    summed = []
    for emb, x, g in zip(tables, ids, grads):
        flat = emb.check_ids(x, "push_many")
        rows = emb.check_grads(x, g)
        summed.append(unique_sum(flat, rows) if flat.size else (flat, rows))
    groups = _by_task(tables, [u for u, _ in summed])

    async def ask(task: TaskId, items: list[_Item]) -> list[Any]:
        if len(items) == 1:
            k, p, mask, local = items[0]
            body: Request = rq.EmbPush(name=tables[k].name, part=p, ids=local, grads=summed[k][1][mask], step=step)
            return [await session.call_task(task, "ps", "emb_push", body, timeout=timeout)]
        body = rq.EmbPushMany(items=[rq.PushItem(name=tables[k].name, part=p, ids=local, grads=summed[k][1][mask])
                                     for k, p, mask, local in items], step=step)
        got = await session.call_task(task, "ps", "emb_push_many", body, timeout=timeout)
        return _answers(got, len(items), "emb_push_many", task)

    answers = await _gather(groups, ask)
    out: list[Any] = []
    for k in range(len(tables)):
        error = _error(answers.get(k, []))
        out.append(error if error is not None else sum(int(n) for _, n in answers.get(k, ())))
    return out
