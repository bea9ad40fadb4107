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
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..cluster import TaskId
from ..errors import InvalidArgument, ProtocolError
from ..observe import timeline
from ..wire.requests import ps as rq
from .bulk_pull import BULK_FROM
from .port import SessionPort
from .var_info import ITEMS_PER_REQUEST, VarInfo, landed, rows_of
from .variables import gather_calls, in_process, merged_answers

__all__ = ["READ_BYTES", "readable", "push_read"]

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


def readable(grads: Mapping[VarInfo, Any]) -> bool:
    """Whether ``grads`` (checked: ``variables.checked_grads``) go as pushes that read back."""
    if len({info.sync for info in grads}) > 1:
        return False
    shards: dict[TaskId, list[int]] = {}  # a shard's [bytes, parts]: one lookup a part (a task hashes in Python)
    for info, grad in grads.items():
        if not isinstance(grad, np.ndarray):
            return False
        for p, (task, _, _) in enumerate(info.parts):
            if (share := shards.get(task)) is None:
                share = shards[task] = [0, 0]
            share[0] += info.part_bytes(p) + ITEM_BYTES
            share[1] += 1
    # a shard's parts go in one request, each an item of it and a tensor of its answer
    return all(size < READ_BYTES and parts <= ITEMS_PER_REQUEST for size, parts in shards.values())


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
    outs: dict[str, np.ndarray | None] = {}
    for info in grads:
        given = into.get(info.name)
        outs[info.name] = given if given is not None or len(info.parts) == 1 else np.empty(info.shape, info.dtype)
    shared = await in_process(sess, {info.parts[0][0] for info in grads if outs[info.name] is None})
    # a shard's gradients, reads, and where each read lands: one lookup a part (a task hashes in Python)
    shards: dict[TaskId, tuple[list[rq.RowsItem], list[rq.PullItem], list[tuple[VarInfo, int, Any]]]] = {}
    for info, grad in grads.items():
        for p, (task, _, _) in enumerate(info.parts):
            (chunk,) = info.chunks(p)  # under READ_BYTES: the whole part
            if (mine := shards.get(task)) is None:
                mine = shards[task] = ([], [], [])
            mine[0].append(rq.RowsItem(info.name, p, chunk[0], chunk[1], rows_of(info, p, chunk, grad)))
            mine[1].append(rq.PullItem(info.name, p, chunk[0], chunk[1]))
            mine[2].append((info, p, chunk))
    tasks = list(shards)
    refused = _REFUSED.setdefault(sess, set())

    async def one(task: TaskId) -> Any:
        dense, read, _ = shards[task]
        if task not in refused:
            try:
                return await sess.call_task(task, "ps", "push", rq.Push(
                    dense=dense, step=step, learning_rate=learning_rate, read=read), timeout=timeout)
            except InvalidArgument as exc:
                if not _refuses_read(exc):
                    raise
                refused.add(task)  # refused before anything was applied: again without it, then a pull
        return await sess.call_task(task, "ps", "push", rq.Push(dense=dense, step=step,
                                                                learning_rate=learning_rate), timeout=timeout)

    answers = await gather_calls([one(task) for task in tasks])
    if not all(isinstance(answer, dict) for answer in answers):
        bad = next(task for task, answer in zip(tasks, answers) if not isinstance(answer, dict))
        raise ProtocolError(f"{bad} answered a push with something other than a map", task=str(bad))
    answered.append(merged_answers(answers))
    rows = [answer.get("values") for answer in answers]
    if any(values is None for values in rows):
        return None
    for task, values in zip(tasks, rows):
        where = shards[task][2]
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
