"""Checkpoint files in the safetensors format: written streaming, read through memory mappings.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian header length,
a JSON header (each tensor's dtype, shape and byte range; a ``__metadata__`` map of strings), then
the raw little-endian bytes. Any safetensors reader (``safetensors.safe_open``, torch's
``load_file``, the Rust crate) reads our files.

Writing: ``safetensors.numpy.save`` builds the whole file as one ``bytes`` first, which would
double a shard's memory during a save; the format is simple enough to stream each array's own
buffer into the file instead (:func:`write_tensors`). Reading: ``safe_open(framework="numpy")``
maps the file and hands out row slices (:meth:`TensorFile.read`), so restoring a big variable
reads its part and nothing else.

Dtypes: every dtype the wire carries has a safetensors dtype (``bfloat16`` is ``BF16``), except
``complex128``: it is stored as ``F64`` with a trailing axis of 2 (real, imaginary) and the
metadata key ``dtype:<tensor>`` says ``complex128``; :meth:`TensorFile.read` gives the complex
array back.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import numpy as np

from ..errors import InvalidArgument, NotFound
from .dirfd import SymlinkInTheWay, fd_name, open_nofollow

__all__ = ["ST_DTYPES", "write_tensors", "TensorFile", "storable", "Chunked"]

# numpy dtype name -> safetensors dtype
ST_DTYPES: dict[str, str] = {
    "bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32", "uint32": "U32",
    "int64": "I64", "uint64": "U64", "float16": "F16", "float32": "F32", "float64": "F64", "complex64": "C64",
    "bfloat16": "BF16",
}
# stored as another dtype with a trailing axis: name -> (stored dtype)
_VIEWED = {"complex128": np.dtype("<f8")}
_ALIGN = 8


def storable(name: str, arr: np.ndarray) -> tuple[np.ndarray, str, str | None]:
    """(little-endian C-contiguous array to write, its safetensors dtype, the original dtype name
    when it is stored as another). Refuses a dtype without a mapping, naming the tensor."""
    dt = arr.dtype
    key = dt.name if dt.byteorder in "=|<" else dt.newbyteorder("<").name
    if key in _VIEWED:
        stored = _contiguous(arr.astype(dt.newbyteorder("<"), copy=False)).reshape(-1).view(_VIEWED[key])
        return stored.reshape(*arr.shape, 2), ST_DTYPES[_VIEWED[key].name], key
    st = ST_DTYPES.get(key)
    if st is None:
        raise InvalidArgument(f"tensor {name!r}: dtype {dt} has no safetensors dtype "
                              f"(supported: {', '.join(sorted([*ST_DTYPES, *_VIEWED]))})")
    if dt.byteorder == ">":
        arr = arr.astype(dt.newbyteorder("<"))
    return _contiguous(arr), st, None


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """C-contiguous, 0-d arrays kept 0-d (``np.ascontiguousarray`` makes them 1-d)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


