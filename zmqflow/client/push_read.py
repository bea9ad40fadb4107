"""A small group's push and read-back in one round trip a shard: each push asks its shard to send
the rows it pushed back with its answer (``Push.read``), as a pull right after would read them.

``push_pull`` pushes a group and then pulls it: two round trips. For a small group the round
trips are most of its time, not its bytes (a 17 KB model over tcp loopback on a 2-core machine:
push 473 us, pull 355 us). A shard answers a push once it has applied it,
a synchronous one once its step has, and reads the rows for the answer then: every value
includes this push, as a pull on the answers would read it.

Only for a group of dense gradients, all synchronous or all asynchronous (where both are, a shard
of asynchronous ones would read before another shard's synchronous step is done, which a pull
after every answer does not), whose rows on each shard are under ``READ_BYTES``, where a pull
would start to use the shard's bulk stream (straight into the arrays, which an answer cannot be),
in ``ITEMS_PER_REQUEST`` parts at most.
No part of such a group goes on a bulk stream or in more than one request a shard. Sparse and
absent gradients read back the whole part, which the push did not carry: those go as a push and
a pull.

A push whose answer was lost is sent again under its id, and answered from what the shard kept of
the first answer (``rpc.dedup``): the rows where the answer was small enough to keep, else the
step without them (``rpc.service.Answer``), and the caller pulls. Never "already ran": the step
would be lost to the caller.

A shard older than ``read`` refuses the field before it applies anything: the push goes again
without it, the group is pulled, and that shard is not asked to read back again by the session.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cluster import TaskId
from ..errors import InvalidArgument, ProtocolError
from ..observe import timeline
from ..wire.requests import ps as rq
from .bulk_pull import BULK_FROM
from .port import SessionPort
from .pull_plan import Chunk, Kept, targets
from .var_info import ITEMS_PER_REQUEST, VarInfo, landed, rows_of
from .variables import gather_calls, in_process, merged_answers

__all__ = ["READ_BYTES", "ReadPlan", "plan", "readable", "push_read"]

# a shard's rows in one answer, ITEM_BYTES counted for each part: under the share from which a
# pull takes a shard's bulk stream
READ_BYTES = BULK_FROM
ITEM_BYTES = 32  # a tensor's entry in the answer's header and its reference: about 20 bytes

# The shards, by session, that refused ``read`` (a server older than it): pushed to without it
# from then on, and pulled from, as before. Weak: a session's entry goes with the session.
_REFUSED: "weakref.WeakKeyDictionary[Any, set[TaskId]]" = weakref.WeakKeyDictionary()
_UNEXPECTED = re.compile(r"unexpected argument\(s\) ([\w, ]+)")


def _refuses_read(exc: InvalidArgument) -> bool:
    """Whether ``exc`` is a shard's refusal of the ``read`` field itself (its request check runs
    before anything is applied, so the push can go again without it)."""
    found = _UNEXPECTED.search(str(exc))
    return found is not None and "read" in [name.strip() for name in found.group(1).split(",")]


@dataclass(frozen=True, slots=True, eq=False)
class ReadPlan:
    """What a push that reads back of ``infos`` sends and where its rows land, but the
    gradients: per shard (``tasks``), each part's place (``where``) and its read (``reads``)."""

    infos: tuple[VarInfo, ...]
    ok: bool  # the rule of ``readable`` but for the gradients' types: else none of the rest
    tasks: tuple[TaskId, ...] = ()
    where: tuple[tuple[tuple[VarInfo, int, Chunk], ...], ...] = ()
    reads: tuple[list[rq.PullItem], ...] = ()
    names: dict[str, None] = field(default_factory=dict)  # every name, in order
    fresh: tuple[VarInfo, ...] = ()  # of more than one part, not in ``into``: a new array each push
    whole_tasks: frozenset[TaskId] = frozenset()


def _make(infos: list[VarInfo], into: Collection[str]) -> ReadPlan:
    if len({info.sync for info in infos}) > 1:
        return ReadPlan(tuple(infos), False)
    shards: dict[TaskId, list[Any]] = {}  # a shard's [bytes, places, reads]: one lookup a part
    for info in infos:
        for p, (task, _, _) in enumerate(info.parts):
            nbytes = info.part_bytes(p)
            if nbytes >= READ_BYTES:  # its shard's share is past it too
                return ReadPlan(tuple(infos), False)
            (chunk,) = info.chunks(p)  # under READ_BYTES: the whole part
            if (share := shards.get(task)) is None:
                share = shards[task] = [0, [], []]
            share[0] += nbytes + ITEM_BYTES
            share[1].append((info, p, chunk))
            share[2].append(rq.PullItem(info.name, p, chunk[0], chunk[1]))
    # a shard's parts go in one request, each an item of it and a tensor of its answer
    if not all(size < READ_BYTES and len(places) <= ITEMS_PER_REQUEST for size, places, _ in shards.values()):
        return ReadPlan(tuple(infos), False)
    return ReadPlan(tuple(infos), True, tuple(shards), tuple(tuple(places) for _, places, _ in shards.values()),
                    tuple(reads for _, _, reads in shards.values()), dict.fromkeys(info.name for info in infos),
                    tuple(info for info in infos if info.name not in into and len(info.parts) > 1),
                    frozenset(info.parts[0][0] for info in infos if info.name not in into and len(info.parts) == 1))


