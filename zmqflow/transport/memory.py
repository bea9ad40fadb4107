"""Allocator tuning for processes that move big tensors.

glibc serves allocations above its mmap threshold (128 KiB, rising to at most 32 MiB) with fresh
mappings and returns them on free, so every multi-MB message buffer and every copied slice
page-faults all its pages again: measured here, pulling a 100 MB model from one shard ran at
0.31 GB/s that way and at 1.25 GB/s with big blocks kept in the heap. ``keep_big_blocks`` raises
the mmap threshold (and the trim threshold with it) so freed blocks are reused. It changes
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
_applied = False


def keep_big_blocks(mmap_threshold: int = 128 << 20, trim_threshold: int = 512 << 20) -> bool:
    """Keep blocks up to ``mmap_threshold`` in the heap; True where glibc accepted it."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them (no ctypes.util to import)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
        )
    except (OSError, AttributeError):  # not glibc (musl, for one): nothing to tune
        return False
    _applied = ok
    if not ok:
        log.debug("mallopt refused the thresholds; keeping the allocator's defaults")
    return ok
