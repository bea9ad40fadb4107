"""Traffic and error counters a task reports in its ``status``, and its idle heap trims."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..wire.codec import compiled_module

__all__ = ["Counters", "frames_nbytes"]


def _frames_nbytes(frames: Any) -> int:
    """Bytes in outgoing frames: bytes headers and array (or memoryview) payloads."""
    n = 0
    for f in frames:  # a loop: twice as fast as sum() over a list for the usual two or three frames
        if f.__class__ is bytes:
            n += len(f)
        else:
            try:
                n += f.nbytes  # arrays and memoryviews
            except AttributeError:  # received frames and messages: their length is their bytes
                n += len(f)
    return n


_built = compiled_module()
# one C call where the codec was compiled (the same count: codec_c.c's nbytes), else the loop above
frames_nbytes: Callable[[Any], int] = _built.nbytes if _built is not None else _frames_nbytes


@dataclass(slots=True)
class Counters:
    msgs_in: int = 0
    msgs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0  # error replies sent
    dropped: int = 0  # messages that could not be answered (unreadable id, not a request)
    undeliverable: int = 0  # replies whose requester was gone or never drained its pipe
    late_replies: int = 0  # replies that arrived after their call had ended
    heap_trims: int = 0  # free heap handed back to the OS once quiet (server/idle_trim.py)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
