"""What a shard writes into a checkpoint, and how it is written: sans-IO but for the file.

A shard's checkpoint file is one safetensors file (:mod:`zmqflow.state.tensorfile`: readable by
any safetensors reader, memory-mapped on restore; nothing in it can execute code). Tensors are
named for people and other tools: a variable held whole is ``name``, a part of one
``name/part_3``; its optimizer slots ``name/slot/m``, per-row step counts ``name/steps`` (kept
only under an optimizer that reads them), a sync step ``name/sync_step``; a dynamic table part
``name/part_0/ids``, ``/values``, ``/slot/m``, ``/steps`` (the same), ``/changed`` (the step each
row last changed) and its admission state ``/pending_ids``, ``/pending_counts``. The file's
``__metadata__`` holds ``format`` and ``entries`` (JSON: each part and table, its rows and
tensor prefix), so a file describes itself without its manifest. Slots are written in the dtype
they are held in: float32 for a float16 or bfloat16 variable or table (``optim.slot_dtype``); files
written when such slots were kept in the variable's own dtype restore too, widened to float32.

Files are written to a temporary name in the same directory, flushed and fsynced, then renamed
over the final name, and the directory is fsynced: a crash at any moment leaves either the old
file or the new one. Checkpoints of format 1 (one ``.npz`` per shard, keys ``p0.value``) are
still read (:class:`NpzFile`, ``allow_pickle=False``).
"""

from __future__ import annotations

import errno
import math
import os
import re
import socket
import threading
import time
from typing import Any

import numpy as np

from ..errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from .dirfd import NAME_MAX, SymlinkInTheWay, open_nofollow
from .tables import HashTable
from .tensorfile import Chunked, TensorFile, write_tensors
from .store import Part

__all__ = ["part_arrays", "table_arrays", "write_atomic", "temp_path", "check_file_name", "NAME_MAX", "read_arrays",
           "fsync_dir", "crash_point", "TEMP_SUFFIX",
           "abandoned_temporary", "part_prefix", "table_prefix", "tensor_name", "NpzFile", "open_shard_file", "FILE_FORMAT", "entry_tensor"]

FILE_FORMAT = "zmqflow-checkpoint/2"

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


def part_prefix(p: Part, name: str, part: int) -> str:
    """``name`` for a variable held whole, ``name/part_N`` for a part of one."""
    whole = not p.full_shape or tuple(p.rows) == (0, p.full_shape[0])
    return name if whole and part == 0 else f"{name}/part_{part}"


def table_prefix(name: str, part: int) -> str:
    return f"{name}/part_{part}"


def tensor_name(prefix: str, field: str, kind: str = "part") -> str:
    """The tensor holding ``field`` (``value``, ``slot.m``, ``steps``, ...) of an entry."""
    if field == "value":
        return prefix if kind == "part" else f"{prefix}/values"
    return f"{prefix}/{field.replace('.', '/')}"


def part_arrays(p: Part, key: str) -> dict[str, np.ndarray]:
    out = {tensor_name(key, "value"): p.value}
    for name, slot in p.slots.items():
        out[tensor_name(key, f"slot.{name}")] = slot
    if p.steps is not None:
        out[tensor_name(key, "steps")] = p.steps
    if p.sync is not None:
        out[tensor_name(key, "sync_step")] = np.array(p.sync.step, np.int64)
    return out


def table_arrays(t: HashTable, key: str) -> dict[str, "np.ndarray | Chunked"]:
    """A table part's rows, ids ascending, each field gathered a block of rows at a time as it is
    written (:class:`Chunked`): a save holds the order of the rows, not a copy of them. To be
    written before the table changes (a save writes without yielding)."""
    live = t.live_slots()
    live = live[np.argsort(t.ids[live], kind="stable")]

    def rows(a: np.ndarray) -> Chunked:
        return Chunked(a.dtype, (len(live), *a.shape[1:]), lambda start, stop: a[live[start:stop]])

    out: dict[str, np.ndarray | Chunked] = {tensor_name(key, f, "table"): rows(a) for f, a in (
        ("ids", t.ids), ("value", t.values), ("changed", t.updated_step))}
    if t.steps is not None:
        out[tensor_name(key, "steps", "table")] = rows(t.steps)
    for name, slot in t.slots.items():
        out[tensor_name(key, f"slot.{name}", "table")] = rows(slot)
    pending_ids, pending_counts = t.sightings.items()
    out[tensor_name(key, "pending_ids", "table")] = pending_ids
    out[tensor_name(key, "pending_counts", "table")] = pending_counts
    return out


