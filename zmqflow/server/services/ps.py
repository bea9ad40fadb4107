"""The parameter-server shard service: the async layer over :class:`ShardStore` and sync replicas.

Requests arrive checked against their declarations (:mod:`zmqflow.wire.requests.ps`); values
are checked against their parts by the store, once, all before any is applied, so every op is
atomic on the shard (it runs on the loop without awaiting). Sync pushes wait, without blocking
the loop, until their step has been applied, and past their deadline name the replicas that did
not push.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ...errors import DeadlineExceeded, InvalidArgument, Recovering, ZmqflowError
from ...observe.metrics import CHECKPOINT_BUCKETS, MAX_LABELS, Histogram
from ...observe import stragglers
from ...state.limits import DEFAULT_STATE_LIMITS, StateLimits
from ...state.tables import HashTable
from ...state.store import Part, PartKey, Plan, Rows, ShardStore, Sparse, build, part_label
from ...state.apply_many import Update, apply_all
from ...state.sync import READY, STALE
from ...rpc import CallContext, Service, op
from ...rpc.service import Answer
from ...rpc.dedup import MAX_KEPT_REPLY
from ...wire.requests import ps as rq
from ...wire.tensors import PACK_ALIGN
from ..checkpoint_roots import CheckpointRoots
from .bulk_ops import BulkOps
from .fence import FenceOps
from .snapshots import SnapshotOps
from .tables import TableOps

__all__ = ["PsService", "answer_bytes"]

log = logging.getLogger(__name__)

# A waiting sync push gives up this long before its caller's deadline, so its own error (naming
# the missing replicas) reaches the caller instead of a bare timeout.
_SYNC_MARGIN = 0.25
_GLOBAL_STEP: PartKey = ("global_step", 0)  # an asynchronous run counts its steps in this variable

# Parts at least this big are allocated and initialized in an executor, so the loop keeps
# answering (heartbeats, pings, other variables) while a multi-GB initializer runs.
OFF_LOOP_BYTES = 16 << 20


class PsService(Service, TableOps, SnapshotOps, FenceOps, BulkOps):
    name = "ps"

    def __init__(self, replicas: list[str] | None = None, reachable: Callable[[bytes], bool] | None = None,
                 limits: StateLimits = DEFAULT_STATE_LIMITS, checkpoint_roots: CheckpointRoots | None = None):
        super().__init__()
        # Who this shard is since it started: a session that sees another one on the same task
        # knows the shard restarted and lost what it held (ShardStateLost), not that a name is unknown.
        self.incarnation = uuid.uuid4().hex[:16]
        self.started = time.time()
        self.limits = limits
        self._building: dict[PartKey, asyncio.Future] = {}  # parts being built off the loop
        self.checkpoint_roots = checkpoint_roots or CheckpointRoots()  # none: ps.save writes nowhere
        self._fence_init()
        self._reachable = reachable
        self._pushers: dict[str, bytes] = {}  # replica name -> the routing id it last pushed from
        self._gone: set[str] = set()  # replicas whose steps were completed without them
        self.store = ShardStore(limits)
        self.tables: dict[PartKey, HashTable] = {}
        self._table_specs: dict[PartKey, tuple] = {}
        # who last created or declared each part and table (the caller's name, with keys its key's):
        # ``drop`` takes only the caller's own, so a declarer that lost its claim drops nobody else's
        self._makers: dict[PartKey, str] = {}
        self.replicas = list(replicas or [])
        self._advanced: dict[PartKey, asyncio.Event] = defaultdict(asyncio.Event)
        # what the metrics probe reads (plain ints: counting costs an add whether or not anyone scrapes)
        self.pushes_applied = {"async": 0, "sync": 0}  # updates applied to a part
        self.stale_gradients = 0  # sync gradients from an older step, dropped
        self.sync_rounds = 0  # sync steps completed (per part)
        self.sync_missing: dict[str, int] = {}  # replica -> steps that timed out or completed without it
        self._missing_noted: dict[PartKey, int] = {}  # the step whose timeout was last counted, per part
        self.save_seconds = Histogram(CHECKPOINT_BUCKETS)
        self._rounds = stragglers.Rounds(stragglers.StragglerDetector("sync ps"), trace="sync round")  # per step

    def state(self) -> str | None:
        if self.fenced:
            return f"recovering (epoch {self.epoch})"
        return f"restored (epoch {self.epoch})" if self.epoch else None

    def admit(self, ctx: CallContext) -> None:
        self.check_fence(ctx.op, ctx.peer)

    @op(rq.Empty)
    def status(self, ctx: CallContext, req: rq.Empty) -> dict[str, Any]:
        return {
            **self.fence_state(),
            "incarnation": self.incarnation,
            "started": self.started,
            "variables": len(self.store.parts),
            "bytes": self.store.nbytes + sum(t.nbytes for t in self.tables.values()),
            "global_step": self._step(),
            "tables": {part_label(k): t.stats() for k, t in self.tables.items()},
        }

    @op(rq.Empty)
    def global_step(self, ctx: CallContext, req: rq.Empty) -> int:
        return self._step()

    def progress_step(self) -> int | None:
        """The training step this shard knows: its sync step, else the ``global_step`` variable
        when it holds it (asynchronous training), else None."""
        if any(p.sync is not None for p in self.store.parts.values()):
            return self._step()
        return self._counted()

    def _counted(self) -> int | None:
        """The ``global_step`` variable's value where this shard holds it as one asynchronous
        element with no optimizer (asynchronous training counts its steps there), else None."""
        part = self.store.parts.get(_GLOBAL_STEP)
        ok = part is not None and part.sync is None and part.optimizer is None and part.value.size == 1
        return int(part.value.reshape(-1)[0]) if ok else None  # type: ignore[union-attr]

    def _step(self) -> int:
        steps = [p.sync.step for p in self.store.parts.values() if p.sync is not None]
        return max(steps, default=0)

    @op(rq.Empty)
    def variables(self, ctx: CallContext, req: rq.Empty) -> list[dict[str, Any]]:
        return [p.describe() for p in self.store.parts.values()]

    @op(rq.Create)
    def create(self, ctx: CallContext, req: rq.Create) -> "bool | Coroutine[Any, Any, bool]":
        """Get-or-create, every limit checked before allocating; a big part is built off the loop
        (the answer is then a coroutine the RPC server awaits)."""
        return self.create_part(ctx, req.name, req.part, req.shape, req.rows, req.dtype, num_parts=req.num_parts,
                                optimizer=req.optimizer, initializer=req.initializer, value=req.value)

    def create_part(self, ctx: CallContext, name: str, part: int, shape: list[int], rows: list[int], dtype: str,
                    **kwargs: Any) -> "bool | Coroutine[Any, Any, bool]":
        """``ShardStore.create`` for the wire: inline for small parts, in an executor for big ones."""
        key = (name, int(part))
        if key in self._building:  # the same part by another request: its outcome, then ours
            return self._after_build(self._building[key], lambda: self.create_part(ctx, name, part, shape, rows, dtype, **kwargs))
        extra = sum(t.nbytes for t in self.tables.values())
        plan = self.store.plan(name, part, shape, rows, dtype, extra_bytes=extra, **kwargs)
        self.note_maker(ctx, key)
        if plan is None:
            return False
        if plan.nbytes < OFF_LOOP_BYTES:
            try:
                built = build(plan)
            finally:
                self.store.release(plan)
            return self.store.commit(built)
        return self._wait_build(self._build_off_loop(plan))

    def note_maker(self, ctx: CallContext | None, key: PartKey) -> None:
        """Remember who last created or declared ``key``; entries of parts gone (swept, or a
        build that failed) are dropped once they outnumber the parts held."""
        makers = self._makers
        makers[key] = "" if ctx is None else ctx.source
        if len(makers) > 2 * (len(self.store.parts) + len(self.tables)) + 1024:
            self._makers = {k: v for k, v in makers.items() if k in self.store.parts or k in self.tables}

    @op(rq.Drop)
    def drop(self, ctx: CallContext, req: rq.Drop) -> list[list[Any]]:
        """Drop the parts and tables of a declaration its declarer abandoned (a shard refused
        another of its parts), for the catalog, which checked that ``req.owner`` holds the claim
        on a record not ready: only the parts that declarer made or last declared, and none being
        built. Returns the dropped ``[name, part]`` pairs."""
        dropped = []
        for item in req.items:
            key = (item.name, item.part)
            if self._makers.get(key) != req.owner or key in self._building:
                continue
            del self._makers[key]
            found = self.store.parts.pop(key, None) is not None  # the held count is recounted (held_bytes)
            if self.tables.pop(key, None) is not None:
                self._table_specs.pop(key, None)
                found = True
            if found:
                dropped.append([item.name, item.part])
        return dropped

    def _build_off_loop(self, plan: Plan) -> asyncio.Future:
        """Build ``plan`` in an executor; the future's result is the commit's. Registered at once,
        so a second create of the part waits for this one; committed (or dropped, when a fence
        came meanwhile) on the loop when the build ends, whether or not its requester still waits."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: its requester may be gone
        epoch = self.epoch
        self._building[plan.key] = done

        def finished(f: asyncio.Future) -> None:
            self.store.release(plan)  # the bytes stay reserved while the thread allocates
            del self._building[plan.key]
            try:
                if self.fenced or self.epoch != epoch:  # the part must not land after a fence
                    raise Recovering(f"ps.create of {part_label(plan.key)} abandoned: the shard is being restored "
                                     f"(recovery epoch {self.epoch})", epoch=self.epoch)
                done.set_result(self.store.commit(f.result()))
            except BaseException as exc:  # the build's own error (ResourceExhausted) or the fence's
                done.set_exception(exc)

        loop.run_in_executor(None, build, plan).add_done_callback(finished)
        return done

    @staticmethod
    async def _wait_build(done: asyncio.Future) -> bool:
        return await asyncio.shield(done)  # past the deadline the build goes on, and is committed

    @staticmethod
    async def _after_build(fut: asyncio.Future, again: Callable[[], Any]) -> bool:
        try:
            await asyncio.shield(fut)
        except Exception:
            pass  # its requester hears its error; this one tries on its own
        result = again()
        return await result if asyncio.iscoroutine(result) else result

    @op(rq.Pull)
    def pull(self, ctx: CallContext, req: rq.Pull) -> list[np.ndarray]:
        """Read-only views of the items' rows, in order, sent zero-copy (a write meanwhile goes to
        a copy of the part: ``Part.own``)."""
        return self._views(req.items)

    def _views(self, items: list[rq.PullItem]) -> list[np.ndarray]:
        view = self.store.view
        return [view(it.name, it.part, it.start, it.stop) for it in items]

    @op(rq.Assign)
    def assign(self, ctx: CallContext, req: rq.Assign) -> int:
        """Every item checked before any is written."""
        rows = self.store.rows
        checked = [rows(it.name, it.part, it.start, it.stop, it.value, req.mode) for it in req.items]
        for r in checked:
            self.store.write(r, req.mode)
        return len(checked)

    @op(rq.Scatter)
    def scatter(self, ctx: CallContext, req: rq.Scatter) -> int:
        self.store.scatter(req.name, req.part, req.indices, req.rows, req.mode)
        return int(len(req.indices))

    @op(rq.Push)
    def push(self, ctx: CallContext, req: rq.Push) -> "dict[str, Any] | Answer | Coroutine[Any, Any, Any]":
        """Apply gradients, every item checked first. Async parts apply at once; sync parts wait
        for their step, and the answer names the replicas whose gradients that step averaged
        (every pusher of the step hears the same). Runs where it is admitted (``admit`` checked
        the fence just before, with nothing between) and answers at once when nothing waits (async
        parts, or the push that completes its step): a task, its deadline scope and its
        bookkeeping cost more than applying a small gradient. Else the answer is a coroutine that
        waits for the step; a fence meanwhile fails it (``_wait_step``)."""
        rows = self.store.rows
        by_part: dict[PartKey, list[Any]] = {}  # key -> [part, {(start, stop): gradient}, sparse or None]
        for it in req.dense:
            r = rows(it.name, it.part, it.start, it.stop, it.value, "gradient")
            key = (it.name, it.part)
            entry = by_part.get(key)
            if entry is None:
                by_part[key] = [r.part, {(r.start, r.stop): r.value}, None]
            elif (r.start, r.stop) in entry[1]:
                _twice(r.part.label, f"rows [{r.start}, {r.stop})")
            else:
                entry[1][(r.start, r.stop)] = r.value
        for sp in req.sparse:
            checked = self.store.sparse(sp.name, sp.part, sp.indices, sp.rows, "sparse gradient")
            if (sp.name, sp.part) in by_part:
                _twice(checked.part.label, "a sparse gradient beside another gradient")
            by_part[(sp.name, sp.part)] = [checked.part, {}, (checked.indices, checked.rows)]
        for p, dense, _ in by_part.values():  # metadata only: most parts come in one item
            if len(dense) > 1:
                ranges = sorted(dense)
                for (_, end), (start, _) in zip(ranges, ranges[1:]):
                    if start < end:
                        _twice(p.label, f"overlapping rows {ranges}")
        for it in req.absent:  # a replica without a gradient: counted in its round, adds nothing
            key = (it.name, it.part)
            p = self.store.get(*key)  # NotFound before any part is applied
            if key in by_part:
                raise InvalidArgument(f"push names variable {p.label} both with a gradient and as absent")
            by_part[key] = [p, {}, None]
        step = req.step
        if step is None:  # refused before any part is applied: a retry must not apply the others twice
            for p, _, _ in by_part.values():
                if p.sync is not None:
                    raise InvalidArgument(f"variable {p.label} is synchronous: pushes must carry the pusher's step")
        row_range = self.store.row_range  # an unknown part or a bad range is refused before any part is applied
        reads = [row_range(it.name, it.part, it.start, it.stop) for it in req.read]
        waits: list[tuple[PartKey, int]] = []
        stale = False
        who = ctx.source or "anonymous"  # with keys, the name of the pusher's key (CallContext)
        applies: list[Update] = []  # applied together after the loop (apply_many), whatever ends it
        applied_async = completed = 0  # counted once, after the loop
        arrived = None  # the round this pusher was last noted arriving in: a push's parts share one
        try:
            for key, (p, dense, sparse) in by_part.items():
                sync = p.sync
                if sync is None:
                    if dense or sparse is not None:
                        applies.append((p, dense, sparse, req.learning_rate))
                        applied_async += 1
                    continue
                assert step is not None  # checked above
                mine = min(step, sync.step)
                if mine != arrived:
                    if arrived is None:  # the pusher's route, and that it is back: once a push
                        self._pushers[who] = ctx.peer
                        self._gone.discard(who)
                    self._rounds.arrive(mine, who)  # a round's first arrival is what counts
                    arrived = mine
                outcome = sync.offer(step, who, dense, sparse, req.learning_rate)
                if outcome == STALE:
                    stale = True
                    self.stale_gradients += 1
                elif outcome == READY:
                    mean_dense, mean_sparse = sync.take()
                    applies.append((p, mean_dense, mean_sparse, sync.learning_rate))
                    completed += 1
                    self._wake(key)  # its waiters run after this returns: the step is applied by then
                    self._rounds.close(mine)
                elif sync.drop_dead and set(sync.missing(self.replicas)) <= self._gone and self._drop_dead(key):
                    pass  # every replica still missing is one already known gone: no need to wait for it
                else:
                    waits.append((key, mine))
        finally:
            self.pushes_applied["async"] += applied_async
            self._round_done([], completed)
            apply_all(applies, self._apply)
        if waits:  # the epoch of the offers: a fence from now on abandons their step
            return self._push_waits(ctx, waits, list(by_part), stale, self.epoch, req.read)
        syncs = [p.sync for p, _, _ in by_part.values() if p.sync is not None]
        return self._push_answer(syncs, _GLOBAL_STEP in by_part, stale, req.read, reads)

    async def _push_waits(self, ctx: CallContext, waits: list[tuple[PartKey, int]], keys: list[PartKey],
                          stale: bool, epoch: int, read: list[rq.PullItem]) -> dict[str, Any] | Answer:
        for key, mine in waits:
            await self._wait_step(ctx, key, mine, epoch)
        syncs = [s for k in keys if (s := self.store.get(*k).sync) is not None]  # as they are now
        return self._push_answer(syncs, _GLOBAL_STEP in keys, stale, read)

    def _push_answer(self, syncs: list[Any], counts_steps: bool, stale: bool, read: list[rq.PullItem],
                     checked: list[tuple[Part, int, int]] | None = None) -> dict[str, Any] | Answer:
        """The synchronous step and its replicas (of ``syncs``, the states of the push's sync
        parts); the ``global_step`` variable's new value where the push counted its step in it
        (``counts_steps``: an asynchronous step learns it with no read); and, where the push
        asked, the rows of ``read`` as ``pull`` sends them (``values``). None where one is gone
        since the push was checked (a sync push waited): the caller pulls. An answer with rows
        that may be more than the server keeps of a reply goes as an :class:`Answer` whose
        ``retry`` has none: a resent push is told its step, and its caller pulls. ``checked``:
        ``read``'s parts and rows, checked by a push answered with nothing awaited since."""
        answer = {"step": max(s.step for s in syncs) if syncs else None, "stale": stale,
                  "replicas": sorted({r for s in syncs for r in s.last_contributors}) if syncs else None}
        if counts_steps and (counted := self._counted()) is not None:
            answer["global_step"] = counted
        if read:
            try:
                if checked is not None:
                    view_rows = self.store.view_rows
                    values: list[np.ndarray] | None = [view_rows(p, a, b) for p, a, b in checked]
                else:
                    values = self._views(read)
            except ZmqflowError:  # dropped or made anew while the step waited: the step stands, the caller pulls
                values = None
            answer["values"] = values
            if values is not None and answer_bytes(values, answer["replicas"]) > MAX_KEPT_REPLY:
                return Answer(answer, {**answer, "values": None})
        return answer

    def _apply(self, p: Part, dense: dict, sparse: Any, learning_rate: float | None) -> None:
        """Gradients checked on arrival (or their means): applied to part ``p`` without checking
        again, at the push's learning rate where it gave one."""
        apply = self.store.apply
        for (a, b), grad in dense.items():
            apply(Rows(p, a, b, grad), learning_rate)
        if sparse is not None:
            apply(Sparse(p, *sparse), learning_rate)

    async def _wait_step(self, ctx: CallContext, key: PartKey, mine: int, epoch: int) -> None:
        """Until step ``mine`` of ``key`` completes; Recovering once a fence has followed the
        offer made in recovery ``epoch``."""
        loop = asyncio.get_running_loop()
        while True:
            if self.epoch != epoch:  # a recovery began: this step will never complete as it was
                raise Recovering(f"step {mine} of {part_label(key)} was abandoned: the shard is being restored "
                                 f"from a checkpoint (recovery epoch {self.epoch})", epoch=self.epoch)
            p = self.store.get(*key)  # after the check: a recovery may have dropped the part
            if p.sync is None or p.sync.step > mine:
                return
            event = self._advanced[key]
            remaining = None if ctx.deadline is None else ctx.deadline - loop.time() - _SYNC_MARGIN
            if remaining is not None and remaining <= 0:
                missing = p.sync.missing(self.replicas) or ["(unknown)"]
                if self._missing_noted.get(key) != mine:  # once per step, not once per waiting pusher
                    self._missing_noted[key] = mine
                    self._round_done(missing, completed=0)
                raise DeadlineExceeded(
                    f"step {mine} of {part_label(key)} was not completed: {len(p.sync.contributors)} of "
                    f"{p.sync.replicas_to_aggregate} gradients arrived; no push from {', '.join(missing)}",
                    missing=missing,
                )
            try:
                await asyncio.wait_for(event.wait(), remaining if not p.sync.drop_dead else min(remaining or 0.5, 0.5))
            except TimeoutError:
                if p.sync.drop_dead and p.sync.step <= mine:
                    self._drop_dead(key)
                continue

    def _drop_dead(self, key: PartKey) -> bool:
        """Finish the pending step when every replica that has not pushed is known to be gone
        (checked on the connection each last pushed from: a restarted replica counts again from
        its first push)."""
        p = self.store.get(*key)
        sync = p.sync
        if sync is None or not sync.contributors or self._reachable is None:
            return False
        missing = sync.missing(self.replicas)
        gone = [m for m in missing if m in self._pushers and not self._reachable(self._pushers[m])]
        if not missing or len(gone) < len(missing):
            return False
        if not set(gone) <= self._gone:  # said once per replica lost, not on every step without it
            log.warning("%s: step %d completes with %d of %d replicas; gone: %s", p.label, sync.step,
                        len(sync.contributors), sync.replicas_to_aggregate, ", ".join(gone))
            self._gone |= set(gone)
        mean_dense, mean_sparse = sync.take()
        self._apply(p, mean_dense, mean_sparse, sync.learning_rate)
        self._round_done(gone)
        self._wake(key)
        return True

    def _wake(self, key: PartKey) -> None:
        """Wake the pushes waiting for ``key``'s step (none with one replica: no event is made)."""
        event = self._advanced.pop(key, None)
        if event is not None:
            event.set()

    def _round_done(self, missing: list[str], completed: int = 1) -> None:
        """Count ``completed`` sync steps (none: one timed out), and the replicas it went without."""
        if completed:
            self.sync_rounds += completed
            self.pushes_applied["sync"] += completed
        for m in missing:
            if m not in self.sync_missing and len(self.sync_missing) >= MAX_LABELS:
                m = "other"
            self.sync_missing[m] = self.sync_missing.get(m, 0) + 1


def answer_bytes(values: list[np.ndarray], replicas: list[str] | None) -> int:
    """At least the bytes of a push's encoded answer with ``values``: the rows, a tensor's entry
    and reference each (about 25 bytes, counted 32) and its padding in a pack (under PACK_ALIGN),
    the replicas' names, the rest of the header."""
    names = sum(len(r.encode()) + 4 for r in replicas) if replicas else 0
    return sum(v.nbytes for v in values) + (32 + PACK_ALIGN) * len(values) + names + 512


def _twice(label: str, what: str) -> None:
    """One push carries at most one gradient for each row of a part: two would be merged by no
    rule (one overwriting the other, or both applied), so the push is refused before any applies."""
    raise InvalidArgument(f"push names variable {label} twice ({what}): one gradient per variable and step", name=label)
