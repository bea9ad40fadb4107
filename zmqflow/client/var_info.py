"""What a client knows of a variable (its catalog record, checked), and the arrays a read fills.

A record's parts must cover the variable's rows in order, as the catalog makes them: a read
assembles the variable from its parts' rows, so a gap would leave memory no shard ever wrote.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cluster import TaskId
from ..errors import InvalidArgument, VariableConflict
from ..state.catalog import check_tiling
from ..state.kernels import copy_into
from ..wire.dtypes import dtype_from_name

__all__ = ["SLICE_BYTES", "ITEMS_PER_REQUEST", "VarInfo", "rows_of", "landed", "check_out", "check_apart",
           "checked_outs", "runs_of_parts"]

SLICE_BYTES = 4 << 20
# Items in one request, each a tensor of it or of its answer: well under what a peer reads of one
# message (``wire.Limits.max_frames``, 4096 frames, a big tensor taking one and small ones sharing
# pack frames; 65536 tensors a table), so that a model of thousands of small variables goes to a
# shard in several requests, not in one that shard (or its answer, this client) refuses.
ITEMS_PER_REQUEST = 1024


@dataclass(frozen=True, eq=False)
class VarInfo:
    """What the catalog says about a variable."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    parts: tuple[tuple[TaskId, int, int], ...]  # (task, first row, end row)
    optimizer: Any
    initializer: Any

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "VarInfo":
        """The record's variable; InvalidArgument when its parts do not cover its rows in order."""
        shape = tuple(r["shape"])
        rows = [p["rows"] for p in r["parts"]]
        if r.get("table") is None:  # a table's parts count their rows each from 0
            check_tiling(r["name"], rows, shape[0] if shape else 1)
        return cls(
            r["name"],
            shape,
            dtype_from_name(r["dtype"]),
            tuple((TaskId.parse(p["task"]), p["rows"][0], p["rows"][1]) for p in r["parts"]),
            r.get("optimizer"),
            r.get("initializer"),
        )

    # computed once (the fields are frozen): every push, pull and step asks again
    @functools.cached_property
    def sync(self) -> bool:
        return isinstance(self.optimizer, dict) and self.optimizer.get("kind") == "sync_replicas"

    @functools.cached_property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def part_bytes(self, part: int) -> int:
        """The bytes of one part's rows (a scalar's one element)."""
        _, r0, r1 = self.parts[part]
        return (r1 - r0) * self.row_bytes if self.shape else self.row_bytes

    def chunks(self, part: int) -> list[tuple[int | None, int | None]]:
        """Part-local row ranges of at most SLICE_BYTES (one row at least); scalars are one chunk.
        Computed once per part: every read, write and push of the variable asks again."""
        cache = self.__dict__.setdefault("_chunks", {})  # frozen: the cache is no field
        got = cache.get(part)
        if got is None:
            got = cache[part] = self._chunks_of(part)
        return got

    def _chunks_of(self, part: int) -> list[tuple[int | None, int | None]]:
        if not self.shape:
            return [(None, None)]
        _, r0, r1 = self.parts[part]
        per = max(1, SLICE_BYTES // max(1, self.row_bytes))
        return [(a, min(a + per, r1 - r0)) for a in range(0, r1 - r0, per)] or [(0, 0)]

    def describe(self) -> list[dict[str, Any]]:
        return [{"task": str(t), "rows": [a, b]} for t, a, b in self.parts]


def runs_of_parts(items: list[Any], cap: int = ITEMS_PER_REQUEST) -> list[list[Any]]:
    """``items`` (each naming its ``name`` and ``part``, a part's items together) in runs of
    about ``cap``, cut only between parts: a synchronous part's gradient is one replica's
    contribution, and must come in one request (a second would count as a duplicate)."""
    runs: list[list[Any]] = [[]]
    for item in items:
        last = runs[-1]
        if len(last) >= cap and (item.name, item.part) != (last[-1].name, last[-1].part):
            runs.append(last := [])
        last.append(item)
    return runs


def rows_of(info: VarInfo, part: int, chunk: tuple[int | None, int | None], x: np.ndarray) -> np.ndarray:
    """The slice of a full-shape array ``x`` for one chunk of one part (a view, no copy)."""
    if not info.shape:
        return x
    _, r0, _ = info.parts[part]
    return x[r0 + chunk[0]: r0 + chunk[1]]


def landed(info: VarInfo, part: int, chunk: tuple[int | None, int | None], target: np.ndarray | None,
           arr: np.ndarray, task: TaskId) -> None:
    """Check a reply's rows of one chunk of one part against what this client knows of the
    variable, and copy them into ``target``'s rows where there is a target (None: ``arr`` is the
    whole variable). VariableConflict where the part has changed since the client learned of it."""
    dst = None if target is None else rows_of(info, part, chunk, target)
    if arr.dtype != info.dtype or arr.shape != (info.shape if dst is None else dst.shape):
        raise VariableConflict(
            f"variable {info.name!r} (part {part}) on {task} is now {list(arr.shape)} {arr.dtype} where this "
            f"session expects {list(info.shape if dst is None else dst.shape)} {info.dtype}: the part "
            "changed since the session learned of it; get the variable again", name=info.name)
    if dst is not None:
        copy_into(dst, arr)


def check_out(info: VarInfo, out: Any) -> np.ndarray:
    """``out`` as the buffer a read of ``info`` fills: a writeable C-contiguous array of the
    variable's shape and dtype (checked before any request is sent, so a bad one changes nothing)."""
    if not isinstance(out, np.ndarray):
        raise InvalidArgument(f"out= for {info.name!r}: expected a numpy array, got {type(out).__name__}")
    if out.shape != info.shape or out.dtype != info.dtype:
        raise InvalidArgument(f"out= for {info.name!r}: expected shape {list(info.shape)} {info.dtype}, "
                              f"got {list(out.shape)} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgument(f"out= for {info.name!r}: the array must be writeable and C-contiguous")
    return out


_at, _address = ctypes.c_char.from_buffer, ctypes.addressof


def check_apart(outs: Mapping[str, np.ndarray]) -> None:
    """InvalidArgument naming two ``out=`` arrays that share memory: each would be filled over the
    other. The arrays are C-contiguous and writeable (``check_out``), so each spans exactly its
    byte range, which ctypes reads from its buffer (a quarter of ``__array_interface__``'s cost,
    which builds a dict: a pull into 200 arrays spent more here than on its requests), and sorting
    the ranges finds any overlap in one pass."""
    spans = sorted((_address(_at(a)), a.nbytes, name) for name, a in outs.items() if a.nbytes)
    for (start, size, name), (later, _, other) in zip(spans, spans[1:]):
        if later < start + size:
            raise InvalidArgument(f"out= for {name!r} and {other!r} share memory: each needs an array of its own")


def checked_outs(infos: Iterable[VarInfo], out: Mapping[str, Any] | None, what: str) -> dict[str, np.ndarray]:
    """The ``out=`` arrays of a read of ``infos``, by name: each checked (``check_out``), none
    sharing memory with another (``check_apart``), and a name not among ``infos`` refused, naming
    it (``what`` the call does to those: "pulled", "pushed")."""
    given = out or {}
    by_name = {info.name: info for info in infos}
    extra = set(given) - set(by_name)
    if extra:
        raise InvalidArgument(f"out= names variables not {what}: {', '.join(sorted(map(str, extra)))}")
    checked = {name: check_out(by_name[name], arr) for name, arr in given.items()}
    if len(checked) > 1:
        check_apart(checked)
    return checked
