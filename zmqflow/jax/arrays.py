"""Pytree leaves as the buffers the ring works on, and results back as JAX arrays.

A CPU ``jax.Array`` is read through ``np.asarray``: a read-only view of its buffer, no copy (the
ring's fusion is the one copy a collective makes). A GPU array goes to cupy through DLPack, also
without a copy, so the ring reduces it on the device; where cupy is missing it is copied to the host.
Every dtype is checked against the wire's list before anything is sent, so a bad leaf fails on
every rank alike instead of leaving the others waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InvalidArgument
from ..wire.dtypes import WIRE_DTYPES, dtype_name

__all__ = ["Leaves", "flatten", "is_tracer", "as_buffer", "to_jax", "check_dtype", "group_by_dtype",
           "split", "fuse", "prod_of", "HAVE_CUPY"]

try:  # optional: the GPU path without a host copy
    import cupy as _cp  # type: ignore[import-not-found]
except Exception:  # pragma: no cover - depends on the machine
    _cp = None

HAVE_CUPY = _cp is not None


class Leaves:
    """A flattened pytree: its leaves, a printable path for each (for errors), and its structure."""

    def __init__(self, tree: Any):
        with_path, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in with_path]
        self.leaves = [_leaf(x) for _, x in with_path]

    def __len__(self) -> int:
        return len(self.leaves)

    def unflatten(self, values: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, list(values))

    @property
    def traced(self) -> bool:
        return any(is_tracer(x) for x in self.leaves)


def flatten(tree: Any) -> Leaves:
    return Leaves(tree)


def _leaf(x: Any) -> Any:
    """Python numbers become JAX arrays first, so they travel in the dtype JAX gives them."""
    if isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer)) or is_cupy(x):
        return x
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return jnp.asarray(x)
    raise InvalidArgument(f"pytree leaves must be arrays or numbers, got {type(x).__name__}")


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def is_cupy(x: Any) -> bool:
    return _cp is not None and isinstance(x, _cp.ndarray)


def check_dtype(what: str, path: str, dtype: Any) -> np.dtype:
    """The leaf's numpy dtype, or an InvalidArgument naming the leaf when it cannot cross the wire."""
    try:
        dt = np.dtype(dtype)
        dtype_name(dt)
    except (InvalidArgument, TypeError):
        raise InvalidArgument(
            f"{what}: leaf {path} has dtype {dtype}, which cannot cross the wire; "
            f"allowed are {', '.join(sorted(WIRE_DTYPES))}"
        ) from None
    return dt


def as_buffer(x: Any) -> Any:
    """A numpy array reading ``x``'s buffer (a cupy array stays as it is). A JAX array on a GPU is
    copied to the host once, not handed to cupy through DLPack: with jax 0.11.2 and cupy 14.2 on
    one H200, ``cupy.from_dlpack`` of a gradient crashed the process inside jax's exporter."""
    if is_cupy(x):  # pragma: no cover - GPU only
        return x
    return np.asarray(x)  # CPU: a view; GPU: one copy to the host


def to_jax(result: Any, like: Any) -> jax.Array:
    """``result`` as a JAX array placed as ``like`` was: on its sharding when it was committed to
    one, else uncommitted on the default device (a committed result would make every later eager
    op on it compile anew)."""
    out = jnp.from_dlpack(result) if is_cupy(result) else result  # cupy: GPU only
    if isinstance(like, jax.Array) and like.committed:
        return jax.device_put(out, like.sharding)
    return jax.device_put(out)


def group_by_dtype(arrays: Sequence[Any]) -> list[list[int]]:
    """Indices of the arrays, grouped by (dtype, device kind), groups in order of first appearance:
    every rank with the same tree makes the same calls in the same order."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault((str(a.dtype), is_cupy(a)), []).append(i)
    return list(groups.values())


def split(fused: Any, shapes: Sequence[tuple[int, ...]], lead: tuple[int, ...] = ()) -> list[Any]:
    """Views of a fused flat buffer (or of each row of a stacked one, ``lead`` its leading shape)
    cut back into arrays of ``shapes``."""
    out = []
    start = 0
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(fused[..., start:start + n].reshape((*lead, *shape)))
        start += n
    return out


def fuse(arrays: Sequence[Any]) -> Any:
    """One flat, writable buffer holding ``arrays`` one after another (the collective's one copy)."""
    xp = _cp if is_cupy(arrays[0]) else np
    return xp.concatenate([a.reshape(-1) for a in arrays])


def prod_of(stacked: Any) -> Any:
    """The product over a gathered buffer's rank axis, in rank order, in its own dtype."""
    xp = _cp if is_cupy(stacked) else np
    return xp.prod(stacked, axis=0, dtype=stacked.dtype)

