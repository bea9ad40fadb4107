"""The plan of the shared-memory ring path, without I/O: how a call's buffer is cut into pieces,
which slot of a rank's segment holds a piece, when a writer may reuse a slot and when a reader
may fold a piece, and what a segment's name and header look like.

Every rank owns one segment of ``slots`` slots and writes its input there piece by piece; every
rank reads every other rank's pieces from their segments and folds them in rank order into its
own output. Pieces are numbered across calls (``base`` + index), so counters only ever grow: a
writer may put piece ``g`` into slot ``g % slots`` once every reader has consumed piece
``g - slots``; a reader may fold piece ``g`` once every writer has published it.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["MAGIC", "NAME_RE", "Layout", "MIN_PIECES", "FLOOR_BYTES", "pieces", "may_write", "may_read", "call_tag",
           "FIELDS", "meta_words", "differing", "segment_name", "valid_name", "GONE", "MISMATCH", "DEADLINE",
           "abort_word", "abort_reason"]

MAGIC = 0x7A6D71666C6F7731  # "zmqflow1"
NAME_RE = re.compile(r"^zmqflow-ring-(\d+)-([0-9a-f]{32})$")
# header words (int64): magic, rank, pid, token hi, token lo, written, abort, the aborted call, then read[n], tag[slots]
H_MAGIC, H_RANK, H_PID, H_TOK_HI, H_TOK_LO, H_WRITTEN, H_ABORT, H_ABORT_SEQ, H_FIXED = range(9)
# why a rank gave a call up, in its abort word with the rank at fault: that rank is gone, the
# calls differ (the ranks' descriptions say who), or this rank's deadline passed waiting for it
GONE, MISMATCH, DEADLINE = range(3)


def abort_word(kind: int, culprit: int, size: int) -> int:
    """The abort word a rank writes (after ``H_ABORT_SEQ``): never 0, which means no abort."""
    return 1 + culprit + size * kind


def abort_reason(word: int, size: int) -> tuple[int, int]:
    """(kind, culprit) of a non-zero abort word."""
    return divmod(word - 1, size)


class Layout:
    """Where things are in one rank's segment (every rank's segment has the same layout)."""

    def __init__(self, size: int, slots: int = 8, slot_bytes: int = 1 << 20):
        self.size, self.slots, self.slot_bytes = int(size), int(slots), int(slot_bytes)
        self.meta_word = H_FIXED + self.size + self.slots  # one word per field of the current call's description
        self.words = self.meta_word + len(FIELDS)
        self.data_offset = -(-self.words * 8 // 4096) * 4096
        self.total = self.data_offset + self.slots * self.slot_bytes

    def read_word(self, writer: int) -> int:
        """Header word where a reader counts the pieces of ``writer`` it has consumed."""
        return H_FIXED + writer

    def tag_word(self, slot: int) -> int:
        return H_FIXED + self.size + slot

    def slot_offset(self, piece: int) -> int:
        return self.data_offset + (piece % self.slots) * self.slot_bytes


MIN_PIECES = 4  # a mid-size call is cut at least this fine, so writing a piece overlaps folding the last
FLOOR_BYTES = 128 << 10  # but no finer: each piece costs a wake-up and a few Python steps


def pieces(count: int, itemsize: int, slot_bytes: int, min_pieces: int = MIN_PIECES,
           floor_bytes: int = FLOOR_BYTES) -> list[tuple[int, int]]:
    """Element ranges of a call's pieces: each fits one slot, at least ``min_pieces`` of them
    unless that makes a piece smaller than ``floor_bytes``; none for an empty buffer. Every rank
    cuts a call the same way (its count and dtype are part of the call's tag)."""
    itemsize = max(1, itemsize)
    size = min(slot_bytes, max(floor_bytes, -(-count * itemsize // max(1, min_pieces))))
    per = max(1, size // itemsize)
    return [(a, min(count, a + per)) for a in range(0, count, per)]


def may_write(piece: int, slots: int, consumed_by_readers: Sequence[int]) -> bool:
    """Slot ``piece % slots`` is free: every reader consumed the piece that held it before."""
    return all(c >= piece - slots + 1 for c in consumed_by_readers)


def may_read(piece: int, written_by_writers: Sequence[int]) -> bool:
    return all(w >= piece + 1 for w in written_by_writers)


FIELDS = ("collective", "op", "dtype", "tensor count", "element count", "shapes", "root")


def meta_words(meta: Any) -> list[int]:
    """A call's description (as the TCP ring sends it), one word per field, to name what differs."""
    return [zlib.crc32(repr(v).encode()) for v in (list(meta) + [None] * len(FIELDS))[:len(FIELDS)]]


def differing(mine: Sequence[int], theirs: Sequence[int]) -> list[str]:
    return [f for f, x, y in zip(FIELDS, mine, theirs) if int(x) != int(y)] or ["call sequence"]


def call_tag(seq: int, meta: Any) -> int:
    """What a slot carries to say which call wrote it; a reader that expects another sees a
    mismatch instead of folding the wrong call's data."""
    return zlib.crc32(repr((seq, meta)).encode()) | (seq & 0x7FFFFFFF) << 32


def segment_name(pid: int, token: bytes) -> str:
    return f"zmqflow-ring-{pid}-{token.hex()}"


def valid_name(name: Any, pid: int | None = None) -> bool:
    """A name this code makes (and, with ``pid``, made by that process); anything else is refused."""
    m = NAME_RE.match(name) if isinstance(name, str) else None
    return m is not None and (pid is None or int(m.group(1)) == pid)
