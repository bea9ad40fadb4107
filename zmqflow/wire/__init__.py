"""The wire format, sans-IO: messages to frames and back, with nothing but bytes in between."""

from .codec import (
    ERROR,
    REPLY,
    REQUEST,
    VERSION,
    DecodeError,
    Limits,
    Message,
    decode,
    encode,
    encode_reply,
    encode_request,
)
from .error_data import error_message, raise_error

__all__ = [
    "ERROR",
    "REPLY",
    "REQUEST",
    "VERSION",
    "DecodeError",
    "Limits",
    "Message",
    "decode",
    "encode",
    "encode_reply",
    "encode_request",
    "error_message",
    "raise_error",
]