_PLANS = Kept()


def plan(sess: SessionPort, grads: Mapping[VarInfo, Any], into: Collection[str]) -> ReadPlan:
    """The plan of a push of ``grads``' variables reading back into ``into``'s names: kept for
    the session's next push of the same records (a training loop's every step)."""
    infos = list(grads)
    made = _PLANS.get(sess, infos, into)
    if made is None:
        made = _make(infos, into)
        _PLANS.put(sess, made, into)
    return made


def readable(grads: Mapping[VarInfo, Any], sess: SessionPort | None = None, into: Collection[str] = ()) -> bool:
    """Whether ``grads`` (checked: ``variables.checked_grads``) go as pushes that read back (with
    ``sess``, by the plan it keeps for them)."""
    if not all(isinstance(g, np.ndarray) for g in grads.values()):
        return False
    return (_make(list(grads), into) if sess is None else plan(sess, grads, into)).ok


@timeline.traced("push", "push and read back")
async def push_read(sess: SessionPort, grads: Mapping[VarInfo, np.ndarray], step: int | None,
                    timeout: float | None, learning_rate: float | None, into: Mapping[str, np.ndarray],
                    answered: list[dict[str, Any]]) -> dict[str, np.ndarray] | None:
    """Push ``grads`` (``readable``) in one request a shard, each reading its parts back. Once
    every shard has answered, the merged answer (``variables.merged_answers``) goes to
    ``answered``, before any row is looked at: the step stands whatever the rows turn out to be.
    Returns the values by name: ``into``'s arrays where it names the variable (filled), else a
    one-part variable's received array (read-only from an inproc shard: its memory is the
    shard's, as ``variables.pull`` says), else a new one. None where a shard answered with no rows
    (a part it could not read once the step was done, dropped meanwhile; an answer too big to
    keep for a resent push; a shard older than ``read``): the caller pulls, which reads them or
    says why."""
    made = plan(sess, grads, into)
    outs = targets(made.names, into, made.fresh)
    shared = await in_process(sess, set(made.whole_tasks))
    dense = [[rq.RowsItem(info.name, p, chunk[0], chunk[1], rows_of(info, p, chunk, grads[info]))
              for info, p, chunk in places] for places in made.where]
    tasks = made.tasks
    refused = _REFUSED.setdefault(sess, set())

    async def one(k: int, task: TaskId) -> Any:
        if task not in refused:
            try:
                return await sess.call_task(task, "ps", "push", rq.Push(
                    dense=dense[k], step=step, learning_rate=learning_rate, read=made.reads[k]), timeout=timeout)
            except InvalidArgument as exc:
                if not _refuses_read(exc):
                    raise
                refused.add(task)  # refused before anything was applied: again without it, then a pull
        return await sess.call_task(task, "ps", "push", rq.Push(dense=dense[k], step=step,
                                                                learning_rate=learning_rate), timeout=timeout)

    answers = await gather_calls([one(k, task) for k, task in enumerate(tasks)])
    if not all(isinstance(answer, dict) for answer in answers):
        bad = next(task for task, answer in zip(tasks, answers) if not isinstance(answer, dict))
        raise ProtocolError(f"{bad} answered a push with something other than a map", task=str(bad))
    answered.append(merged_answers(answers))
    rows = [answer.get("values") for answer in answers]
    if any(values is None for values in rows):
        return None
    for task, values, where in zip(tasks, rows, made.where):
        if (not isinstance(values, list) or len(values) != len(where)
                or not all(isinstance(v, np.ndarray) for v in values)):
            raise ProtocolError(f"{task} answered a push that reads back without one array for each of its "
                                f"{len(where)} parts", task=str(task))
        for (info, p, chunk), arr in zip(where, values):
            target = outs[info.name]
            landed(info, p, chunk, target, arr, task)
            if target is None:
                if task in shared:
                    arr.flags.writeable = False
                outs[info.name] = arr
    return outs  # type: ignore[return-value]  # every None was replaced by its rows
