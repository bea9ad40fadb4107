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
"""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["keep_big_blocks"]

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
