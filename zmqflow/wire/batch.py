"""The batch envelope, sans-IO: several small messages for one peer in one transport message.

One libzmq send (and one I/O-thread wakeup) per small request is most of what a small call costs;
an envelope carries every small request (or reply) a peer is sent in one loop tick. Two frames:
a msgpack header ``{"v": 1, "k": "bat", "id": ..., "n": [[len, ...], ...]}`` listing, per entry,
the lengths of its frames, and one frame holding all those frames back to back, each starting
at a multiple of 8 bytes (zero padding) so tensors stay aligned. Each entry is a complete version-1
message, decoded (and answered) on its own by :func:`.codec.decode`. ``protocol/SPEC.md``
section 10 is the normative description.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .codec import DEFAULT_LIMITS, VERSION, DecodeError, Limits, LimitExceeded, compiled_module
from .peek import read_start

__all__ = ["BATCH", "BatchLimits", "Batch", "DEFAULT_BATCH_LIMITS", "encode_batch", "decode_batch", "batch_id"]

BATCH = "bat"
_MAX_ID = (1 << 64) - 1
_ALIGN = 8
_PAD = bytes(_ALIGN)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What a receiver accepts in one envelope; anything past a limit is refused whole, unrun."""

    max_entries: int = 1024
    max_bytes: int = 1 << 20  # the entries' frame, padding included
    max_header_bytes: int = 64 << 10


DEFAULT_BATCH_LIMITS = BatchLimits()


@dataclass(slots=True)
class Batch:
    id: int
    entries: list[list[memoryview]]  # each entry's frames: views into the envelope's data frame


def encode_batch(bid: int, entries: Sequence[Sequence[Any]]) -> list[bytes]:
    """The two frames of an envelope holding ``entries`` (each the frames of one encoded message)."""
    head = {"v": VERSION, "k": BATCH, "id": bid, "n": None}
    fast = compiled_module()
    if fast is not None:
        try:
            head["n"], data = fast.join(entries)
            return [msgpack.packb(head, use_bin_type=True), data]
        except (TypeError, ValueError, BufferError):  # not a list of buffers: the loop below says what
            pass
    lengths: list[list[int]] = []
    parts: list[Any] = []
    pos = 0
    for frames in entries:
        sizes = []
        for f in frames:
            n = f.nbytes if hasattr(f, "nbytes") else len(f)
            pad = -pos & (_ALIGN - 1)
            if pad:
                parts.append(_PAD[:pad])
            parts.append(f)
            sizes.append(n)
            pos += pad + n
        lengths.append(sizes)
    head["n"] = lengths
    return [msgpack.packb(head, use_bin_type=True), b"".join(parts)]


def batch_id(header: Any) -> int | None:
    """The envelope id when ``header`` (a frame that did not decode as a message) claims to be a
    batch envelope of this version, else None: then it is an ordinary unreadable message."""
    found = read_start(memoryview(header), 16)
    rid = found.get("id")
    if found.get("k") == BATCH and found.get("v") == VERSION and rid.__class__ is int and 0 <= rid <= _MAX_ID:
        return rid
    return None


def decode_batch(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS,
                 batch_limits: BatchLimits = DEFAULT_BATCH_LIMITS) -> Batch:
    """Check an envelope whole (before any entry runs) and cut it into its entries' frames.

    Raises :class:`.codec.DecodeError` (``LimitExceeded`` past a limit) with ``request_id`` set
    to the envelope id when it is readable, and ``kind`` ``"bat"``."""
    if not frames:
        raise DecodeError("empty message: no header frame")
    header = memoryview(frames[0])
    bid = batch_id(header)
    if bid is None:
        raise DecodeError("not a batch envelope of version 1 (v, k and id come first)")

    def bad(why: str, cls: type[DecodeError] = DecodeError) -> DecodeError:
        return cls(f"batch envelope {bid} refused, none of its requests ran: {why}", request_id=bid, kind=BATCH)

    if header.nbytes > batch_limits.max_header_bytes:
        raise bad(f"header of {header.nbytes} bytes exceeds the limit of {batch_limits.max_header_bytes}", LimitExceeded)
    if len(frames) != 2:
        raise bad(f"an envelope is 2 frames (header, entries), got {len(frames)}")
    cap = max(batch_limits.max_entries, limits.max_frames) + 1  # one over: the count is refused by name below
    try:
        head = msgpack.unpackb(header, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0, max_str_len=16,
                               max_array_len=cap, max_map_len=16)
    except Exception as exc:
        raise bad(f"header is not valid msgpack within the envelope's limits: {type(exc).__name__}: {exc}") from None
    if not isinstance(head, dict):
        raise bad("header must be a map")
    table = head.get("n")
    if table.__class__ is not list or not table:
        raise bad(f"'n' must be a non-empty list of entries, got {type(table).__name__}")
    if len(table) > batch_limits.max_entries:
        raise bad(f"{len(table)} entries exceed the limit of {batch_limits.max_entries}", LimitExceeded)
    data = memoryview(frames[1])
    if data.nbytes > batch_limits.max_bytes:
        raise bad(f"{data.nbytes} bytes of entries exceed the limit of {batch_limits.max_bytes}", LimitExceeded)
    fast = compiled_module()
    split = fast.split(table, data, limits.max_frames) if fast is not None else None
    if split is not None:  # else malformed (or not compiled): the loop below names the fault
        return Batch(bid, split)
    entries: list[list[memoryview]] = []
    pos = 0
    end = data.nbytes
    for i, sizes in enumerate(table):
        if sizes.__class__ is not list or not sizes or len(sizes) > limits.max_frames:
            raise bad(f"entry {i} must be a list of 1..{limits.max_frames} frame lengths, got {sizes!r:.80}")
        entry = []
        for n in sizes:
            if n.__class__ is not int or n < 0:
                raise bad(f"entry {i}: frame length {n!r:.40} is not a non-negative int")
            pos += -pos & (_ALIGN - 1)
            if pos + n > end:
                raise bad(f"entry {i} runs past the end of the entries frame ({end} bytes): truncated")
            entry.append(data[pos:pos + n])
            pos += n
        entries.append(entry)
    if pos != end:
        raise bad(f"{end - pos} bytes after the last entry")
    return Batch(bid, entries)
