"""What can be read of a header that cannot be decoded whole, and how deeply one nests.

A header too big, too deep or with a container over its limit is refused; its ``v``, ``k`` and
``id`` (written first by every encoder) are still read from its start, key by key, so that the
refusal is answered instead of dropped.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["PEEK_BYTES", "read_start", "container_marks", "too_deep"]

PEEK_BYTES = 1 << 16  # v, k and id come first: they are read from the header's start alone

# every byte but msgpack's array and map markers (fixmap, fixarray, array 16/32, map 16/32)
_NOT_MARKS = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF))


def read_start(header_view: memoryview, max_container_len: int) -> dict[str, Any]:
    """``v``, ``k`` and ``id`` among the header map's first keys, as far as they can be read."""
    found: dict[str, Any] = {}
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=PEEK_BYTES, max_bin_len=PEEK_BYTES,
                                    max_str_len=PEEK_BYTES, max_array_len=max_container_len,
                                    max_map_len=max_container_len, max_ext_len=16)
        unpacker.feed(header_view[:PEEK_BYTES])
        for _ in range(min(unpacker.read_map_header(), 8)):
            key = unpacker.unpack()
            if key in ("v", "k", "id") and key not in found:
                found[key] = unpacker.unpack()
                if len(found) == 3:
                    break
            else:
                unpacker.skip()
    except Exception:
        pass  # a truncated or malformed start: what was read so far is all there is
    return found


def container_marks(header: bytes | memoryview) -> int:
    """An upper bound on the arrays and maps in a header, counted at C speed: each level of
    nesting needs a marker byte of its own, so a header with no more marks than the depth limit
    cannot pass it, and most are never walked."""
    raw = header if isinstance(header, bytes) else bytes(header)
    return len(raw.translate(None, _NOT_MARKS))


def too_deep(obj: list | dict, left: int) -> bool:
    """Whether arrays and maps nest below ``obj`` more than ``left`` levels (stops at the first
    branch that does; recursion is bounded by ``left``)."""
    for v in (obj.values() if obj.__class__ is dict else obj):
        if (v.__class__ is list or v.__class__ is dict) and (left <= 0 or too_deep(v, left - 1)):
            return True
    return False
