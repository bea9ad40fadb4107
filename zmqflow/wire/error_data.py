"""Errors as data: an exception becomes an error reply, and an error reply the local exception.

Only the code, type, message, plain details and (when a server debugs) the traceback text cross
the wire; the receiving side maps the code back to its own class, never to a class named by the
peer.
"""

from __future__ import annotations

import traceback as _tb
from typing import Any

from ..errors import ZmqflowError, error_class
from .message import ERROR, Message

__all__ = ["error_message", "raise_error", "error_from"]


def error_message(rid: int, exc: BaseException, *, source: str = "", with_traceback: bool = False) -> Message:
    """An error reply carrying ``exc`` as data: code, type, message and, only when asked (a
    server started with ``debug``), the traceback text: it tells a stranger the server's paths
    and code."""
    code = exc.code if isinstance(exc, ZmqflowError) else "INTERNAL"
    text = exc.message if isinstance(exc, ZmqflowError) else str(exc)
    tb = "".join(_tb.format_exception(exc)) if with_traceback else ""
    error: dict[str, Any] = {"code": code, "type": type(exc).__name__, "message": text, "traceback": tb}
    details = _plain_details(exc)
    if details:
        error["details"] = details
    return Message(kind=ERROR, id=rid, source=source, error=error)


def _plain_details(exc: BaseException) -> dict[str, Any]:
    """The error's details that are plain msgpack values (strings, numbers, lists of them)."""
    if not isinstance(exc, ZmqflowError):
        return {}
    plain = (str, int, float, bool, type(None))
    out: dict[str, Any] = {}
    for key, value in exc.details.items():
        if isinstance(value, plain):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            out[key] = list(value)
    return out


_RESERVED_DETAILS = frozenset(("message", "remote_traceback"))  # named parameters of ZmqflowError


def raise_error(msg: Message, *, context: str = "") -> None:
    """Raise the local class for an error reply (``RemoteError`` for unknown codes)."""
    err = msg.error or {}
    cls = error_class(err.get("code", ""))
    text = err.get("message", "")
    if context:
        text = f"{text} ({context})"
    if cls.__name__ == "RemoteError":
        text = f"{err.get('type', '?')}: {text}"
    raise error_from(err.get("code", ""), text, err.get("details"), remote_traceback=err.get("traceback"),
                     remote_type=err.get("type", ""))


def error_from(code: str, message: str, details: dict[str, Any] | None = None, **extra: Any) -> ZmqflowError:
    """The local error for a wire ``code`` (``RemoteError`` when unknown) with a peer's
    ``details`` and this side's ``extra`` (which win): keys that name the error's own parameters
    are left out, so a peer's map cannot make building it fail."""
    plain = {k: v for k, v in (details or {}).items()
             if isinstance(k, str) and k not in _RESERVED_DETAILS and k not in extra}
    return error_class(code)(message, **plain, **extra)
