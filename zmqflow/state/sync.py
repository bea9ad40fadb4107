"""Synchronous replicas for one variable part, sans-IO (TF's SyncReplicasOptimizer, per part).

Gradients for the current step are summed; when ``replicas_to_aggregate`` have arrived their mean
is handed back to be applied and the step advances. A gradient computed at an older step is
dropped and counted. Extra (backup) replicas beyond the aggregate count simply arrive late and
are dropped as stale, which is how backup workers hide stragglers. Each replica counts once per
step: a second push of one it already counted (a retry after its deadline) adds nothing and is
dropped, so it cannot complete a step in another replica's place. Half-precision gradients are
summed in float32: 300 bfloat16 ones stop adding up at 256, eight float16 10000s overflow. Their
mean is handed back in float32, where the update widens a half-precision variable anyway: rounded
once, with the update, not first on its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..wire.dtypes import half_precision

__all__ = ["SyncState", "STALE", "PENDING", "READY"]

STALE, PENDING, READY = "stale", "pending", "ready"


class SyncState:
    def __init__(self, replicas_to_aggregate: int, total_num_replicas: int | None = None, drop_dead: bool = False):
        self.replicas_to_aggregate = int(replicas_to_aggregate)
        self.total_num_replicas = total_num_replicas
        self.drop_dead = drop_dead
        self.step = 0
        self.dropped = 0
        self._dense: dict[tuple[int, int], np.ndarray] = {}  # row range -> summed gradient
        self._dtype: np.dtype | None = None  # the gradients' dtype, when summed in another
        self._sparse: list[tuple[np.ndarray, np.ndarray]] = []
        self.contributors: list[str] = []
        self._counted: set[str] = set()  # ``contributors``, to look up
        self.last_contributors: list[str] = []  # whose gradients the last applied step averaged
        self._rate: float | None = None  # the learning rate the latest push of this step carried
        self.learning_rate: float | None = None  # the rate the last step taken is applied at

    def describe(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "total_num_replicas": self.total_num_replicas,
            "pending": len(self.contributors),
            "dropped": self.dropped,
        }

    def offer(self, step: int, worker: str, dense: dict[tuple[int, int], np.ndarray] | None = None,
              sparse: tuple[np.ndarray, np.ndarray] | None = None, learning_rate: float | None = None) -> str:
        """Add one replica's gradient for ``step``: STALE (dropped), PENDING, or READY to apply.
        A ``learning_rate`` (the replica's schedule at this step) is the step's once counted: the
        latest counted push's rate applies (replicas that share the step share its schedule)."""
        if step < self.step:
            self.dropped += 1
            return STALE
        if step > self.step:
            # a replica cannot be ahead of the step it read; treat it as the current one
            step = self.step
        if worker in self._counted:  # already counted: the step is pending (else it would have been taken)
            self.dropped += 1
            return PENDING
        if dense and self.replicas_to_aggregate == 1 and not _any_half(dense):
            self._dense = dict(dense)  # taken and applied now, before the caller's arrays go: no copy
            dense = None
        for rows, g in (dense or {}).items():
            acc = self._dense.get(rows)
            if acc is None:
                half = half_precision(g.dtype)
                if half:
                    self._dtype = g.dtype
                self._dense[rows] = np.array(g, dtype=np.float32 if half else g.dtype, copy=True)
            else:
                acc += g
        if sparse is not None:
            self._sparse.append((np.asarray(sparse[0], dtype=np.int64).copy(), np.array(sparse[1], copy=True)))
        if learning_rate is not None:
            self._rate = learning_rate
        self.contributors.append(worker)
        self._counted.add(worker)
        return READY if len(self.contributors) >= self.replicas_to_aggregate else PENDING

    def take(self) -> tuple[dict[tuple[int, int], np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
        """The mean gradients to apply now (over the contributions received: all of them, or fewer
        when dead replicas were dropped; dense half-precision ones in float32), at ``learning_rate``
        afterwards; advances the step and starts the next one."""
        n = float(max(1, len(self.contributors)))
        dense = self._dense  # the sums (or one replica's pushed arrays, applied at once): one is its own mean
        if n != 1.0:
            dense = {rows: g / n if self._dtype is not None else (g / n).astype(g.dtype, copy=False)
                     for rows, g in dense.items()}
        sparse = None
        if self._sparse:
            idx = np.concatenate([i for i, _ in self._sparse])
            vals = np.concatenate([v for _, v in self._sparse])
            sparse = (idx, (vals / n).astype(vals.dtype, copy=False))
        self.last_contributors = self.contributors
        self.learning_rate, self._rate = self._rate, None
        self._dense, self._sparse, self.contributors, self._counted, self._dtype = {}, [], [], set(), None
        self.step += 1
        return dense, sparse

    def discard(self) -> int:
        """Drop what has arrived for the current step without applying it (a recovery replaces
        the state it was computed on); the step stays. Returns how many gradients were dropped."""
        n = len(self.contributors)
        self._dense, self._sparse, self.contributors, self._counted, self._dtype = {}, [], [], set(), None
        self._rate = None
        self.dropped += n
        return n

    def missing(self, expected: list[str]) -> list[str]:
        """Which of ``expected`` have not pushed for the current step."""
        return [w for w in expected if w not in self._counted]


def _any_half(dense: dict[tuple[int, int], np.ndarray]) -> bool:
    """Whether a gradient is float16 or bfloat16 (a loop: a generator costs a push's part more)."""
    for g in dense.values():
        if half_precision(g.dtype):
            return True
    return False
