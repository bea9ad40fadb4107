"""A pull's requests, worked out once for variables pulled again and again.

A training loop pulls the same variables every step. Working out which shard sends which rows,
in which request, and where each lands cost a model of hundreds of small variables several
microseconds a variable on every pull. :func:`kept` hands back the plan made for the same
records (the same objects, in the same order) and the same ``out=`` names, of the last
``PLANS`` a session kept. A pull with a share of some shard that could take its bulk stream is
planned anew each time: whether it does is the session's state (its lanes, opened and closed as
it goes, or none where the shard offered none).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..cluster import TaskId
from ..wire.requests import ps as rq
from .bulk_pull import BULK_FROM
from .var_info import ITEMS_PER_REQUEST, SLICE_BYTES, VarInfo

__all__ = ["WHOLE_PULL_BYTES", "PLANS", "Plan", "Kept", "bundle", "make", "kept", "keep", "targets"]

# a one-part variable pulled without out= up to this size comes whole, as one frame that becomes
# the result (no copy); bigger ones come in slices, copied into a new array as they land
WHOLE_PULL_BYTES = 1 << 30
PLANS = 8  # kept a session: a loop pulls a few lists of variables (a model's, a metric's)
T = TypeVar("T")
Chunk = tuple[int | None, int | None]


def bundle(items: Iterable[tuple[TaskId, int, T]]) -> dict[TaskId, list[list[T]]]:
    """Group items per task into requests of about SLICE_BYTES each, and ITEMS_PER_REQUEST at most."""
    out: dict[TaskId, list[list[T]]] = defaultdict(list)
    sizes: dict[TaskId, int] = defaultdict(int)
    for task, nbytes, item in items:
        batches = out[task]
        if not batches or sizes[task] + nbytes > SLICE_BYTES or len(batches[-1]) >= ITEMS_PER_REQUEST:
            batches.append([])
            sizes[task] = 0
        batches[-1].append(item)
        sizes[task] += nbytes
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """The requests of a pull of ``infos``: ``calls`` (task, the keys of ``where`` its reply's
    arrays land at, the request, the reply's bytes), the parts on ``bulk`` tasks left out."""

    infos: tuple[VarInfo, ...]
    names: dict[str, None]  # every name, in order: the result's keys
    fresh: tuple[VarInfo, ...]  # given a new array each pull, filled as the replies land
    where: tuple[tuple[VarInfo, int, Chunk], ...]
    calls: tuple[tuple[TaskId, tuple[int, ...], rq.Pull, int], ...]
    whole_tasks: frozenset[TaskId]  # the shards of the variables received whole
    small: bool  # every shard's share under BULK_FROM: no bulk stream, whatever the session holds

    def targets(self, given: Mapping[str, np.ndarray]) -> dict[str, np.ndarray | None]:
        """Each name's array to fill: ``given``'s, a new one, or None (the reply's array)."""
        return targets(self.names, given, self.fresh)


def make(infos: list[VarInfo], given: Mapping[str, np.ndarray], bulk: Collection[TaskId] = ()) -> Plan:
    """The plan of a pull of ``infos`` into ``given``'s arrays, but for the parts on ``bulk`` tasks."""
    whole = {info.name for info in infos if info.name not in given and len(info.parts) == 1
             and info.nbytes <= WHOLE_PULL_BYTES and info.parts[0][0] not in bulk}
    where: list[tuple[VarInfo, int, Chunk]] = []
    items = []
    shares: dict[TaskId, int] = {}
    for info in infos:
        one = info.name in whole and bool(info.shape)  # one frame: slices would have to be copied together
        for p, (task, r0, r1) in enumerate(info.parts):
            shares[task] = shares.get(task, 0) + info.part_bytes(p)
            if task in bulk:
                continue
            for chunk in [(0, r1 - r0)] if one else info.chunks(p):
                nbytes = ((chunk[1] or 0) - (chunk[0] or 0)) * info.row_bytes if info.shape else info.row_bytes
                items.append((task, nbytes, (len(where), nbytes, rq.PullItem(info.name, p, chunk[0], chunk[1]))))
                where.append((info, p, chunk))
    calls = tuple((task, tuple(key for key, _, _ in batch), rq.Pull(items=[it for _, _, it in batch]),
                   sum(n for _, n, _ in batch))  # the reply's bytes pick its stream
                  for task, batches in bundle(items).items() for batch in batches)
    return Plan(tuple(infos), dict.fromkeys(info.name for info in infos),
                tuple(info for info in infos if info.name not in given and info.name not in whole),
                tuple(where), calls, frozenset(info.parts[0][0] for info in infos if info.name in whole),
                all(share < BULK_FROM for share in shares.values()))


class Kept:
    """Plans kept by session (weakly: a session's go with it), the last ``PLANS`` of each, by
    the records they were made for (the same objects, in the same order) and the names given."""

    def __init__(self) -> None:
        self._by_sess: "weakref.WeakKeyDictionary[Any, OrderedDict[tuple, Any]]" = weakref.WeakKeyDictionary()

    def get(self, sess: Any, infos: list[VarInfo], names: Collection[str]) -> Any:
        """The plan kept for these records and names, or None."""
        plans = self._by_sess.get(sess)
        key = _key(infos, names)
        plan = None if plans is None else plans.get(key)
        if plan is None or len(plan.infos) != len(infos) or any(a is not b for a, b in zip(plan.infos, infos)):
            return None  # (an id of a record gone may be another's now: the plan holds its own)
        plans.move_to_end(key)  # type: ignore[union-attr]
        return plan

    def put(self, sess: Any, plan: Any, names: Collection[str]) -> None:
        plans = self._by_sess.setdefault(sess, OrderedDict())
        plans[_key(list(plan.infos), names)] = plan
        while len(plans) > PLANS:
            plans.popitem(last=False)


def _key(infos: list[VarInfo], names: Collection[str]) -> tuple:
    return tuple(map(id, infos)), frozenset(names)


_PULLS = Kept()


def kept(sess: Any, infos: list[VarInfo], given: Mapping[str, np.ndarray]) -> Plan | None:
    """The plan ``keep`` kept for a pull of these records into these names, if any."""
    return _PULLS.get(sess, infos, given)


def keep(sess: Any, plan: Plan, given: Mapping[str, np.ndarray]) -> None:
    """Keep ``plan`` for the session's next pull of its records into ``given``'s names, where
    no share of it could take a bulk stream (``Plan.small``)."""
    if plan.small:
        _PULLS.put(sess, plan, given)


def targets(names: dict[str, None], given: Mapping[str, np.ndarray],
            fresh: Iterable[VarInfo]) -> dict[str, np.ndarray | None]:
    """Each name's array to fill, in ``names``' order: ``given``'s, a new one for each of
    ``fresh``, else None (the reply's array becomes the value)."""
    outs: dict[str, np.ndarray | None] = dict(names)
    outs.update(given)
    for info in fresh:
        outs[info.name] = np.empty(info.shape, dtype=info.dtype)
    return outs
