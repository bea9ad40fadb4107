"""The message and its bounds: what a codec turns into frames, and what a decoder refuses.

Kept apart from the codec so that the format's vocabulary (kinds, version, limits, the errors a
malformed message raises) reads in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError, ResourceExhausted, VersionMismatch

__all__ = ["VERSION", "REQUEST", "REPLY", "ERROR", "KINDS", "DEFAULT_LIMITS", "Limits", "Message", "DecodeError",
           "LimitExceeded", "VersionError"]

VERSION = 1
REQUEST, REPLY, ERROR = "req", "rep", "err"
KINDS = (REQUEST, REPLY, ERROR)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a decoder enforces before trusting anything a peer sent. A message past one is
    refused with :class:`LimitExceeded` (``RESOURCE_EXHAUSTED``), answered when its id is readable."""

    max_header_bytes: int = 4 << 20
    max_frame_bytes: int = 2 << 30  # one tensor frame: whole parts travel in one (create, restore)
    max_frames: int = 4096
    max_container_len: int = 1 << 20
    max_depth: int = 256  # nesting of arrays and maps in the header, the header map itself counted
    max_message_bytes: int = 8 << 30  # every frame of one message together


DEFAULT_LIMITS = Limits()


@dataclass(slots=True)
class Message:
    """One request, reply or error. ``body`` holds arguments (a map, or a declared request of
    :mod:`.requests`, sent as the map of its fields) or results; arrays may sit anywhere in it."""

    kind: str
    id: int
    service: str = ""
    op: str = ""
    body: Any = None
    deadline: float | None = None  # seconds left when sent; relative, so clocks need not agree
    source: str = ""
    error: dict[str, str] | None = field(default=None)


class DecodeError(ProtocolError):
    """A message broke the format. ``request_id`` is set when the id was readable, so a reply is possible."""

    def __init__(self, message: str, *, request_id: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.kind = kind


class VersionError(DecodeError, VersionMismatch):
    """A header of a protocol version this side does not speak."""


class LimitExceeded(DecodeError, ResourceExhausted):
    """A message passed one of the decoder's :class:`Limits` (sizes, counts, nesting)."""

    code = ResourceExhausted.code
