"""Watching a checkpoint directory: each new checkpoint as it is committed, and the end of training.

``checkpoints_iterator`` is TF's ``tf.train.checkpoints_iterator`` for zmqflow checkpoints. It
finds checkpoints only through :func:`zmqflow.checkpoint.checkpoints` (complete ones: a save's
manifest is written last, so a half-written checkpoint is never listed) and never reads the files.

The end of training is a marker, ``training-finished.json`` (``{"step": N}``), that the chief
writes beside the checkpoints once training ended normally, after its final save
(``MonitoredTrainingSession`` does on close; a script of its own calls :func:`mark_final`). The
iterator returns once it has yielded the checkpoint the marker names (or, with no newer
checkpoint, at once), so an evaluator stops after the final checkpoint without waiting out a
timeout. A chief starting (again) clears the marker (:func:`clear_final`); an evaluator started
before the chief of a resumed run cleared an old marker may stop after the old final checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator

from ..errors import InvalidArgument
from . import checkpoint

__all__ = ["checkpoints_iterator", "checkpoint_step", "mark_final", "clear_final", "final_step", "FINAL_MARKER"]

FINAL_MARKER = "training-finished.json"
POLL_SECS = 1.0  # the longest a new checkpoint waits to be seen, by default
_STEP = re.compile(r"(\d+)")


def checkpoint_step(path: str) -> int:
    """The step of a checkpoint (a manifest's path, as :func:`zmqflow.checkpoint.checkpoints` lists)."""
    found = _STEP.findall(os.path.basename(path))
    if not found:
        raise InvalidArgument(f"{path!r} is not a checkpoint manifest (no step in its name)")
    return int(found[-1])


def mark_final(directory: str, step: int | None = None) -> str:
    """Say that training has ended and ``step`` (default: the newest checkpoint's; -1 with none)
    is its final checkpoint: watchers stop after it. Written atomically; returns its path."""
    if step is None:
        newest = checkpoint.latest(directory)
        step = checkpoint_step(newest) if newest is not None else -1
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FINAL_MARKER)
    tmp = f"{path}.tmp-{os.getpid()}"  # never a name a checkpoint's pruning sweeps (no step in it)
    with open(tmp, "w") as fh:
        json.dump({"step": int(step), "time": time.time()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # a reader sees the old marker or the new one, never half of one
    return path


def clear_final(directory: str) -> None:
    """Remove the marker (a chief starting or resuming: training has not finished)."""
    try:
        os.remove(os.path.join(directory, FINAL_MARKER))
    except FileNotFoundError:
        pass


def final_step(directory: str) -> int | None:
    """The final checkpoint's step once training has ended, else None."""
    try:
        with open(os.path.join(directory, FINAL_MARKER)) as fh:
            return int(json.load(fh)["step"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # being replaced right now (written atomically, so only a foreign file gets here)


def checkpoints_iterator(directory: str, *, min_interval_secs: float = 0, timeout: float | None = None,
                         timeout_fn: Callable[[], bool] | None = None, poll_secs: float = POLL_SECS,
                         stop_at_final: bool = True) -> Iterator[str]:
    """Yield each new complete checkpoint of ``directory`` (its manifest's path), oldest first.

    Every checkpoint newer than the last one yielded is yielded once, in step order (one pruned
    before its turn is skipped; one older than the last yielded never comes). Between checks the
    directory is listed every ``poll_secs``; ``min_interval_secs`` is the least time between two
    yields (TF's). With ``timeout``, after that many seconds without a new checkpoint
    ``timeout_fn()`` is asked: True (or no ``timeout_fn``) ends the iteration, False waits another
    ``timeout``. With ``stop_at_final``, the iteration ends once the checkpoint named by the
    training-finished marker (:func:`mark_final`) has been yielded."""
    if poll_secs <= 0 or min_interval_secs < 0 or (timeout is not None and timeout < 0):
        raise InvalidArgument(f"checkpoints_iterator: poll_secs {poll_secs!r} must be > 0, min_interval_secs "
                              f"{min_interval_secs!r} and timeout {timeout!r} >= 0")
    last: int | None = None
    last_yield = float("-inf")
    waiting_since = time.monotonic()
    while True:
        fresh = [(checkpoint_step(p), p) for p in checkpoint.checkpoints(directory)]
        fresh = sorted(sp for sp in fresh if last is None or sp[0] > last)
        if fresh:
            step, path = fresh[0]
            wait = last_yield + min_interval_secs - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                continue  # list again: more may have landed, or this one been pruned meanwhile
            last, last_yield = step, time.monotonic()
            yield path
            waiting_since = time.monotonic()  # the caller's time with the checkpoint is not waiting
            continue
        final = final_step(directory) if stop_at_final else None
        if final is not None and (final <= (last if last is not None else -1)):
            return
        now = time.monotonic()
        if timeout is not None and now - waiting_since >= timeout:
            if timeout_fn is None or timeout_fn():
                return
            waiting_since = now
        pause = poll_secs if timeout is None else min(poll_secs, max(0.0, waiting_since + timeout - now))
        time.sleep(max(pause, 0.001))
