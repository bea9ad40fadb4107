"""Watching a checkpoint directory: each new checkpoint as it is committed, and the end of training.

``checkpoints_iterator`` is TF's ``tf.train.checkpoints_iterator`` for zmqflow checkpoints. It
finds checkpoints only as :func:`zmqflow.checkpoint.checkpoints` lists them (complete ones: a save's
manifest is written last, so a half-written checkpoint is never listed) and never reads the files.
It yields them in the order they were saved, as ``latest`` orders them: a run restored to an older
checkpoint and trained on saves lower steps than the ones it left behind, and those saves are new.

The end of training is a marker, ``training-finished.json`` (``{"step": N, "order": ...}``: the
final checkpoint's step and place among the saves), that the chief writes beside the
checkpoints once training ended normally, after its final save
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
from ..state.dirfd import open_nofollow, opened_dir
from ..state.snapshot import write_atomic
from .checkpoint_files import Order, saved

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
    """Say that training has ended and ``step`` (default: the last saved checkpoint's; -1 with
    none) is its final checkpoint (the last saved at that step): watchers stop after it. Written
    atomically, through a descriptor of the directory; returns its path."""
    found = saved(directory)
    if step is not None:
        found = [s for s in found if checkpoint_step(s.path) == step]
    final = found[-1] if found else None
    if step is None:
        step = checkpoint_step(final.path) if final is not None else -1
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FINAL_MARKER)
    marker = {"step": int(step), "order": None if final is None else list(final.order), "time": time.time()}
    with opened_dir(directory) as fd:  # the temporary's name has no step in it: pruning never sweeps it
        write_atomic(path, text=json.dumps(marker), dir_fd=fd)  # a reader sees the old marker or the new one
    return path


def clear_final(directory: str) -> None:
    """Remove the marker (a chief starting or resuming: training has not finished)."""
    try:
        os.remove(os.path.join(directory, FINAL_MARKER))
    except FileNotFoundError:
        pass


def final_step(directory: str) -> int | None:
    """The final checkpoint's step once training has ended, else None."""
    final = _final(directory)
    return None if final is None else final[0]


def _final(directory: str) -> tuple[int, Order | None] | None:
    """(step, place among the saves, when the marker says) of the final checkpoint, else None."""
    try:
        fd = open_nofollow(None, os.path.join(directory, FINAL_MARKER))
        with open(fd) as fh:
            marker = json.load(fh)
        step, order = int(marker["step"]), marker.get("order")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # being replaced right now (written atomically, so only a foreign file gets here)
    try:
        return step, (int(order[0]), float(order[1]), str(order[2]))
    except (TypeError, ValueError, IndexError):
        return step, None  # a marker from before saves were ordered: by step


def checkpoints_iterator(directory: str, *, min_interval_secs: float = 0, timeout: float | None = None,
                         timeout_fn: Callable[[], bool] | None = None, poll_secs: float = POLL_SECS,
                         stop_at_final: bool = True) -> Iterator[str]:
    """Yield each new complete checkpoint of ``directory`` (its manifest's path), oldest save first.

    Every checkpoint saved after the last one yielded is yielded once, in the order they were
    saved, whatever their steps (one pruned before its turn is skipped; one saved before the last
    yielded never comes). Between checks the directory is listed every ``poll_secs``;
    ``min_interval_secs`` is the least time between two yields (TF's). With ``timeout``, after
    that many seconds without a new checkpoint ``timeout_fn()`` is asked: True (or no
    ``timeout_fn``) ends the iteration, False waits another ``timeout``. With ``stop_at_final``,
    the iteration ends once the checkpoint named by the training-finished marker
    (:func:`mark_final`) has been yielded."""
    if poll_secs <= 0 or min_interval_secs < 0 or (timeout is not None and timeout < 0):
        raise InvalidArgument(f"checkpoints_iterator: poll_secs {poll_secs!r} must be > 0, min_interval_secs "
                              f"{min_interval_secs!r} and timeout {timeout!r} >= 0")
    last: tuple[Order, int] | None = None  # the last one yielded: its place among the saves, its step
    last_yield = float("-inf")
    waiting_since = time.monotonic()
    while True:
        fresh = [s for s in saved(directory) if last is None or s.order > last[0]]
        if fresh:
            wait = last_yield + min_interval_secs - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                continue  # list again: more may have landed, or this one been pruned meanwhile
            last, last_yield = (fresh[0].order, checkpoint_step(fresh[0].path)), time.monotonic()
            yield fresh[0].path
            waiting_since = time.monotonic()  # the caller's time with the checkpoint is not waiting
            continue
        final = _final(directory) if stop_at_final else None
        if final is not None and _reached(final, last):
            return
        now = time.monotonic()
        if timeout is not None and now - waiting_since >= timeout:
            if timeout_fn is None or timeout_fn():
                return
            waiting_since = now
        pause = poll_secs if timeout is None else min(poll_secs, max(0.0, waiting_since + timeout - now))
        time.sleep(max(pause, 0.001))


def _reached(final: tuple[int, Order | None], last: tuple[Order, int] | None) -> bool:
    """Whether the final checkpoint has been yielded (or there is none): by its place among the
    saves, or by step for a marker that does not say."""
    step, order = final
    if order is None:
        return step <= (last[1] if last is not None else -1)
    return last is not None and order <= last[0]
