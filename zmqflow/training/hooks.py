"""Hooks run around each step of a training run.

Hooks see the run through :class:`TrainingRun`, the few things they read (and ``request_stop``),
not through the monitored session's class: they are written, and tested, against that protocol
alone, and the session is free to change everything else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["metrics_line", "EveryNSteps", "Hook", "LoggingHook", "NamedStrategy", "ProgressHook", "StopAtStep", "SummaryHook",
           "TrainingRun"]

log = logging.getLogger("zmqflow.training")


class NamedStrategy(Protocol):
    """What a hook may read of the strategy: its name, for display."""

    @property
    def name(self) -> str: ...


class TrainingRun(Protocol):
    """What hooks read of the run (``MonitoredTrainingSession`` is one)."""

    @property
    def step(self) -> int:
        """The global step after the last ``apply``."""

    @property
    def is_chief(self) -> bool:
        """Whether this task holds the chief's duties now (hooks that write files often check)."""

    @property
    def task_name(self) -> str:
        """This task as logs and file names show it ("local" without a cluster)."""

    @property
    def worker_index(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def checkpoint_dir(self) -> str | None:
        """Where checkpoints go: the default home of a hook's files."""

    @property
    def strategy(self) -> NamedStrategy: ...

    @property
    def hooks(self) -> Sequence[Hook]:
        """Every hook of the run, so one can read another's settings (the progress bar, the last step)."""

    def params(self) -> dict[str, np.ndarray]:
        """The current parameters (a pull on a ps cluster: not free)."""

    def timings(self) -> dict[str, float]: ...

    def request_stop(self) -> None:
        """Stop the loop: ``should_stop()`` answers True from now on."""


class Hook:
    """Override what you need: ``begin``, ``after_step``, ``should_stop``, ``end``."""

    def begin(self, mon: TrainingRun) -> None:
        pass

    def after_step(self, mon: TrainingRun, step: int, metrics: dict[str, float]) -> None:
        pass

    def should_stop(self, mon: TrainingRun) -> bool:
        return False

    def end(self, mon: TrainingRun) -> None:
        pass


class StopAtStep(Hook):
    """Stop once the global step reaches ``last_step`` (or ``num_steps`` after the first step seen)."""

    def __init__(self, last_step: int | None = None, num_steps: int | None = None):
        if (last_step is None) == (num_steps is None):
            raise ValueError("give exactly one of last_step and num_steps")
        self.last_step = last_step
        self.num_steps = num_steps

    def begin(self, mon: TrainingRun) -> None:
        if self.num_steps is not None:
            self.last_step = mon.step + self.num_steps

    def should_stop(self, mon: TrainingRun) -> bool:
        return self.last_step is not None and mon.step >= self.last_step


class EveryNSteps:
    """When a periodic hook acts: on the first step it is asked about, then once the global step
    has moved ``n`` past the step it last acted on (TF's ``SecondOrStepTimer``). Not on multiples
    of ``n``: the global step jumps (async workers push too) and can skip every one of them."""

    def __init__(self, n: int):
        self.n = max(1, int(n))
        self.last: int | None = None

    def reset(self) -> None:
        """Forget the last step (a hook's ``begin``): the next step asked about is due."""
        self.last = None

    def due(self, step: int) -> bool:
        """Whether to act at ``step``; a step below the last one (a restore rewound it) starts over."""
        return self.last is None or step >= self.last + self.n or step < self.last

    def acted(self, step: int) -> None:
        self.last = step


class LoggingHook(Hook):
    """Log the step, the metrics passed to ``apply`` and the step rate every ``every_n_steps``
    (the first step, then each ``every_n_steps`` further on: see :class:`EveryNSteps`)."""

    def __init__(self, every_n_steps: int = 100):
        self.every = max(1, int(every_n_steps))
        self._timer = EveryNSteps(self.every)
        self._logged_at = 0.0

    def begin(self, mon: TrainingRun) -> None:
        self._timer.reset()

    def after_step(self, mon: TrainingRun, step: int, metrics: dict[str, float]) -> None:
        if not self._timer.due(step):
            return
        now, last = time.perf_counter(), self._timer.last
        rate = ""  # none on the first log: no interval yet (nor after a rewind)
        if last is not None and step > last:
            rate = f" ({(step - last) / max(now - self._logged_at, 1e-9):.1f} steps/s)"
        self._timer.acted(step)
        self._logged_at = now
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        log.info("step %d: %s%s", step, shown or "-", rate)


class SummaryHook(Hook):
    """Scalars every ``every_n_steps`` (as :class:`LoggingHook`): TensorBoard event files with
    tensorboardX, else JSON lines, one record per line: ``{"step": 3, "time": 1.7e9, "metrics":
    {"loss": 0.25}}``. The metrics sit in a map of their own, so any name is one (``step``,
    ``time`` too); a value that is not finite is ``null``, so every line is strict JSON."""

    def __init__(self, every_n_steps: int = 100, output_dir: str | None = None):
        self.every = max(1, int(every_n_steps))
        self._timer = EveryNSteps(self.every)
        self.output_dir = output_dir
        self._writer: Any = None
        self._file: Any = None

    def begin(self, mon: TrainingRun) -> None:
        self._timer.reset()
        directory = self.output_dir or mon.checkpoint_dir or "summaries"
        os.makedirs(directory, exist_ok=True)
        try:
            from tensorboardX import SummaryWriter  # type: ignore[import-not-found]

            self._writer = SummaryWriter(directory)
        except ImportError:
            self._file = open(os.path.join(directory, f"summaries-{mon.task_name}.jsonl"), "a")

    def after_step(self, mon: TrainingRun, step: int, metrics: dict[str, float]) -> None:
        if not metrics or not self._timer.due(step):
            return
        self._timer.acted(step)
        if self._writer is not None:
            for k, v in metrics.items():
                self._writer.add_scalar(k, float(v), step)
        elif self._file is not None:
            self._file.write(metrics_line(step, metrics))
            self._file.flush()

    def end(self, mon: TrainingRun) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


def metrics_line(step: int, metrics: dict[str, float]) -> str:
    """One strict JSON line of the summaries and of an evaluator's ``metrics.jsonl``: the metrics
    nested (a metric named ``step`` or ``time`` cannot overwrite the record's own), non-finite
    values null."""
    record = {"step": step, "time": time.time(), "metrics": {k: _finite_or_none(v) for k, v in metrics.items()}}
    return json.dumps(record, allow_nan=False) + "\n"


def _finite_or_none(value: float) -> float | None:
    """``value`` for a JSON line: NaN and the infinities have no JSON form, and are null there."""
    number = float(value)
    return number if math.isfinite(number) else None


class ProgressHook(Hook):
    """A progress bar on the chief: rich's on a terminal, else a text line every 10%."""

    def __init__(self, total: int | None = None):
        self.total = total
        self._bar: Any = None
        self._task: Any = None
        self._next_pct = 10

    def begin(self, mon: TrainingRun) -> None:
        if self.total is None:
            self.total = next((h.last_step for h in mon.hooks if isinstance(h, StopAtStep)), None)
        if sys.stdout.isatty():
            try:
                from rich.progress import Progress  # type: ignore[import-not-found]

                self._bar = Progress()
                self._bar.start()
                self._task = self._bar.add_task(f"training ({mon.strategy.name})", total=self.total)
            except ImportError:
                self._bar = None

    def after_step(self, mon: TrainingRun, step: int, metrics: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step)
            return
        if self.total:
            pct = 100 * step // self.total
            if pct >= self._next_pct:
                filled = pct // 5
                shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
                print(f"[{'#' * filled}{'.' * (20 - filled)}] {pct:3d}%  step {step}/{self.total}  {shown}", flush=True)
                self._next_pct = (pct // 10 + 1) * 10

    def end(self, mon: TrainingRun) -> None:
        if self._bar is not None:
            self._bar.stop()
