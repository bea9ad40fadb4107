"""Typed errors shared by every layer.

Each class has a stable ``code`` that travels on the wire inside an error reply, so a
``NotFound`` raised by a server is raised as ``NotFound`` again in the client. Codes the
client does not know become :class:`RemoteError`, keeping the remote type and traceback.
"""

from __future__ import annotations

__all__ = [
    "ZmqflowError",
    "ConfigError",
    "AddressInUse",
    "ClusterNotReady",
    "SessionClosed",
    "Unavailable",
    "Recovering",
    "ShardStateLost",
    "DeadlineExceeded",
    "NotFound",
    "InvalidArgument",
    "VariableConflict",
    "PermissionDenied",
    "Unauthenticated",
    "ResourceExhausted",
    "CollectiveMismatch",
    "ProtocolError",
    "VersionMismatch",
    "RemoteError",
    "error_class",
]


class ZmqflowError(Exception):
    """Base of every zmqflow error; ``code`` names it on the wire."""

    code = "UNKNOWN"

    def __init__(self, message: str = "", *, remote_traceback: str | None = None, **details: object):
        super().__init__(message)
        self.message = message
        self.remote_traceback = remote_traceback
        self.details = details

    def __reduce__(self):  # keep exceptions picklable for multiprocessing-based tooling
        return (_rebuild, (type(self), self.message, self.remote_traceback, self.details))


def _rebuild(cls, message, remote_traceback, details):
    return cls(message, remote_traceback=remote_traceback, **details)


class ConfigError(ZmqflowError, ValueError):
    """A cluster spec, task name, address or option is wrong; nothing was started."""

    code = "CONFIG"


class AddressInUse(ZmqflowError, OSError):
    """A task's address could not be bound because something else holds it."""

    code = "ADDRESS_IN_USE"


class ClusterNotReady(ZmqflowError, TimeoutError):
    """Some tasks did not answer before the wait ended; ``missing`` lists them."""

    code = "CLUSTER_NOT_READY"

    @property
    def missing(self) -> list[str]:
        return list(self.details.get("missing", []))


class SessionClosed(ZmqflowError, RuntimeError):
    """A session was used after ``close()``: closing is final, as TF's ``Session.close`` is (a
    session that reopened itself would hold connections nobody closes). Raised on the caller's
    side only: not a wire code (one that came over the wire would be a RemoteError)."""

    code = "SESSION_CLOSED"


class Unavailable(ZmqflowError, ConnectionError):
    """The peer is known to be gone or could not be reached."""

    code = "UNAVAILABLE"


class Recovering(Unavailable):
    """The ps shard is being restored from a checkpoint (fenced): retry once recovery ends.
    ``epoch`` numbers the shard's recoveries."""

    code = "RECOVERING"


class ShardStateLost(Unavailable):
    """A ps shard restarted since this session used it and came back without the state it held:
    its variables' names may still be known, their values are gone until restored from a
    checkpoint (``zf.checkpoint.restore``; ``zf.checkpoint.recover`` on a running cluster).
    Not a ``NotFound``: nothing is wrong with the name asked for. ``task`` names the shard."""

    code = "SHARD_STATE_LOST"

    @property
    def task(self) -> str:
        return str(self.details.get("task", ""))


class DeadlineExceeded(ZmqflowError, TimeoutError):
    """The peer did not answer before the call's deadline."""

    code = "DEADLINE_EXCEEDED"


class NotFound(ZmqflowError, LookupError):
    """An unknown name: a service, an op, a task, a variable."""

    code = "NOT_FOUND"


class InvalidArgument(ZmqflowError, ValueError):
    """An argument has the wrong type, shape, dtype or value."""

    code = "INVALID_ARGUMENT"


class VariableConflict(InvalidArgument):
    """A declaration disagrees with the variable that already exists under that name."""

    code = "VARIABLE_CONFLICT"


class PermissionDenied(ZmqflowError, PermissionError):
    """The caller may not do this: a function no task registered or allowed, a path outside the
    checkpoint roots, an admin op from a client key. Nothing was read or changed."""

    code = "PERMISSION_DENIED"


class Unauthenticated(ZmqflowError, PermissionError):
    """The peer did not accept this side's key (or it had none): authentication is the reason.
    Nothing was read or changed."""

    code = "UNAUTHENTICATED"


class ResourceExhausted(ZmqflowError):
    """A request would pass a configured limit (bytes, elements, variables, requests in flight);
    it was refused before anything was allocated or recorded."""

    code = "RESOURCE_EXHAUSTED"


class CollectiveMismatch(ZmqflowError):
    """Ranks of one collective call disagree on its sequence, op, dtype or shape."""

    code = "COLLECTIVE_MISMATCH"


class ProtocolError(ZmqflowError):
    """A message could not be decoded or broke the wire format's rules."""

    code = "PROTOCOL"


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version; the message was refused unread."""

    code = "VERSION_MISMATCH"


class RemoteError(ZmqflowError):
    """A remote failure whose code this side does not know; ``remote_type`` keeps its name."""

    code = "REMOTE"

    @property
    def remote_type(self) -> str:
        return str(self.details.get("remote_type", ""))


_BY_CODE: dict[str, type[ZmqflowError]] = {
    cls.code: cls
    for cls in (
        ConfigError,
        AddressInUse,
        ClusterNotReady,
        Unavailable,
        Recovering,
        ShardStateLost,
        DeadlineExceeded,
        NotFound,
        InvalidArgument,
        VariableConflict,
        PermissionDenied,
        Unauthenticated,
        ResourceExhausted,
        CollectiveMismatch,
        ProtocolError,
        VersionMismatch,
    )
}


def error_class(code: str) -> type[ZmqflowError]:
    """The class for a wire error code, :class:`RemoteError` when the code is unknown."""
    return _BY_CODE.get(code, RemoteError)
