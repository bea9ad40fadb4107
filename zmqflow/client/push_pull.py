"""A training step's two transfers at once: push each gradient and read back its variable's new
value, with the model cut into groups that go one after the other, each group pulled as soon as
its push is answered while the next groups' pushes are still going out.

A step that pushes the whole model and then pulls it uses one direction of every link at a time:
the shards' download while gradients come in, then their upload while values go out. Each link is
full duplex, so half of what it can carry is idle. Here a group's pull (the shard's upload) runs
beside the later groups' pushes (its download), as BytePS overlaps its push and pull. A group is
pulled only after its own push is answered, so every value read includes this caller's gradient
(a synchronous variable's, the step it completes).

Groups are runs of whole variables, in the order given, of about ``1/GROUPS`` of the model and
at least ``GROUP_BYTES`` each: a small model goes as one group, with no more round trips than
the two calls it replaces (one, read back in the pushes' answers: below). One variable is never
split, so a model that is one big variable gains nothing from the groups.

A model with a synchronous variable sends every group's push at once, as ``push`` does: its
pushes are answered only once every replica's have come, and replicas whose groups differ (their
own order, other variables) would otherwise each hold back a push the other waits for. Each group
is still pulled once its own step is done, beside the steps still to come.

Where every shard of the model is on this host (loopback, ipc, inproc) no link binds: the cores
do, and each group's requests cost them more than the overlap saves (64 MB over 16 groups took
50.4 ms against 33.9 for push then pull on 2 loopback shards). The model then goes as one group.

A small group (dense gradients, all synchronous or all asynchronous, under
``push_read.READ_BYTES`` a shard with ``push_read.ITEM_BYTES`` counted for each part) is read
back in its pushes' own answers (:mod:`.push_read`): one round trip a shard in place of two.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..cluster import Address
from ..errors import DeadlineExceeded, ZmqflowError
from .port import SessionPort
from .push_read import push_read, readable
from .var_info import checked_outs
from .variables import VarInfo, checked_grads, gather_calls
from .variables import pull as _pull
from .variables import push as _push

__all__ = ["GROUP_BYTES", "GROUPS", "WINDOW", "groups", "on_this_host", "push_pull"]

GROUP_BYTES = 1 << 20  # a group is at least this big: smaller ones cost round trips for no overlap
WINDOW = 2  # groups whose pushes may be out at once: one on the wire while the one before awaits its answer
GROUPS = 16  # a model is cut into about this many: the last pull is what stays unoverlapped


def groups(infos: list[VarInfo], groups: int = GROUPS, least: int = GROUP_BYTES) -> list[list[VarInfo]]:
    """``infos`` in runs of whole variables, in order, each closed once it holds ``least`` bytes
    and ``1/groups`` of the total (the target), or before a variable would take it past the target:
    a big variable after small ones starts a group of its own (else a model of small variables
    and one big one would go as one group, with nothing overlapped)."""
    target = max(least, sum(info.nbytes for info in infos) // max(1, groups))
    out: list[list[VarInfo]] = []
    size = target
    for info in infos:
        if size >= target or (size and size + info.nbytes > target):  # full, or this one would overflow it
            out.append([])
            size = 0
        out[-1].append(info)
        size += info.nbytes
    return out


def on_this_host(address: Address) -> bool:
    """Whether ``address`` is on this host by its form: ipc, inproc, a loopback address or
    ``localhost``. A host name is not resolved (no lookup blocks the loop): it counts as another."""
    return address.scheme != "tcp" or _loopback(address.host)


@functools.lru_cache(maxsize=1024)
def _loopback(host: str) -> bool:
    """Parsed once a host: every ``push_pull`` asks of each of its shards."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def push_pull(sess: SessionPort, grads: Mapping[VarInfo, Any], step: int | None, timeout: float | None,
                    learning_rate: float | None, out: Mapping[str, np.ndarray] | None, cut_in: int | None = None,
                    answered: list[dict[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """Push ``grads`` (as ``variables.push``) and pull each variable after its group's push is
    answered (as ``variables.pull``, into ``out`` where it names the variable; a small group's
    rows come in its pushes' answers, ``push_read``). The groups' pushes
    go in turn, ``WINDOW`` out at once (the next one's bytes go while the one before waits for
    its answer; all at once where a variable is synchronous), each group's pull beside later
    pushes. ``timeout`` (the session's by default) bounds the pushes, as ``push``'s does, and each
    group's pull from its push's answer, as ``pull``'s does: a synchronous push may wait most of
    it for the other replicas. The whole call ends within twice the timeout. ``cut_in``: about how
    many groups (whole variables each), in place of the rule of the module's docstring. Each
    push's answer goes to ``answered`` as it comes (its step and replicas stand even if a later
    group fails: the shards took that step); a ZmqflowError raised says in ``details["pushed"]``
    whether every push was answered. Returns the values by name. Past twice the timeout, whatever
    is still out is cancelled (DeadlineExceeded)."""
    grads = checked_grads(grads)  # all of them, and every out= array, before a group is sent
    given = checked_outs(grads, out, "pushed")

    loop = asyncio.get_running_loop()
    limit = sess.timeout if timeout is None else timeout
    deadline = loop.time() + limit  # the pushes'; each pull has ``limit`` from its push's answer
    if cut_in is None:
        spec = await sess.cluster()
        tasks = {task for info in grads for task, _, _ in info.parts}  # a model's many parts, its few shards
        local = all(on_this_host(spec.address(task)) for task in tasks)
        cut = groups(list(grads), 1 if local else GROUPS, GROUP_BYTES)
    else:
        cut = groups(list(grads), cut_in, 1)
    turns = [asyncio.Event() for _ in cut]  # set once a group's push is answered: a later one's turn
    # A synchronous variable's push is answered once every replica's has come: replicas whose
    # groups differ (another order, other variables) would each wait on a push the other holds back.
    window = len(cut) if any(info.sync for info in grads) else WINDOW

    answers = answered if answered is not None else []

    async def one(k: int, group: list[VarInfo]) -> dict[str, np.ndarray]:
        if k >= window:
            await turns[k - window].wait()
        left = max(0.001, deadline - loop.time())  # of the pushes' time: the later groups get no more
        mine = grads if len(cut) == 1 else {info: grads[info] for info in group}  # one group: all of them
        into = given if len(cut) == 1 else {info.name: given[info.name] for info in group if info.name in given}
        if readable(mine, sess, into):  # small: the shards send the new rows back with their answers
            values = await push_read(sess, mine, step, left, learning_rate, into, answers)
            turns[k].set()
            if values is not None:
                return values  # else a shard sent no rows: the pull says why
        else:
            answers.append(await _push(sess, mine, step, left, learning_rate))
            turns[k].set()  # only once answered: after a failure the groups still waiting send nothing
        return await _pull(sess, group, limit, into)  # a sync push may take its whole time: the pull has its own

    try:
        async with asyncio.timeout_at(deadline + limit):  # stream opens included: the call keeps to both times
            done = await gather_calls([one(k, g) for k, g in enumerate(cut)])
    except ZmqflowError as exc:
        exc.details["pushed"] = len(answers) == len(cut)  # whether every gradient was taken
        raise
    except TimeoutError:
        raise DeadlineExceeded(f"push_pull: {len(answers)} of {len(cut)} groups pushed, not all pulled, within twice "
                               "its timeout", pushed=len(answers) == len(cut)) from None
    return {name: value for values in done for name, value in values.items()}
