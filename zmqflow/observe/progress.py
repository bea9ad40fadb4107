"""This process's training progress: step, samples seen, restarts and the last error.

One record per process, because ``zmqflow status`` asks a task (its server), not a training
loop: whatever loop runs in the process (``MonitoredTrainingSession``, a torch
``DistributedOptimizer``, the user's own through :func:`report_progress`) feeds the same record,
and the task's ``master.status`` reply carries its :func:`snapshot`. Sans-IO and cheap: an update
takes one uncontended lock for a few attribute writes, so a step loop can call it every step.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidArgument

__all__ = ["Progress", "RESTART_ENV", "MAX_ERROR_CHARS", "restarts_from", "report_progress", "report_step",
           "tick", "note_error", "snapshot", "reset", "record", "counts_steps"]

# Set by ``zmqflow launch`` for every process it starts: 0 at first, +1 at each restart.
RESTART_ENV = "ZMQFLOW_RESTART_COUNT"
# The error text a snapshot carries at most: the status reply stays small whatever was raised.
MAX_ERROR_CHARS = 300


def restarts_from(environ: Mapping[str, str]) -> int:
    """The restart count ``zmqflow launch`` gave this process; 0 when absent or unreadable (a
    status field must never stop a process from starting)."""
    try:
        return max(0, int(environ.get(RESTART_ENV, "0")))
    except ValueError:
        return 0


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):  # int, numpy and 0-d torch integers
        raise InvalidArgument(f"report_progress: {what} must be an integer, got {type(value).__name__}")
    n = int(value.__index__())
    if n < 0:
        raise InvalidArgument(f"report_progress: {what} must be >= 0, got {n}")
    return n


def _clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = " ".join(text.split())  # one line: a table cell, a log line
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Progress:
    """A thread-safe progress record (see the module docstring). ``clock``: wall time, for the
    times a reader shows as dates; ``monotonic``: this process's own clock, for the error's age,
    which a reader on another host can show as it is (both injectable)."""

    def __init__(self, restarts: int = 0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self._monotonic = monotonic
        self.restarts = restarts
        self._step: int | None = None
        self._explicit = False  # a step was reported by value: counted steps no longer move it
        self._samples: int | None = None
        self._reported_at: float | None = None
        self._error: str | None = None
        self._error_at: float | None = None
        self._error_mono: float | None = None  # ``monotonic()`` when the last error was noted
        self._errors = 0
        self._error_id: int | None = None  # the exception last noted: noting it again changes nothing

    def report(self, step: int | None = None, samples: int | None = None) -> None:
        """``step``: the training step now (it replaces any counted one). ``samples``: samples
        processed since the last report (added to the total)."""
        s = None if step is None else _count(step, "step")
        n = None if samples is None else _count(samples, "samples")
        now = self._clock()
        with self._lock:
            if s is not None:
                self._step, self._explicit = s, True
            if n is not None:
                self._samples = (self._samples or 0) + n
            self._reported_at = now

    def tick(self, samples: int | None = None) -> None:
        """One more step done (an optimizer's ``step()``): counts the step unless the loop reports
        its step by value, which is then the one shown."""
        n = None if samples is None else _count(samples, "samples")
        now = self._clock()
        with self._lock:
            if not self._explicit:
                self._step = (self._step or 0) + 1
            if n is not None:
                self._samples = (self._samples or 0) + n
            self._reported_at = now

    def note_error(self, error: BaseException | str) -> None:
        """Remember ``error`` as the last one (its type and message, cut to MAX_ERROR_CHARS)."""
        text = _clip(error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        ident = None if isinstance(error, str) else id(error)
        now, mono = self._clock(), self._monotonic()
        with self._lock:
            if ident is not None and ident == self._error_id and text == self._error:
                return  # the same exception, seen again on its way out (a step, then the session's exit)
            self._error, self._error_at, self._error_mono, self._error_id = text, now, mono, ident
            self._errors += 1

    def snapshot(self) -> dict[str, Any]:
        """What a status reply carries; keys with nothing to say are absent. ``error_age_s``: the
        seconds since the last error, on this process's clock (a watcher's clock may differ)."""
        mono = self._monotonic()
        with self._lock:
            out: dict[str, Any] = {"restarts": self.restarts}
            if self._step is not None:
                out["step"] = self._step
            if self._samples is not None:
                out["samples"] = self._samples
            if self._reported_at is not None:
                out["reported_at"] = self._reported_at
            if self._error is not None:
                age = max(0.0, mono - self._error_mono) if self._error_mono is not None else None
                out.update(error=self._error, error_at=self._error_at, error_age_s=age, errors=self._errors)
            return out


_record: Progress | None = None
_record_lock = threading.Lock()


def record() -> Progress:
    """The process-wide record (made on first use, reading ``ZMQFLOW_RESTART_COUNT`` then)."""
    global _record
    rec = _record
    if rec is None:
        with _record_lock:
            if _record is None:
                _record = Progress(restarts_from(os.environ))
            rec = _record
    return rec


def report_progress(step: int | None = None, samples: int | None = None) -> None:
    """Tell ``zmqflow status`` where this process's training is: ``step`` (the step now) and/or
    ``samples`` (processed since the last call; the status shows their rate). Call it from any
    training loop, as often as every step."""
    record().report(step, samples)


report_step = report_progress


def tick(samples: int | None = None) -> None:
    """One more step (for the runtime's optimizers); see :meth:`Progress.tick`."""
    record().tick(samples)


def note_error(error: BaseException | str) -> None:
    """Record an error that escaped a training step or that the runtime caught and handled."""
    record().note_error(error)


def counts_steps(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a step method: each return counts one step (:func:`tick`), each exception that
    escapes it is noted (:func:`note_error`) and raised on."""

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            note_error(exc)
            raise
        tick()
        return out

    return step


def snapshot() -> dict[str, Any]:
    return record().snapshot()


def reset(to: Progress | None = None) -> None:
    """Forget this process's record (tests): a fresh one reads the environment again, or ``to``
    takes its place (a record with clocks of the test's choosing)."""
    global _record
    with _record_lock:
        _record = to
