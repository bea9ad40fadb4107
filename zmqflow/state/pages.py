"""Zeroed arrays on their own anonymous memory mappings, for state that grows by reallocation.

A dynamic table doubles its row arrays and rebuilds its index as it fills. Through malloc, the
arrays it leaves behind stay resident in the heap (servers raise malloc's mmap and trim
thresholds so that big message buffers are reused: ``transport.memory.keep_big_blocks``), so a
table filled by doubling would hold about twice its bytes. On its own mapping, an array's pages
go back to the OS when it is dropped, and pages never written are never resident: a grown
array costs only the rows in use. The temporaries of a big rebuild (an index of millions of ids)
do come from the heap; ``trim`` hands their pages back once it is done.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import numpy as np

__all__ = ["zeros", "scratch", "trim", "MAPPED_MIN_BYTES", "SCRATCH_MIN_BYTES"]

MAPPED_MIN_BYTES = 1 << 20  # smaller arrays come from malloc: a mapping per small array costs more than it saves


def zeros(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """``np.zeros(shape, dtype)``, on an anonymous mapping of its own when it is big."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return np.zeros(dims, dt)
    # the array holds the mapping (its buffer) alive; the mapping is unmapped when the array goes
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dt).reshape(dims)


# Replies and temporaries at least this big (a lookup that fills thousands of fresh rows) get a
# mapping of their own: through malloc they would stay resident as free heap blocks after the
# request (the heap keeps big blocks for reuse), a table's worth of RSS held for nothing. Smaller
# ones, the steady state of training batches, stay in the heap, where reuse saves page faults.
SCRATCH_MIN_BYTES = 8 << 20


def scratch(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An array to fill (contents undefined): on its own mapping when big, so that its pages go
    back to the OS when it is dropped (after its reply is sent), else ``np.empty``."""
    dt = np.dtype(dtype)
    if math.prod(shape) * dt.itemsize < SCRATCH_MIN_BYTES:
        return np.empty(shape, dt)
    return zeros(shape, dt)


_libc: ctypes.CDLL | None | bool = None


def trim() -> bool:
    """Return the heap's free pages to the OS (glibc's ``malloc_trim``); False where there is none."""
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                # the process's own symbols, libc's among them: no ctypes.util (and the shutil and
                # tempfile it imports) in every task server
                lib = ctypes.CDLL(None)
                lib.malloc_trim  # glibc only (musl has none)
                _libc = lib
            except (OSError, AttributeError):
                pass
    if _libc is False:
        return False
    return bool(_libc.malloc_trim(0))
