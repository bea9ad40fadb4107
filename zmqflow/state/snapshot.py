"""What a shard writes into a checkpoint, and how it is written: sans-IO but for the file.

A shard's checkpoint file is one ``.npz`` (numpy's zip of ``.npy`` arrays, read back with
``allow_pickle=False``: nothing in a checkpoint can execute code). Files are written to a
temporary name in the same directory, flushed and fsynced, then renamed over the final name, and
the directory is fsynced: a crash at any moment leaves either the old file or the new one.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time

import numpy as np

from ..errors import InvalidArgument
from .tables import HashTable
from .store import Part

__all__ = ["part_arrays", "table_arrays", "write_atomic", "read_arrays", "fsync_dir", "crash_point", "TEMP_SUFFIX",
           "abandoned_temporary"]

# ``<final name>.tmp-<host>-<pid>-<thread>``: who writes a temporary, so that a pruner can tell a
# writer still at work (another thread or process saving beside it) from one that died.
TEMP_SUFFIX = r"\.tmp-(?P<host>[A-Za-z0-9_.-]+?)-(?P<pid>\d+)-(?P<tid>\d+)"
_TEMP = re.compile(TEMP_SUFFIX + "$")
# A temporary written on another host is taken for abandoned only once it is this old.
FOREIGN_TEMP_GRACE_S = 600.0


_passes: dict[str, int] = {}


def crash_point(where: str) -> None:
    """Fault injection for tests: die like ``kill -9`` at a named point when
    ``ZMQFLOW_CHECKPOINT_CRASH`` is ``where`` (every time) or ``where:N`` (the N-th time)."""
    wanted = os.environ.get("ZMQFLOW_CHECKPOINT_CRASH")
    if not wanted:
        return
    name, _, nth = wanted.partition(":")
    if name != where:
        return
    _passes[where] = _passes.get(where, 0) + 1
    if not nth or _passes[where] == int(nth):
        os._exit(137)


def part_arrays(p: Part, key: str) -> dict[str, np.ndarray]:
    out = {f"{key}.value": p.value}
    for name, slot in p.slots.items():
        out[f"{key}.slot.{name}"] = slot
    if p.steps is not None:
        out[f"{key}.steps"] = p.steps
    if p.sync is not None:
        out[f"{key}.sync_step"] = np.array(p.sync.step, np.int64)
    return out


def table_arrays(t: HashTable, key: str) -> dict[str, np.ndarray]:
    live = t.live_slots()
    live = live[np.argsort(t.ids[live], kind="stable")]
    out = {f"{key}.ids": t.ids[live], f"{key}.value": t.values[live], f"{key}.steps": t.steps[live]}
    for name, slot in t.slots.items():
        out[f"{key}.slot.{name}"] = slot[live]
    return out


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, arrays: dict[str, np.ndarray] | None = None, text: str | None = None) -> None:
    """Write ``arrays`` (as npz) or ``text`` to ``path`` so that a crash leaves the old or the new file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{_HOST}-{os.getpid()}-{threading.get_ident()}"  # two writers (threads too) never share one
    # never through a link planted at the temporary's name: the file is ours, created here
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(fd, "wb") as fh:
        if arrays is not None:
            np.savez(fh, **arrays)
        else:
            fh.write((text or "").encode())
        fh.flush()
        crash_point("mid-write")
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


def read_arrays(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read checkpoint file {path!r}: {exc}") from None


_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def abandoned_temporary(path: str) -> bool:
    """Whether ``path`` is a temporary whose writer is gone: on this host, its process no longer
    exists; on another, it has not been touched for ``FOREIGN_TEMP_GRACE_S``. Not a temporary: False."""
    m = _TEMP.search(os.path.basename(path))
    if m is None:
        return False
    if m["host"] != _HOST:
        try:
            return time.time() - os.path.getmtime(path) > FOREIGN_TEMP_GRACE_S
        except FileNotFoundError:
            return False
    pid = int(m["pid"])
    if pid == os.getpid():
        return False  # this process's own writers finish or fail by themselves
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, someone else's
    return False