class Chunked:
    """A tensor of ``shape`` and ``dtype`` written a block of rows at a time: ``take(start, stop)``
    gives rows ``[start, stop)`` (a gather from scattered rows, say), so a writer holds one block
    of about ``CHUNK_BYTES``, never a second copy of the whole tensor."""

    CHUNK_BYTES = 4 << 20

    def __init__(self, dtype: Any, shape: tuple[int, ...], take: Callable[[int, int], np.ndarray]):
        self.dtype, self.shape, self.take = np.dtype(dtype), tuple(shape), take

    def blocks(self) -> Iterator[np.ndarray]:
        """The rows in order, a block at a time."""
        rows = self.shape[0] if self.shape else 1
        row_bytes = max(1, math.prod(self.shape[1:]) * self.dtype.itemsize)
        step = max(1, self.CHUNK_BYTES // row_bytes)
        for start in range(0, rows, step):
            yield self.take(start, min(rows, start + step))


def write_tensors(fh: IO[bytes], tensors: Mapping[str, "np.ndarray | Chunked"],
                  metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` to ``fh`` as one safetensors file, each array streamed from its own
    buffer, a :class:`Chunked` one a block at a time (no copy of the whole file in memory).
    Returns the bytes written."""
    meta = dict(metadata or {})
    header: dict[str, Any] = {}
    arrays: list[tuple[str, np.ndarray | Chunked]] = []
    offset = 0
    for name in sorted(tensors):
        if name == "__metadata__":
            raise InvalidArgument("a tensor may not be named '__metadata__'")
        given = tensors[name]
        if isinstance(given, Chunked):  # its stored dtype and shape, from no rows of it
            empty, st, original = storable(name, np.empty((0, *given.shape[1:]), given.dtype))
            arr: np.ndarray | Chunked = given
            shape = [given.shape[0], *empty.shape[1:]]
            nbytes = math.prod(shape) * empty.dtype.itemsize
        else:
            arr, st, original = storable(name, np.asarray(given))
            shape, nbytes = list(arr.shape), arr.nbytes
        if original is not None:
            meta[f"dtype:{name}"] = original
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append((name, arr))
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument(f"safetensors metadata maps strings to strings: {k!r} -> {type(v).__name__}")
    if meta:
        header = {"__metadata__": meta, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    for name, arr in arrays:
        for block in arr.blocks() if isinstance(arr, Chunked) else [arr]:
            if isinstance(arr, Chunked):
                block = storable(name, np.asarray(block, arr.dtype))[0]
            if block.nbytes:
                fh.write(memoryview(block.reshape(-1).view(np.uint8)))  # bytes: a buffer of any dtype (bfloat16 too)
    return 8 + len(raw) + offset


class TensorFile:
    """A safetensors file opened for reading: its tensors' dtypes and shapes from the header,
    their data through ``safe_open``'s memory mapping. A missing file is ``NotFound``; a file that
    is not safetensors, or is truncated, is ``InvalidArgument`` naming it. With ``dir_fd`` (a
    descriptor of ``path``'s directory) the file is ``path``'s last name in it, opened once with
    ``O_NOFOLLOW`` (a link there is refused), and the header and mapping come from that one open
    file, never from the name again."""

    def __init__(self, path: str, dir_fd: int | None = None):
        from safetensors import SafetensorError, safe_open

        self.path = path
        self._error = SafetensorError
        fd = -1
        try:
            fd = open_nofollow(dir_fd, os.path.basename(path)) if dir_fd is not None else os.open(path, os.O_RDONLY)
            self.size = os.fstat(fd).st_size
            self._file = safe_open(fd_name(fd), framework="numpy")  # maps the file open on fd, header checked
            self._header = self._read_header(fd)
        except FileNotFoundError:
            raise NotFound(f"checkpoint file {path!r} does not exist", file=path) from None
        except SymlinkInTheWay:
            raise InvalidArgument(f"checkpoint file {path!r} is a symbolic link: a checkpoint's files are read "
                                  f"only as files of its own directory", file=path) from None
        except (OSError, ValueError, struct.error, SafetensorError) as exc:
            raise InvalidArgument(f"checkpoint file {path!r} is not a readable safetensors file "
                                  f"(corrupt or truncated?): {exc}", file=path) from None
        finally:
            if fd >= 0:
                os.close(fd)
        self.metadata: dict[str, str] = dict(self._header.pop("__metadata__", None) or {})

    @staticmethod
    def _read_header(fd: int) -> dict[str, Any]:
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, n, 8))
        if not isinstance(header, dict):
            raise ValueError("its header is not a map")
        return header

    def keys(self) -> list[str]:
        return sorted(self._header)

    def __contains__(self, name: object) -> bool:
        return name in self._header

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def dtype(self, name: str) -> str:
        """The tensor's dtype as numpy names it (``complex128`` for one stored as F64 pairs)."""
        original = self.metadata.get(f"dtype:{name}")
        if original:
            return original
        st = self._entry(name)["dtype"]
        return next((k for k, v in ST_DTYPES.items() if v == st), st)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._entry(name)["shape"])
        return shape[:-1] if self.metadata.get(f"dtype:{name}") in _VIEWED else shape

    def nbytes(self, name: str) -> int:
        begin, end = self._entry(name)["data_offsets"]
        return int(end - begin)

    def _entry(self, name: str) -> dict[str, Any]:
        try:
            return self._header[name]
        except KeyError:
            raise NotFound(f"checkpoint file {self.path!r} holds no tensor {name!r}", file=self.path) from None

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """The tensor, or its rows ``[start, stop)``: a slice read through the file's mapping
        (``safe_open``'s ``get_slice``), not the whole tensor."""
        entry = self._entry(name)
        shape = entry["shape"]
        try:
            if start is None and stop is None or not shape or 0 in shape:
                arr = self._file.get_tensor(name)
            else:
                arr = self._file.get_slice(name)[slice(start, stop)]
        except self._error as exc:
            raise InvalidArgument(f"checkpoint file {self.path!r}: cannot read {name!r}: {exc}", file=self.path) from None
        original = self.metadata.get(f"dtype:{name}")
        if original in _VIEWED:
            return _contiguous(arr).view(np.dtype(original).newbyteorder("<"))[..., 0]
        want = self.dtype(name)
        if want == "bfloat16" and arr.dtype.name != "bfloat16":
            import ml_dtypes  # type: ignore[import-not-found]

            arr = _contiguous(arr).view(ml_dtypes.bfloat16)
        return arr

    def close(self) -> None:
        self._file = None

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
