"""A Chrome trace of what a task does: pulls, pushes, ring phases, checkpoints, recoveries.

``ZMQFLOW_TIMELINE=FILE`` turns it on for the process (read once, at import). The trace is the
Trace Event Format's JSON Array Format, viewable in ``chrome://tracing`` and https://ui.perfetto.dev:

- each task is a process (``pid``), named by a metadata event (``worker:0``);
- each kind of activity is a thread (``tid``) of that process: ``pull``, ``push``, ``ring``,
  ``ring wait``, ``ring send``, ``ring reduce``, ``checkpoint``, ``recovery``, ``sync round``.
  Spans of one kind that overlap in time (a collective per bucket in flight, one wait per chunk)
  take the next free lane of that kind (``ring wait 2``) so every track nests properly;
- a span is a complete event (``"ph": "X"``, ``ts`` and ``dur`` in microseconds); a recovery's
  start is also an instant event (``"ph": "i"``).

File names: when the process knows its task (``ZMQFLOW_TASK``, which ``zmqflow launch`` sets for
every task, a pod's index, TF_CONFIG or Slurm's rank, or :func:`set_task` before the first event) the task goes before the extension, so
processes sharing the variable never share a file: ``timeline.json`` -> ``timeline.worker-0.json``
(a task restarted by ``zmqflow launch --restart`` writes ``timeline.worker-0.restart1.json``, ...).
A process without a task writes ``FILE`` itself.

Timestamps are wall-clock microseconds since the epoch, taken as one ``time.time_ns()`` anchor plus
``perf_counter`` offsets (monotonic within the process), so files of several processes line up
when ``zmqflow timeline merge`` joins them.

Memory stays bounded: events go to the file as they happen, through a buffer of at most
``FLUSH_BYTES`` written out whole (never half an event) at least every ``FLUSH_S`` seconds (by a
daemon thread when the task goes quiet). A clean
exit writes the closing bracket (``atexit``); a process that recorded nothing (``zmqflow launch``
itself, a ps task no one used) writes no file. A killed process leaves a file without it, which
Chrome's and Perfetto's loaders accept (the format allows it), as does the merge; it loses at most
the events of its last ``FLUSH_S`` seconds.

Off (the variable unset), every entry point returns at once on a module-level check; :func:`span`
hands back one shared do-nothing context manager and :func:`traced` leaves functions as they are.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ..cluster import env_task_name
from ..errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["ENV", "Recorder", "enabled", "start", "stop", "set_task", "span", "traced", "instant", "complete",
           "now_us", "task_path", "recorder"]

ENV = "ZMQFLOW_TIMELINE"
FLUSH_BYTES = 64 << 10
FLUSH_S = 1.0
F = TypeVar("F", bound=Callable[..., Any])


def task_path(path: str, task: str | None, restart: int = 0) -> str:
    """``path`` with ``task`` before its extension (``t.json``, ``worker:0`` -> ``t.worker-0.json``;
    a restarted task's ``restart``-th run: ``t.worker-0.restart1.json``, so no run overwrites another's)."""
    if not task:
        return path
    root, ext = os.path.splitext(path)
    tag = task.replace(":", "-").replace("/", "-") + (f".restart{restart}" if restart > 0 else "")
    return f"{root}.{tag}{ext}"


class Recorder:
    """One process's trace file. Thread-safe: spans end on the loop thread and on callers' threads."""

    def __init__(self, path: str, task: str | None = None, restart: int = 0):
        if not path:
            raise ConfigError(f"{ENV}: the timeline needs a file name")
        self.base = path
        self.task = task
        self.restart = restart
        self.path: str | None = None  # chosen when the first event is written
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._last_flush = time.monotonic()
        self._first = True
        self._closed = False
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()  # wall clock at perf_counter 0
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[int, str, int], int] = {}
        self._busy: dict[tuple[int, str], set[int]] = {}  # lanes with a span open
        self._stop = threading.Event()
        # a task that goes quiet (hung, or waiting) still has its last events on disk within FLUSH_S
        threading.Thread(target=self._flusher, name="zmqflow-timeline", daemon=True).start()
        self._ends: dict[tuple[int, str], list[float]] = {}  # per lane, when its last span ended

    def now_us(self) -> float:
        return (self._anchor_ns + time.perf_counter_ns()) / 1000.0

    # ids ---------------------------------------------------------------------------------
    def _pid(self, task: str | None) -> int:
        name = task or self.task or f"process {os.getpid()}"
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._write({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        return pid

    def _tid(self, pid: int, kind: str, lane: int) -> int:
        tid = self._tids.get((pid, kind, lane))
        if tid is None:
            tid = self._tids[(pid, kind, lane)] = len(self._tids) + 1
            label = kind if lane == 0 else f"{kind} {lane + 1}"
            self._write({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            self._write({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        return tid

    def acquire(self, kind: str, task: str | None, since: float | None = None) -> tuple[int, int, int]:
        """A lane of ``kind`` on ``task``'s process free since ``since`` (default: now): no span
        open on it, none recorded on it ending later. Returns (pid, tid, lane)."""
        with self._lock:
            pid = self._pid(task)
            busy = self._busy.setdefault((pid, kind), set())
            ends = self._ends.setdefault((pid, kind), [])
            lane = 0
            while lane in busy or (since is not None and lane < len(ends) and ends[lane] > since):
                lane += 1
            busy.add(lane)
            return pid, self._tid(pid, kind, lane), lane

    def release(self, pid: int, kind: str, lane: int, event: dict[str, Any]) -> None:
        with self._lock:
            self._busy[(pid, kind)].discard(lane)
            ends = self._ends[(pid, kind)]
            ends.extend([0.0] * (lane + 1 - len(ends)))
            ends[lane] = max(ends[lane], event["ts"] + event["dur"])
            self._write(event)

    def emit(self, kind: str, event: dict[str, Any], task: str | None = None) -> None:
        """An event on lane 0 of ``kind`` (instants, and spans measured elsewhere that never overlap)."""
        with self._lock:
            pid = self._pid(task)
            event["pid"], event["tid"] = pid, self._tid(pid, kind, 0)
            self._write(event)
            if event.get("ph") == "i":
                self._flush()  # what happened just before a crash is what the trace is read for

    # the file ------------------------------------------------------------------------------
    def _write(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        text = json.dumps(event, separators=(",", ":"), default=str)
        self._pending.append(("[\n" if self._first else ",\n") + text)
        self._first = False
        self._pending_bytes += len(text) + 2
        if self._pending_bytes >= FLUSH_BYTES or time.monotonic() - self._last_flush >= FLUSH_S:
            self._flush()

    def _open(self) -> int:
        self.path = task_path(self.base, self.task, self.restart)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        data = "".join(self._pending).encode()
        self._pending, self._pending_bytes = [], 0
        try:
            if self._fd is None:
                self._fd = self._open()
            view = memoryview(data)
            while view:  # whole events only: a process killed later leaves no half-written one behind
                view = view[os.write(self._fd, view):]
        except OSError as exc:  # the trace is lost, the training is not: say so once, record no more
            log.error("%s=%s: cannot write the timeline (%s); recording stops", ENV, self.path or self.base, exc)
            self._closed = True

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flusher(self) -> None:
        while not self._stop.wait(FLUSH_S):
            if self._pending:
                self.flush()

    def close(self) -> None:
        """Write what is pending and the closing bracket: the file is then one valid JSON array."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            if not self._first:  # nothing recorded (a launcher, a status call): no file at all
                self._pending.append("\n]\n")
                self._flush()
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_rec: Recorder | None = None  # the process's recorder; None: the timeline is off


