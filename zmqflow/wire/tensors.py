"""A message's tensor table, sans-IO: its arrays as table entries and frames, and back.

An array goes in a frame of its own, ``[dtype, shape, frame]``, except where a message holds two
or more arrays of 1 to ``PACK_BELOW`` - 1 bytes: those share pack frames, each at an offset that
is a multiple of ``PACK_ALIGN``, ``[dtype, shape, frame, offset]``. A frame costs libzmq and
pyzmq some microseconds each way whatever its size, so a model of many small variables spent most
of a pull or push on its frames (raw pyzmq: a round trip of 200 frames of 1 KB took 4.7 ms, one
of 200 KB 0.19 ms). Below the copy threshold ZeroMQ copies a frame anyway: copying a small array
into a pack costs nothing more. The receiver's arrays are views of the pack, aligned within it.
``protocol/SPEC.md`` section 3 is the normative description.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dtypes import AS_IS, LOADED as _LOADED_DTYPES, WIRE_DTYPES, dtype_name
from .message import DecodeError, LimitExceeded, Limits

__all__ = ["PACK_BELOW", "PACK_ALIGN", "PACK_BYTES", "MAX_TENSORS", "MAX_NDIM", "wire_buffer", "write", "read",
           "short", "dims_ok"]

PACK_BELOW = 16 << 10  # arrays of fewer bytes (and at least one) share pack frames, two or more of them
PACK_ALIGN = 16  # an offset in a pack: a multiple of every wire dtype's itemsize
PACK_BYTES = 1 << 20  # a pack holds at most this much: an array kept alive keeps its whole pack
MAX_TENSORS = 1 << 16  # entries one table may have (the compiled codec's MAX_REFS)
MAX_NDIM = 32


def wire_buffer(arr: np.ndarray) -> tuple[np.ndarray, str]:
    """A little-endian C-ordered buffer of ``arr``: the array itself when it is one (no per-send
    reshape or view), else a flat byte view; copies only when the layout forces it."""
    dtype = arr.dtype
    name = AS_IS.get(dtype)
    if name is not None and arr.flags.c_contiguous:  # the common case: a native array, sent as it is
        return arr, name
    name = dtype_name(dtype)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8), name


def write(arrays: list[np.ndarray]) -> tuple[list[list[Any]], list[Any]]:
    """The table of ``arrays`` and their frames after the header: the unpacked arrays' buffers in
    order, then the packs (bytearrays, zero between their arrays)."""
    pairs = [wire_buffer(a) for a in arrays]
    small = [i for i, (buf, _) in enumerate(pairs) if 0 < buf.nbytes < PACK_BELOW]
    if len(small) < 2:
        return [[name, list(a.shape), i + 1] for i, (a, (_, name)) in enumerate(zip(arrays, pairs))], \
            [buf for buf, _ in pairs]
    places: dict[int, tuple[int, int]] = {}  # array -> (pack, offset)
    sizes = [0]
    for i in small:
        offset = -(-sizes[-1] // PACK_ALIGN) * PACK_ALIGN
        if offset + pairs[i][0].nbytes > PACK_BYTES:
            sizes.append(0)
            offset = 0
        places[i] = (len(sizes) - 1, offset)
        sizes[-1] = offset + pairs[i][0].nbytes
    frames: list[Any] = [buf for i, (buf, _) in enumerate(pairs) if i not in places]
    packs = [bytearray(n) for n in sizes]
    bytes_of = [np.frombuffer(p, np.uint8) for p in packs]
    first_pack = len(frames) + 1
    table: list[list[Any]] = []
    whole = 0
    for i, (a, (buf, name)) in enumerate(zip(arrays, pairs)):
        place = places.get(i)
        if place is None:
            whole += 1
            table.append([name, list(a.shape), whole])
            continue
        k, offset = place
        bytes_of[k][offset:offset + buf.nbytes] = buf.reshape(-1).view(np.uint8)
        table.append([name, list(a.shape), first_pack + k, offset])
    return table, frames + packs


def read(table: object, frames: Sequence[Any], limits: Limits, rid: int, kind: str) -> list[np.ndarray]:
    """The arrays ``table`` describes over ``frames`` (the header first), each checked: its dtype,
    shape and frame, its bytes those of its frame (or, packed, within it, in order, apart from
    the others), every frame described; DecodeError or LimitExceeded naming the first at fault."""
    if not isinstance(table, list):
        raise DecodeError(f"tensor table must be a list, got {type(table).__name__}", request_id=rid, kind=kind)
    if len(table) > MAX_TENSORS:
        raise LimitExceeded(f"{len(table)} tensors exceed the limit of {MAX_TENSORS} a message", request_id=rid,
                            kind=kind)
    nframes = len(frames)
    if len(table) < nframes - 1 or (len(table) > nframes - 1 and not any(
            e.__class__ is list and len(e) == 4 for e in table)):  # a frame too many, or (none packed) too few
        raise DecodeError(f"header describes {len(table)} tensors but {nframes - 1} tensor frames arrived",
                          request_id=rid, kind=kind)
    arrays: list[np.ndarray] = []
    seen = bytearray(nframes)  # 1: a frame of one array; 2: a pack
    last = (0, 0)  # where the last packed array ended: (frame, byte)
    total = 0
    for i, entry in enumerate(table):
        if entry.__class__ is not list or not 3 <= len(entry) <= 4:
            raise DecodeError(f"tensor {i}: entry must be [dtype, shape, frame] or [dtype, shape, frame, offset]",
                              request_id=rid, kind=kind)
        name, shape, index = entry[0], entry[1], entry[2]
        dtype = _LOADED_DTYPES.get(name) if name.__class__ is str else None
        if dtype is None:
            dtype = WIRE_DTYPES.get(name) if name.__class__ is str else None  # ml_dtypes' load on first use
            if dtype is None:
                raise DecodeError(f"tensor {i}: unknown wire dtype {short(name)}", request_id=rid, kind=kind)
        if shape.__class__ is not list or len(shape) > MAX_NDIM or not dims_ok(shape):
            raise DecodeError(f"tensor {i}: shape must be a list of at most {MAX_NDIM} non-negative ints, got "
                              f"{short(shape)}", request_id=rid, kind=kind)
        packed = len(entry) == 4
        if index.__class__ is not int or not 1 <= index < nframes or seen[index] == 1 or (seen[index] and not packed):
            raise DecodeError(f"tensor {i}: frame index {short(index)} is out of range or used twice",
                              request_id=rid, kind=kind)
        view = memoryview(frames[index])
        nbytes = view.nbytes  # a zmq Frame or bytes: one-dimensional bytes, so nbytes is its length
        expected = (shape[0] if len(shape) == 1 else math.prod(shape)) * dtype.itemsize
        offset = entry[3] if packed else 0
        if packed and (offset.__class__ is not int or offset < 0 or offset % dtype.itemsize or (index, offset) < last):
            raise DecodeError(f"tensor {i}: offset {short(offset)} in frame {index} is not a multiple of its "
                              f"itemsize at or past where the tensor before it ended", request_id=rid, kind=kind)
        if not seen[index]:
            if nbytes > limits.max_frame_bytes:
                raise LimitExceeded(f"tensor {i}: frame of {nbytes} bytes exceeds the limit of "
                                    f"{limits.max_frame_bytes}", request_id=rid, kind=kind)
            total += nbytes
            if total > limits.max_message_bytes:
                raise LimitExceeded(f"tensor frames of more than {limits.max_message_bytes} bytes in one message "
                                    "exceed the limit", request_id=rid, kind=kind)
            seen[index] = 2 if packed else 1
        if (offset + expected > nbytes) if packed else (expected != nbytes):
            raise DecodeError(f"tensor {i}: {name}{tuple(shape)} needs {expected} bytes but its frame has {nbytes}"
                              + (f" from offset {offset}" if packed else ""), request_id=rid, kind=kind)
        if packed:
            last = (index, offset + expected)
        try:  # over the frame's memory, read-only where it is
            arrays.append(np.ndarray(shape, dtype, view, offset) if packed else np.ndarray(shape, dtype, view))
        except ValueError:  # an empty shape whose other dimensions overflow numpy's index type
            raise DecodeError(f"tensor {i}: shape {short(shape)} is too large", request_id=rid, kind=kind) from None
    if seen.count(0) > 1:  # the header's own slot is never seen
        unseen = [k for k in range(1, nframes) if not seen[k]]
        raise DecodeError(f"tensor frames {unseen} are not described by the tensor table", request_id=rid, kind=kind)
    return arrays


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxlong = _SHORT.maxother = 40


def short(value: object) -> str:
    """A peer's value as a refusal quotes it: a few dozen characters, cheaply, however large the value."""
    return _SHORT.repr(value[:40] if isinstance(value, (bytes, bytearray)) else value)[:80]  # reprlib: bytes whole


def dims_ok(shape: list) -> bool:
    for d in shape:
        if d.__class__ is not int or d < 0:  # msgpack's ints are exact ints
            return False
    return True
