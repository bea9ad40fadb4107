"""Allocator tuning for processes that move big tensors.

glibc serves allocations above its mmap threshold (128 KiB, rising to at most 32 MiB) with fresh
mappings and returns them on free, so every multi-MB message buffer and every copied slice
page-faults all its pages again: measured here, pulling a 100 MB model from one shard ran at
0.31 GB/s that way and at 1.25 GB/s with big blocks kept in the heap. ``keep_big_blocks`` raises
the mmap threshold (and the trim threshold with it) so freed blocks are reused.

It also keeps the process to one malloc arena. Big messages are allocated by ZeroMQ's I/O
thread, which would otherwise get an arena of its own, made of 64 MB heaps that glibc unmaps as
soon as one is wholly free, whatever the thresholds say: the next big message faulted all its
pages in again (a 100 MB pull without ``out=`` took 45-55 ms where it takes 23-26 ms with one
arena), and ``malloc_trim`` never hands back the top of such a heap (32 MiB stayed resident
after an idle trim). One arena serves every thread from the main heap, which both keeps and
trims as set. The threads that share it are few (the loop, ZeroMQ's, pyzmq's), and the
transport benchmark measured no cost on small messages. It changes
process-wide malloc behaviour, so zmqflow applies it only in processes it owns (``zmqflow
serve``, launched tasks, benchmarks); a training script may call it too. The kept blocks stay
resident after the traffic that needed them; a task server hands them back once it goes quiet
(``zmqflow.server.idle_trim``).

``settle_gc`` tunes Python's cycle collector for the same processes. A push of many variables
keeps thousands of container objects alive at once (its items, their checks, their answer), so
the default young generation (700) collected two or three times a push of 200 variables, and the
survivors, alive only until the push ended, were promoted to the old generations: every few
steps a full collection walked the server's every object. Frozen after start-up, and with a young
generation that holds a request's objects, a step's objects die young and unseen.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys

__all__ = ["keep_big_blocks", "settle_gc", "GC_YOUNG"]

GC_YOUNG = 50_000  # young objects before a collection: a push of thousands of items makes fewer

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_applied = False


def keep_big_blocks(mmap_threshold: int = 128 << 20, trim_threshold: int = 512 << 20) -> bool:
    """Keep blocks up to ``mmap_threshold`` in the heap, in one arena; True where glibc accepted
    it. Call it before the process starts threads that allocate (ZeroMQ's, at its first socket):
    a thread that already has an arena keeps it."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them (no ctypes.util to import)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
        ) and bool(libc.mallopt(_M_ARENA_MAX, 1))
    except (OSError, AttributeError):  # not glibc (musl, for one): nothing to tune
        return False
    _applied = ok
    if not ok:
        log.debug("mallopt refused the thresholds; keeping the allocator's defaults")
    return ok


def settle_gc(young: int = GC_YOUNG) -> None:
    """Freeze every object made so far (modules, the server's own state: long-lived, never
    garbage) out of the collector's sight, and collect the young generation only past ``young``
    new objects, not the default 700. Call it once start-up is done. Cycles that do become
    garbage are still collected, later: ``young`` objects at most wait for it."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(young, threshold[0]), *threshold[1:])
