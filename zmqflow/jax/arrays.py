"""Pytree leaves as the buffers the ring works on, and results back as JAX arrays.

A CPU ``jax.Array`` is read through ``np.asarray``: a read-only view of its buffer, no copy (the
ring's fusion is the one copy a collective makes). A GPU array goes to cupy through DLPack, also
without a copy, so the ring reduces it on the device; where cupy is missing it is copied to the host.
Every dtype is checked against the wire's list before anything is sent, so a bad leaf fails on
every rank alike instead of leaving the others waiting. A 64-bit leaf travels as it is; what comes
back takes the dtype JAX gives it (``jnp.asarray``'s: 32 bits while ``jax_enable_x64`` is off) only
when that loses nothing, else an ``InvalidArgument``: every rank gets the same bytes back, so every
rank refuses alike, where a silent narrowing would wrap 2**40 to 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import InvalidArgument
from ..wire.dtypes import WIRE_DTYPES, dtype_name

__all__ = ["Leaves", "flatten", "is_tracer", "as_buffer", "to_jax", "narrow", "check_dtype", "group_by_dtype",
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
        self.leaves = [_leaf(path, x) for path, (_, x) in zip(self.paths, with_path)]

    def __len__(self) -> int:
        return len(self.leaves)

    def unflatten(self, values: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, list(values))

    @property
    def traced(self) -> bool:
        return any(is_tracer(x) for x in self.leaves)


def flatten(tree: Any) -> Leaves:
    return Leaves(tree)


def _leaf(path: str, x: Any) -> Any:
    """Python numbers become JAX arrays first, so they travel in the (weak) dtype JAX gives them;
    a numpy scalar keeps its own dtype, as a numpy array does, and is narrowed on the way back."""
    if isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer)) or is_cupy(x):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, (bool, int, float, complex)):
        try:
            return jnp.asarray(x)
        except OverflowError as exc:
            raise InvalidArgument(f"leaf {path}: {exc}; {_X64}, or pass it as a numpy int64") from None
    raise InvalidArgument(f"pytree leaves must be arrays or numbers, got {type(x).__name__}")


_X64 = "enable 64-bit values with jax.config.update('jax_enable_x64', True) before the first JAX call"


def narrow(what: str, subject: str, value: Any, instead: str = "cast the leaf to a dtype that holds its values") -> Any:
    """``value`` (numpy or cupy) in the dtype JAX's config gives it, or an InvalidArgument naming
    ``subject`` when that cast would change a value (int64 2**40 to int32 0, float64 0.1 to float32):
    JAX would narrow it silently, and corrupted numbers are worse than an error."""
    dt = value.dtype
    canon = np.dtype(jax.dtypes.canonicalize_dtype(dt))
    if canon == dt:
        return value
    xp = _cp if is_cupy(value) else np
    cast = value.astype(canon)
    if not bool(xp.array_equal(cast.astype(dt), value, equal_nan=dt.kind in "fc")):
        raise InvalidArgument(f"{what}: {subject} of dtype {dt} cannot be represented exactly in {canon}, JAX's "
                              f"dtype for {dt} while jax_enable_x64 is off; {_X64}, or {instead}")
    return cast


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


def to_jax(what: str, path: str, result: Any, like: Any, stacked: bool = False) -> jax.Array:
    """``result`` (narrowed: see :func:`narrow`) as a JAX array placed as ``like`` was: on its
    sharding when it was committed to one (``stacked``: with a new leading rank axis, unsharded),
    else uncommitted on the default device (a committed result would make every later eager op on
    it compile anew)."""
    result = narrow(what, f"leaf {path}", result)
    out = jnp.from_dlpack(result) if is_cupy(result) else result  # cupy: GPU only
    if isinstance(like, jax.Array) and like.committed:
        return jax.device_put(out, _stacked(like.sharding) if stacked else like.sharding)
    return jax.device_put(out)


def _stacked(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The placement of a leaf that gained a leading axis: the leaf's own layout behind an
    unsharded new axis (the leaf's sharding would split that axis of ``size`` rows instead)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec), memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:  # one device, or a copy on each: fits any shape
        return sharding
    devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))  # another kind: a copy on each device
    return NamedSharding(Mesh(devices, ("devices",)), PartitionSpec(), memory_kind=sharding.memory_kind)


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

