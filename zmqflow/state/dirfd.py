"""Checkpoint files reached through a directory's descriptor, never again by a path.

A path is a question asked anew each time it is used: a directory checked once (inside a
checkpoint root, no symbolic link leading out) and then opened by name may meanwhile have become a
link to somewhere else. So a checkpoint directory is opened once, from its root's descriptor one
component at a time with ``O_NOFOLLOW``, and every file in it is then opened, renamed, removed or
listed relative to that descriptor (``dir_fd=``), its own name never followed when it is a link.
POSIX calls (``openat``, ``renameat``, ``unlinkat``, ``fdopendir``); libraries that open only by
name get the descriptor's ``/proc/self/fd`` name, which is the open file itself.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["DIR_FLAGS", "NAME_MAX", "open_dir", "opened_dir", "walk", "open_nofollow", "opener", "fd_name", "is_file",
           "SymlinkInTheWay"]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
NAME_MAX = 255  # bytes of one file name on the file systems checkpoints go to (ext4, xfs, NFS)
_FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


class SymlinkInTheWay(OSError):
    """A component that must be a directory or a file of its own is a symbolic link."""

    def __init__(self, name: str):
        super().__init__(errno.ELOOP, f"{name!r} is a symbolic link", name)
        self.name = name


def open_dir(path: str) -> int:
    """A descriptor of the directory ``path`` (the caller's own path: links in it are followed)."""
    return os.open(path, DIR_FLAGS)


@contextmanager
def opened_dir(path: str) -> Iterator[int]:
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def walk(root_fd: int, components: Sequence[str], *, create: bool = False) -> int:
    """A new descriptor of ``root/components...``, each component opened from the one before with
    ``O_NOFOLLOW`` (made first, when ``create``, if missing). A link anywhere on the way is
    :class:`SymlinkInTheWay`; a file in the way ``NotADirectoryError``; a missing one without
    ``create`` ``FileNotFoundError``."""
    fd = os.dup(root_fd)
    try:
        for name in components:
            if create:
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except NotADirectoryError:  # O_NOFOLLOW|O_DIRECTORY on a link says ENOTDIR too: tell them apart
                if _is_link(fd, name):
                    raise SymlinkInTheWay(name) from None
                raise
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SymlinkInTheWay(name) from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_nofollow(dir_fd: int | None, name: str, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """``name`` in the directory ``dir_fd`` (None: ``name`` is a path), its last component never
    followed: a link there is :class:`SymlinkInTheWay`."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkInTheWay(name) from None
        raise


def opener(dir_fd: int | None) -> Callable[[str, int], int]:
    """For ``open(name, opener=...)``: names opened in ``dir_fd``, their links never followed."""
    return lambda name, flags: open_nofollow(dir_fd, name, flags)


def fd_name(fd: int) -> str:
    """A name that opens the very file ``fd`` is open on, for a library that takes only names."""
    return f"{_FD_DIR}/{fd}"


def is_file(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in ``dir_fd`` is a regular file of its own (a link to one is not)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