def fsync_dir(directory: str | int) -> None:
    """Make a rename in ``directory`` (a path, or a descriptor of it) durable; best effort."""
    if isinstance(directory, int):
        try:
            os.fsync(directory)
        except OSError:
            pass
        return
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


def temp_path(path: str) -> str:
    """Where :func:`write_atomic` writes ``path`` first, from this thread: two writers (threads
    too) never share one."""
    return f"{path}.tmp-{_HOST}-{os.getpid()}-{threading.get_ident()}"


def check_file_name(file: str) -> None:
    """InvalidArgument for a file name whose temporary (:func:`temp_path`) would be over the
    255 bytes a name may have: refused before anything is written, not an OSError halfway."""
    longest = len(os.fsencode(temp_path(file)))
    if longest > NAME_MAX:
        raise InvalidArgument(f"file name {file[:40]!r}... is {len(os.fsencode(file))} bytes: with its temporary's "
                              f"suffix it would be {longest}, over the {NAME_MAX} a name may have", file=file)


def write_atomic(path: str, arrays: "dict[str, np.ndarray | Chunked] | None" = None, text: str | None = None,
                 metadata: dict[str, str] | None = None, *, dir_fd: int | None = None) -> None:
    """Write ``arrays`` (as safetensors, with ``metadata``) or ``text`` to ``path`` so that a
    crash leaves the old or the new file. With ``dir_fd`` (a descriptor of ``path``'s directory),
    the file is reached through it by its last name, never by the path: a directory swapped for a
    link after it was opened is not written through."""
    name = os.path.basename(path) if dir_fd is not None else path
    tmp = temp_path(name)
    try:
        # never through a link planted at the temporary's name: the file is ours, created here
        fd = open_nofollow(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with os.fdopen(fd, "wb") as fh:
                if arrays is not None:
                    write_tensors(fh, arrays, metadata)
                else:
                    fh.write((text or "").encode())
                fh.flush()
                crash_point("mid-write")
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:  # a failed write leaves no temporary behind (a crash does: pruning's)
            try:
                os.remove(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        fsync_dir(os.path.dirname(os.path.abspath(path)) if dir_fd is None else dir_fd)
    except OSError as exc:
        typed = _typed(exc, path)
        if typed is None:
            raise
        raise typed from exc


def _typed(exc: OSError, path: str) -> Exception | None:
    """What a failed write tells the caller: no room, or no right to write there (None: the
    OSError as it is)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ResourceExhausted(f"cannot write {path!r}: {exc.strerror}", file=path)
    if isinstance(exc, SymlinkInTheWay):
        return PermissionDenied(f"cannot write {path!r}: a symbolic link is in the way at {exc.name!r}", file=path)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"cannot write {path!r}: {exc.strerror}", file=path)
    return None


# The most one array of a format-1 file may hold, as its header declares it (a variable's limit).
MAX_NPZ_ARRAY_BYTES = 256 << 30


def read_arrays(path: str, dir_fd: int | None = None) -> dict[str, np.ndarray]:
    """Every array of a format-1 ``.npz`` file (with ``dir_fd``: ``path``'s last name in it, not
    followed when it is a link), each header checked first (:class:`NpzFile`)."""
    f = NpzFile(path, dir_fd)
    try:
        return {k: f.read(k) for k in f.keys()}
    finally:
        f.close()


class NpzFile:
    """A format-1 shard file seen as a :class:`TensorFile` (keys ``p0.value``, ``t1.slot.m``),
    so restore and inspect read old checkpoints too. Opening reads each member's ``.npy`` header
    alone, and refuses (``InvalidArgument`` naming the file) an array whose header disagrees with
    the bytes its member holds, or that declares more than ``MAX_NPZ_ARRAY_BYTES``: what a
    header claims is never allocated before it is checked. An array is read (whole: npz cannot
    be mapped) when asked for."""

    def __init__(self, path: str, dir_fd: int | None = None):
        import zipfile  # here, not at the top: only old checkpoints need it, and it brings bz2, lzma and shutil

        self.path = path
        self.metadata: dict[str, str] = {"format": "zmqflow-checkpoint/1 (npz)"}
        fh = None
        try:
            fd = os.open(path, os.O_RDONLY) if dir_fd is None else open_nofollow(dir_fd, os.path.basename(path))
            fh = self._fh = os.fdopen(fd, "rb")
            self.size = os.fstat(fd).st_size
            self._zip = zipfile.ZipFile(fh)
            self._members = {info.filename[: -len(".npy")]: info for info in self._zip.infolist()
                             if info.filename.endswith(".npy")}
            self._headers = {k: self._header(k, info) for k, info in self._members.items()}
        except FileNotFoundError:
            raise NotFound(f"checkpoint file {path!r} does not exist", file=path) from None
        except SymlinkInTheWay:
            raise InvalidArgument(f"checkpoint file {path!r} is a symbolic link: a checkpoint's files are read only "
                                  f"as files of its own directory", file=path) from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            if fh is not None:
                fh.close()
            raise InvalidArgument(f"cannot read checkpoint file {path!r}: {exc}", file=path) from None

    def _header(self, key: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, bool]:
        """(dtype, shape, the offset of the data in its member, whether in Fortran order), the
        bytes declared checked against the bytes the member holds and the cap (``ValueError``
        naming the array)."""
        from numpy.lib import format as npy

        with self._zip.open(info) as member:
            version = npy.read_magic(member)
            read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, fortran, dtype = read(member)
            offset = member.tell()
        if dtype.hasobject:
            raise ValueError(f"array {key!r} is of objects")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_NPZ_ARRAY_BYTES:
            raise ValueError(f"array {key!r} declares {nbytes} bytes, over the {MAX_NPZ_ARRAY_BYTES} an array may hold")
        if nbytes != info.file_size - offset:
            raise ValueError(f"array {key!r} declares {list(shape)} of {dtype.name} ({nbytes} bytes), but its member "
                             f"holds {info.file_size - offset}")
        return dtype, tuple(shape), offset, bool(fortran)

    def keys(self) -> list[str]:
        return sorted(self._headers)

    def __contains__(self, name: object) -> bool:
        return name in self._headers

    def _described(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, bool]:
        try:
            return self._headers[name]
        except KeyError:
            raise NotFound(f"checkpoint file {self.path!r} holds no array {name!r}", file=self.path) from None

    def dtype(self, name: str) -> str:
        return self._described(name)[0].name

    def shape(self, name: str) -> tuple[int, ...]:
        return self._described(name)[1]

    def nbytes(self, name: str) -> int:
        dtype, shape, _, _ = self._described(name)
        return math.prod(shape) * dtype.itemsize

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """The array (its size checked when the file was opened), or its rows ``[start, stop)``."""
        dtype, shape, offset, fortran = self._described(name)
        arr = np.empty(shape[::-1] if fortran else shape, dtype)
        try:
            with self._zip.open(self._members[name]) as member:
                member.seek(offset)
                view = memoryview(arr.reshape(-1).view(np.uint8))
                got = 0
                while got < len(view):
                    n = member.readinto(view[got:])
                    if not n:
                        raise EOFError(f"array {name!r} ends after {got} of {len(view)} bytes")
                    got += n
        except (OSError, ValueError, EOFError) as exc:
            raise InvalidArgument(f"cannot read checkpoint file {self.path!r}: {exc}", file=self.path) from None
        arr = arr.T if fortran else arr
        return arr if start is None and stop is None else arr[start:stop]

    def close(self) -> None:
        self._zip.close()
        self._fh.close()


def open_shard_file(path: str, dir_fd: int | None = None) -> "TensorFile | NpzFile":
    """A shard file of either format, its header checked (a truncated file fails here). With
    ``dir_fd``, ``path``'s last name is opened in that directory and never followed if a link."""
    return NpzFile(path, dir_fd) if path.endswith(".npz") else TensorFile(path, dir_fd)


_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def abandoned_temporary(path: str, dir_fd: int | None = None) -> bool:
    """Whether ``path`` (with ``dir_fd``: a name in that directory) is a temporary whose writer is
    gone: on this host, its process no longer exists; on another, it has not been touched for
    ``FOREIGN_TEMP_GRACE_S``. Not a temporary: False."""
    m = _TEMP.search(os.path.basename(path))
    if m is None:
        return False
    if m["host"] != _HOST:
        try:
            mtime = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mtime
            return time.time() - mtime > FOREIGN_TEMP_GRACE_S
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


def entry_tensor(f: "TensorFile | NpzFile", entry: dict, field: str) -> str:
    """The tensor of ``f`` holding ``field`` of a manifest ``entry`` (either format's names)."""
    if isinstance(f, NpzFile):
        return f"{entry['key']}.{field}"
    return tensor_name(entry["key"], field, entry["kind"])
