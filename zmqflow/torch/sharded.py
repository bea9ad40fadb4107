"""One embedding table on the ps shards as the torch modules use it: find-or-create, lookups, and
sparse pushes that run in the background.

A push is started on the session's loop and its future kept here, so backward never waits for the
network. A table that pushes at the step instead holds each backward pass's gradient here until
:meth:`ShardedTable.push_held` sends them as one push (their sum): gradient accumulation then
applies the shards' optimizer once per step, on the summed gradient, as a local table would.

Because a session must read its own writes, every lookup of the table first waits for the
pushes this process started on it (``PendingPushes`` is shared by every module of one session that
names the table), and an error of any of them is raised there instead of being lost.

No gradient holding inf or NaN reaches the shards: one would spoil the rows every rank reads. A
push of one is dropped and raised as an error at that wait. Under loss scaling (``GradScaler``)
overflow is expected: :meth:`ShardedTable.push_held` with the loss ``scale`` divides the held sum
by it and skips a step that overflowed, as ``GradScaler.step`` skips the dense one.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..client.blocking import Session
from ..client.embedding import AsyncEmbedding
from ..client.session import WAIT_MARGIN
from ..cluster import catalog_task
from ..errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable, VariableConflict
from ..state import optim as zf_optim

__all__ = ["PendingPushes", "ShardedTable", "DEFAULT_OPTIMIZER"]

DEFAULT_OPTIMIZER = zf_optim.SGD(learning_rate=0.01)  # when the table is created without one


class PendingPushes:
    """The background pushes of one table from one session, until someone waits for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future[Any]] = []

    def add(self, fut: "concurrent.futures.Future[Any]") -> None:
        with self._lock:
            # pushes that finished well need no waiting; failed ones stay until they are raised
            self._futures = [f for f in self._futures if not (f.done() and _error(f, "") is None)]
            self._futures.append(fut)

    def __len__(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._futures)

    def wait(self, timeout: float, table: str) -> None:
        """Wait for every push started so far; raise the first error (the others noted on it)."""
        with self._lock:
            futures, self._futures = self._futures, []
        done, late = concurrent.futures.wait(futures, timeout)
        errors = [e for f in futures if f in done and (e := _error(f, table)) is not None]
        if late:
            with self._lock:  # still ours to report: keep them for the next wait
                self._futures = list(late) + self._futures
            if not errors:
                raise DeadlineExceeded(f"{len(late)} push(es) to embedding {table!r} not finished within {timeout:g}s")
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"another background push to {table!r} failed too: {type(other).__name__}: {other}")
            raise first


def _error(fut: "concurrent.futures.Future[Any]", table: str) -> BaseException | None:
    if fut.cancelled():  # the session's loop went away with the push: an update lost is an error
        return Unavailable(f"a background push to embedding {table!r} was cancelled (its session closed)")
    return fut.exception()


_pending: "weakref.WeakKeyDictionary[Session, dict[str, PendingPushes]]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def _pending_for(session: Session, name: str) -> PendingPushes:
    with _registry_lock:
        return _pending.setdefault(session, {}).setdefault(name, PendingPushes())


def _catalog_record(session: Session, name: str) -> dict[str, Any] | None:
    """The catalog's record of ``name`` if it is created and ready, else None (no waiting)."""
    task = catalog_task(session.cluster())
    try:
        return session.call("catalog", "lookup", {"name": name, "wait": False}, task=str(task))
    except NotFound:
        return None


def _any_record(session: Session, name: str) -> dict[str, Any] | None:
    """The catalog's record of ``name``, ready or with its parts still being made; None if none
    (it lists every record: asked only after a refusal)."""
    task = catalog_task(session.cluster())
    records = session.call("catalog", "records", {"pending": True}, task=str(task))
    return next((r for r in records if r["name"] == name), None)


def _attach(session: Session, name: str,
            declare: Callable[[dict[str, Any] | None], Any]) -> tuple[dict[str, Any] | None, Any]:
    """(the optimizer spec, the table) of an open that names no optimizer: the table's own, else
    ``DEFAULT_OPTIMIZER``. A table another process declared with its optimizer, whose parts are
    still being made, is not found by a lookup (its record is not ready) but refuses the default:
    the open then attaches with that optimizer, as it would have had the table been ready. The
    other way round is still refused: a declaration naming another optimizer that reaches the
    catalog after this open made the record with the default (the catalog cannot tell a default
    from a choice)."""
    found = _catalog_record(session, name)
    spec = found["optimizer"] if found is not None else DEFAULT_OPTIMIZER.spec()
    try:
        return spec, declare(spec)
    except VariableConflict:
        met = None if found is not None else _any_record(session, name)
        if met is None or met["optimizer"] == spec:  # no other optimizer in the way: a shape, or a shard's refusal
            raise
        return met["optimizer"], declare(met["optimizer"])


