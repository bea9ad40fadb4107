"""Where a ps task may write checkpoints: its checkpoint roots.

A save request names a directory; a task writes there only if the directory resolves
(``os.path.realpath``: symlinks followed, ``..`` collapsed) inside one of its roots. Roots come
from ``zmqflow serve --checkpoint-root DIR`` (repeatable), ``AsyncServer(checkpoint_roots=...)``,
or ``ZMQFLOW_CHECKPOINT_ROOTS`` (``os.pathsep``-separated), in that order; given roots replace any
default. A task with none writes nowhere: a remote caller must never choose where files land.

``ANYWHERE`` (``"*"``) lifts the confinement, and must be asked for: ``zmqflow launch`` asks for
it on a loopback cluster without ``--checkpoint-root`` (one user's processes, where a script's
``checkpoint_dir`` is trusted as it always was), and ``zmqflow.testing``'s in-process clusters do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..errors import ConfigError, InvalidArgument, PermissionDenied

__all__ = ["ANYWHERE", "ENV", "CheckpointRoots"]

ANYWHERE = "*"
ENV = "ZMQFLOW_CHECKPOINT_ROOTS"

_HOW = ("start the task with `zmqflow serve --checkpoint-root DIR` (repeatable), set ZMQFLOW_CHECKPOINT_ROOTS, "
        "or pass checkpoint_roots=[DIR] to zf.Server")


class CheckpointRoots:
    """The directories (real paths) a task may write checkpoints under, or anywhere."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]] = (), *, anywhere: bool = False):
        self.anywhere = anywhere
        self.roots: tuple[str, ...] = tuple(dict.fromkeys(os.path.realpath(os.fspath(r)) for r in roots))

    @classmethod
    def parse(cls, value: "Sequence[str | os.PathLike[str]] | str | None",
              env: Mapping[str, str] | None = None) -> "CheckpointRoots":
        """From a constructor argument: a list of directories, a string as the environment
        variable holds one (``"*"``: anywhere), or None: ``ZMQFLOW_CHECKPOINT_ROOTS``, else none."""
        if value is None:
            value = (os.environ if env is None else env).get(ENV, "")
        if isinstance(value, str):
            items: list[str | os.PathLike[str]] = [p for p in value.split(os.pathsep) if p]
        elif isinstance(value, os.PathLike):
            items = [value]
        else:
            items = list(value)
        if any(os.fspath(p) == ANYWHERE for p in items):
            if len(items) > 1:
                raise ConfigError(f"checkpoint roots: {ANYWHERE!r} (anywhere) cannot be combined with directories")
            return cls(anywhere=True)
        if any(not os.fspath(p) for p in items):
            raise ConfigError("checkpoint roots: an empty directory name")
        return cls(items)

    def to_env(self) -> str:
        """The value of ``ZMQFLOW_CHECKPOINT_ROOTS`` that means these roots."""
        return ANYWHERE if self.anywhere else os.pathsep.join(self.roots)

    def describe(self) -> str:
        if self.anywhere:
            return "anywhere"
        return ", ".join(self.roots) or "none"

    def confine(self, directory: str) -> str:
        """``directory``'s real path if it lies under a root; else ``PermissionDenied``. Checks
        only: creates and touches nothing."""
        if "\0" in directory:
            raise InvalidArgument(f"checkpoint directory {directory!r} holds a NUL character")
        real = os.path.realpath(directory)
        if self.anywhere:
            return real
        if not self.roots:
            raise PermissionDenied(f"checkpoint directory {directory!r} refused: this task has no checkpoint "
                                   f"roots, so it writes checkpoints nowhere; {_HOW}", directory=directory)
        if not any(real == r or os.path.commonpath([real, r]) == r for r in self.roots):
            raise PermissionDenied(f"checkpoint directory {directory!r} refused: it lies outside this task's "
                                   f"checkpoint roots ({self.describe()}); save under one of them, or {_HOW}",
                                   directory=directory)
        return real

    def __repr__(self) -> str:
        return f"CheckpointRoots({self.describe()})"
