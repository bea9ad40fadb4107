"""Where a ps task may write checkpoints: its checkpoint roots.

A save request names a directory; a task writes there only if the directory resolves
(``os.path.realpath``: symlinks followed, ``..`` collapsed) inside one of its roots. Roots come
from ``zmqflow serve --checkpoint-root DIR`` (repeatable), ``AsyncServer(checkpoint_roots=...)``,
or ``ZMQFLOW_CHECKPOINT_ROOTS`` (``os.pathsep``-separated), in that order; given roots replace any
default. A task with none writes nowhere: a remote caller must never choose where files land.

The check is made once, on names; what is written goes through a descriptor of the directory
(:meth:`CheckpointRoots.open_dir`) reached from its root's one real component at a time, no link
followed, so a link swapped in after the check leads nowhere: the write is refused instead.

``ANYWHERE`` (``"*"``) lifts the confinement, and must be asked for: ``zmqflow launch`` asks for
it on a loopback cluster without ``--checkpoint-root`` (one user's processes, where a script's
``checkpoint_dir`` is trusted as it always was), and ``zmqflow.testing``'s in-process clusters do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..errors import ConfigError, InvalidArgument, PermissionDenied
from ..state.dirfd import DIR_FLAGS, NAME_MAX, SymlinkInTheWay, walk

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
        if not any(_under(real, r) for r in self.roots):
            raise PermissionDenied(f"checkpoint directory {directory!r} refused: it lies outside this task's "
                                   f"checkpoint roots ({self.describe()}); save under one of them, or {_HOW}",
                                   directory=directory)
        return real

    def open_dir(self, directory: str) -> tuple[str, int]:
        """(``directory``'s real path, a descriptor of it, made if missing) once :meth:`confine`
        allows it: opened from its root's descriptor one component at a time with ``O_NOFOLLOW``.
        A link met on the way (swapped in after the check) is ``PermissionDenied``, nothing made
        beyond it; a name too long or a file in the way is ``InvalidArgument``. The caller closes
        the descriptor, and reaches the files in it through it."""
        real = self.confine(directory)
        if any(len(os.fsencode(part)) > NAME_MAX for part in real.split(os.sep)):  # before any is made
            raise InvalidArgument(f"checkpoint directory {directory[:80]!r}...: a name in it is over the {NAME_MAX} "
                                  "bytes a name may have", directory=directory[:4096])
        root = os.sep if self.anywhere else next(r for r in self.roots if _under(real, r))
        below = [c for c in os.path.relpath(real, root).split(os.sep) if c not in ("", os.curdir)]
        try:
            os.makedirs(root, exist_ok=True)  # the root itself is the operator's: its path is trusted
            root_fd = os.open(root, DIR_FLAGS | os.O_NOFOLLOW)
            try:
                return real, walk(root_fd, below, create=True)
            finally:
                os.close(root_fd)
        except SymlinkInTheWay as exc:
            raise PermissionDenied(f"checkpoint directory {directory!r} refused: {exc.name!r} on its way became a "
                                   f"symbolic link after the directory was checked", directory=directory) from None
        except OSError as exc:  # a file in the way, a read-only disk: the caller's to fix
            raise InvalidArgument(f"cannot make checkpoint directory {directory[:80]!r}: {exc.strerror or exc}",
                                  directory=directory[:4096]) from None

    def __repr__(self) -> str:
        return f"CheckpointRoots({self.describe()})"


def _under(real: str, root: str) -> bool:
    return real == root or os.path.commonpath([real, root]) == root