def _optimizer_spec(optimizer: Any, name: str) -> dict[str, Any] | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, zf_optim.SyncReplicas):
        raise InvalidArgument(f"embedding {name!r}: tables take asynchronous sparse updates; SyncReplicas is for variables")
    if not isinstance(optimizer, zf_optim.Optimizer):
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise InvalidArgument(f"embedding {name!r}: optimizer must be a server-side zmqflow.optim optimizer "
                              f"(e.g. zmqflow.optim.SGD(0.1)), got {kind}")
    return optimizer.spec()


class ShardedTable:
    """A table handle plus what the modules need around it: background pushes, counters."""

    def __init__(self, session: Session, handle: AsyncEmbedding, optimizer: dict[str, Any] | None):
        self.session = session
        self.handle = handle
        self.optimizer = optimizer  # the spec the shards apply
        self.pending = _pending_for(session, handle.name)
        self._lock = threading.Lock()
        self._held: list[tuple[np.ndarray, np.ndarray]] = []  # backward passes' gradients not pushed yet
        self.counters = {"lookups": 0, "ids_looked_up": 0, "pushes": 0, "ids_pushed": 0, "rows_updated": 0,
                         "pushes_skipped": 0}  # gradients not sent because they held inf or NaN

    def __deepcopy__(self, memo: dict[int, Any]) -> "ShardedTable":
        """The same table: a copied model (an EMA or teacher copy) shares its rows on the shards,
        which are not the model's to copy (copy them with ``zmqflow.checkpoint``), and the pushes
        this session waits for; the gradients it holds for a push and its counters are its own."""
        twin = ShardedTable(self.session, self.handle, self.optimizer)
        memo[id(self)] = twin
        return twin

    def __reduce__(self) -> Any:
        raise InvalidArgument(f"embedding {self.handle.name!r}: a table on the ps shards cannot be pickled (as "
                              "torch.save(model) would); save the model's state_dict, and the table with "
                              "zmqflow.checkpoint")

    @classmethod
    def open(cls, session: Session, name: str, num_embeddings: int | None, dim: int, *, dtype: np.dtype,
             initializer: Any, optimizer: Any, partitions: Any, partition_strategy: str, min_frequency: int,
             capacity: int | None) -> "ShardedTable":
        """Get-or-create the table. Any number of processes may open one name at once: the catalog
        serializes declarations and table parts are get-or-create. ``optimizer=None`` takes the
        table's own, that of a table another process is still creating too (``DEFAULT_OPTIMIZER``
        when this call creates it); a named optimizer must be the table's, or VariableConflict."""
        wanted = _optimizer_spec(optimizer, name)

        def declare(spec: dict[str, Any] | None) -> Any:
            return session.embedding(name, num_embeddings, dim, partitions=partitions,
                                     partition_strategy=partition_strategy, dtype=dtype, initializer=initializer,
                                     optimizer=spec, min_frequency=min_frequency, capacity=capacity)

        if wanted is not None:
            spec, emb = wanted, declare(wanted)
        else:
            spec, emb = _attach(session, name, declare)
        record = _catalog_record(session, name)
        actual = record["optimizer"] if record is not None else spec
        if wanted is not None and actual != wanted:
            raise VariableConflict(f"embedding {name!r} exists with optimizer {actual}; asked for {wanted}")
        return cls(session, emb.handle, actual)

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def timeout(self) -> float:
        return self.session.async_session.timeout + WAIT_MARGIN

    def count(self, **deltas: int) -> None:
        """Add to the counters (a grouped call counts for each of its tables)."""
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def synchronize(self) -> None:
        """Wait for this process's pushes to the table; raise what any of them raised."""
        self.pending.wait(self.timeout, self.name)

    def lookup(self, ids: np.ndarray, create: bool) -> np.ndarray:
        """Rows of unique ``ids`` (after this process's pushes have landed)."""
        return self.result(self.lookup_async(ids, create))

    def result(self, fut: "concurrent.futures.Future[np.ndarray]") -> np.ndarray:
        """What a started lookup gave (its own deadline, the session's, comes first)."""
        try:
            return fut.result(self.timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceeded(f"lookup in embedding {self.name!r} did not finish within {self.timeout:g}s") from None

    def lookup_async(self, ids: np.ndarray, create: bool) -> "concurrent.futures.Future[np.ndarray]":
        """Start the lookup of unique ``ids`` once this process's pushes have landed; its future.
        Several tables' lookups started this way are in flight at once."""
        self.synchronize()
        self.count(lookups=1, ids_looked_up=len(ids))
        return self.session.submit(self.handle.lookup(ids, create=create))

    def push_async(self, ids: np.ndarray, grads: np.ndarray) -> "concurrent.futures.Future[int]":
        """Start a sparse push of ``ids`` (repeats summed) on the session's loop; returns its future.
        Non-finite ``grads`` are not sent: the future holds the error, raised at the next wait."""
        refused = self.refuse_non_finite(grads)
        if refused is not None:
            return refused
        return self.adopt(self.session.submit(self._push(ids, grads)), len(ids))

    def refuse_non_finite(self, grads: np.ndarray) -> "concurrent.futures.Future[int] | None":
        """A failed push's future (kept to be raised at the next wait) when ``grads`` holds inf or NaN."""
        if np.isfinite(grads).all():
            return None
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        fut.set_exception(InvalidArgument(
            f"a gradient for embedding {self.name!r} holds inf or NaN; it was dropped, the table is unchanged. "
            "Under loss scaling (torch.amp.GradScaler) the table must push at the step, push=\"step\", with the "
            "scale: push_held(scale=scaler.get_scale()) or HybridStrategy.step(scaler=scaler), which skip a "
            "step that overflowed"))
        self.pending.add(fut)
        self.count(pushes_skipped=1)
        return fut

    def adopt(self, fut: "concurrent.futures.Future[Any]", ids: int) -> "concurrent.futures.Future[Any]":
        """Count a push of ``ids`` ids under way (its own, or a grouped push of several tables)
        and make this table's next wait wait for it; returns ``fut``."""
        self.pending.add(fut)
        self.count(pushes=1, ids_pushed=ids)
        return fut

    def hold(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Keep one backward pass's gradient of unique ``ids`` for :meth:`push_held`."""
        with self._lock:
            self._held.append((ids, grads))

    @property
    def held(self) -> int:
        """Backward passes whose gradients are held, not pushed yet."""
        with self._lock:
            return len(self._held)

    def _inverse(self, scale: float) -> float:
        """``1 / scale`` of a loss scale that is a positive finite number."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise InvalidArgument(f"embedding {self.name!r}: scale must be a positive finite number, got {scale!r}")
        return 1.0 / float(scale)

    def held_finite(self, scale: float = 1.0) -> bool:
        """Whether every held gradient divided by ``scale`` is finite (what :meth:`push_held` checks)."""
        inverse = self._inverse(scale)
        with self._lock:
            held = list(self._held)
        return all(np.isfinite(g * np.asarray(inverse, g.dtype)).all() for _, g in held)

    def push_held(self, scale: float | None = None) -> int:
        """Start one push of every gradient held since the last (repeated ids are summed by the
        push, so the shards apply their optimizer once, to the sum); the passes it carried.
        With the loss ``scale`` the sum is unscaled first, and a step holding inf or NaN (an
        overflow) is skipped: dropped, counted in ``pushes_skipped``, and 0 returned."""
        taken = self.take_held(scale)
        if taken is None:
            return 0
        ids, grads, passes = taken
        self.push_async(ids, grads)
        return passes

    def take_held(self, scale: float | None = None) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(ids, gradients, passes) of one push of what is held, now held no more; None when
        nothing is held, or when under ``scale`` the sum overflowed (counted as skipped)."""
        inverse = None if scale is None else self._inverse(scale)
        with self._lock:
            held, self._held = self._held, []
        if not held:
            return None
        ids, grads = np.concatenate([i for i, _ in held]), np.concatenate([g for _, g in held])
        if inverse is not None:
            grads *= np.asarray(inverse, grads.dtype)  # a new array: what backward gave is not touched
            if not np.isfinite(grads).all():
                self.count(pushes_skipped=1)
                return None
        return ids, grads, len(held)

    def skip_held(self) -> int:
        """Drop the gradients held as a skipped step (another table's or the dense gradients
        overflowed under loss scaling), counted in ``pushes_skipped``; the passes dropped."""
        dropped = self.drop_held()
        if dropped:
            self.count(pushes_skipped=1)
        return dropped

    def drop_held(self) -> int:
        """Forget the gradients held (as ``zero_grad`` forgets local ones); the passes dropped."""
        with self._lock:
            held, self._held = self._held, []
        return len(held)

    async def _push(self, ids: np.ndarray, grads: np.ndarray) -> int:
        updated = await self.handle.push(ids, grads)
        self.count(rows_updated=updated)  # before the future resolves: a waiter sees the count
        return updated

    def read_all(self) -> np.ndarray:
        """Every row of a static table, a page at a time (the whole table crosses the network)."""
        num = self.handle.info.num_embeddings
        if num is None:
            raise InvalidArgument(f"embedding {self.name!r} is dynamic: it has no dense weight; use export()")
        self.synchronize()
        out = np.zeros((num, self.handle.dim), self.handle.info.dtype)
        for ids, rows in self.export():
            out[ids] = rows
        return out

    def export(self) -> Any:
        """``(ids, rows)`` pages, shard by shard."""
        self.synchronize()
        agen = self.handle.export()
        while True:
            try:
                yield self.session.run_on_loop(agen.__anext__())
            except StopAsyncIteration:
                return

    def size(self) -> int:
        self.synchronize()
        return self.session.run_on_loop(self.handle.size())

    def evict(self, older_than: Any = None, **kwargs: Any) -> int:
        self.synchronize()
        return self.session.run_on_loop(self.handle.evict(older_than, **kwargs))