def recorder() -> Recorder | None:
    return _rec


def enabled() -> bool:
    return _rec is not None


def start(path: str, task: str | None = None, restart: int = 0) -> Recorder:
    """Record this process's timeline to ``path`` (with ``task`` inserted, when given); what
    ``ZMQFLOW_TIMELINE`` does at import. A recorder already running is closed first."""
    global _rec
    stop()
    _rec = Recorder(path, task, restart)
    return _rec


def stop() -> None:
    """Close the file (valid JSON from then on) and turn the timeline off."""
    global _rec
    rec, _rec = _rec, None
    if rec is not None:
        rec.close()


def set_task(task: Any) -> None:
    """This process's task, for its file name and its default process track; effective until the
    first event is written (a task named later keeps the name the file already has)."""
    rec = _rec
    if rec is not None and rec.path is None and rec._first:
        rec.task = str(task)


def now_us() -> float:
    """The timeline's clock (wall-clock anchored microseconds); 0.0 when off."""
    rec = _rec
    return rec.now_us() if rec is not None else 0.0


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


@contextmanager
def _span(rec: Recorder, kind: str, name: str, task: str | None, args: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    pid, tid, lane = rec.acquire(kind, task)
    t0 = rec.now_us()
    extra: dict[str, Any] = dict(args) if args else {}
    try:
        yield extra
    except BaseException as exc:
        extra["error"] = type(exc).__name__
        raise
    finally:
        t1 = rec.now_us()
        event = {"ph": "X", "name": name, "cat": kind, "ts": t0, "dur": max(t1 - t0, 0.001), "pid": pid, "tid": tid}
        if extra:
            event["args"] = extra
        rec.release(pid, kind, lane, event)


def span(kind: str, name: str | None = None, task: str | None = None, args: dict[str, Any] | None = None) -> Any:
    """``with span("push"):`` records a complete event on ``task``'s (default: this process's)
    ``kind`` track. The ``as`` target is a dict whose items become the event's args (None when
    off)."""
    rec = _rec
    if rec is None:
        return _NULL
    return _span(rec, kind, name or kind, task, args)


def complete(kind: str, name: str, start_us: float, task: str | None = None, args: dict[str, Any] | None = None) -> None:
    """A span that began at ``start_us`` (:func:`now_us`) and ends now, measured where a ``with``
    does not fit (a send acknowledged in a callback). It takes a free lane like :func:`span`."""
    rec = _rec
    if rec is None:
        return
    t1 = rec.now_us()
    pid, tid, lane = rec.acquire(kind, task, since=start_us)
    event = {"ph": "X", "name": name, "cat": kind, "ts": start_us, "dur": max(t1 - start_us, 0.001), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    rec.release(pid, kind, lane, event)


def instant(kind: str, name: str, task: str | None = None, args: dict[str, Any] | None = None) -> None:
    """A moment on ``kind``'s track (a shard found lost); flushed at once."""
    rec = _rec
    if rec is None:
        return
    event: dict[str, Any] = {"ph": "i", "s": "p", "name": name, "cat": kind, "ts": rec.now_us()}
    if args:
        event["args"] = args
    rec.emit(kind, event, task)


async def _awaited(rec: Recorder, kind: str, label: str, coro: Any) -> Any:
    with _span(rec, kind, label, None, None):
        return await coro


def traced(kind: str, name: str | None = None) -> Callable[[F], F]:
    """Record every call of the decorated function (sync or a coroutine function) as a span.
    The check is made per call, so a timeline started later is seen; off, it costs one call."""

    def wrap(fn: F) -> F:
        label = name or fn.__name__.lstrip("_")
        if inspect.iscoroutinefunction(fn):
            def traced_async(*a: Any, **k: Any) -> Any:  # a plain function: off, no coroutine of its own
                rec = _rec
                if rec is None:
                    return fn(*a, **k)
                return _awaited(rec, kind, label, fn(*a, **k))

            out = functools.wraps(fn)(traced_async)
            mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+: still looks like one
            return mark(out) if mark is not None else out  # type: ignore[no-any-return]

        def traced_sync(*a: Any, **k: Any) -> Any:
            rec = _rec
            if rec is None:
                return fn(*a, **k)
            with _span(rec, kind, label, None, None):
                return fn(*a, **k)

        return functools.wraps(fn)(traced_sync)  # type: ignore[return-value]

    return wrap


def _from_env() -> None:
    path = os.environ.get(ENV)
    if path:
        restart = os.environ.get("ZMQFLOW_RESTART_COUNT", "0")
        start(path, env_task_name(), int(restart) if restart.isdigit() else 0)
        atexit.register(stop)


_from_env()
