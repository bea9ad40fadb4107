"""Torch tensors as the arrays the ring reduces, without copies where torch allows it.

A contiguous CPU tensor is read as a numpy view (``t.detach().numpy()``), so the ring reads it in
place; bfloat16, which numpy lacks, is viewed as int16 and reinterpreted as ``ml_dtypes.bfloat16``
(the wire's own bfloat16). A CUDA tensor goes through DLPack to cupy, so the ring's cupy backend
(``state/reduce.py``) reduces it on the GPU. Results come back the same ways: ``from_array`` wraps
a numpy or cupy result as a tensor without copying, and ``write_into`` copies it into a tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgument
from ..wire.dtypes import WIRE_DTYPES, dtype_name

__all__ = ["to_array", "from_array", "write_into", "check_dtype", "cuda_ready", "HAVE_CUPY"]

try:  # optional: CUDA tensors are reduced by the ring's cupy backend
    import cupy as _cp  # type: ignore[import-not-found]

    HAVE_CUPY = True
except Exception:  # pragma: no cover - depends on the machine
    _cp = None
    HAVE_CUPY = False

_BF16 = WIRE_DTYPES.get("bfloat16")  # present where ml_dtypes is installed


def check_dtype(t: torch.Tensor, what: str = "tensor") -> None:
    """Refuse, before anything moves, a dtype that cannot cross the wire (naming ``what``)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InvalidArgument(f"{what}: only dense (strided) tensors are supported, got layout {t.layout}")
    if t.dtype == torch.bfloat16:
        if _BF16 is None:
            raise InvalidArgument(f"{what}: bfloat16 needs the ml_dtypes package, which is not installed")
        return
    try:
        np_dtype = torch.empty((), dtype=t.dtype).numpy().dtype
        dtype_name(np_dtype)
    except (TypeError, InvalidArgument):
        allowed = ", ".join(sorted(WIRE_DTYPES))
        raise InvalidArgument(f"{what}: dtype {t.dtype} cannot be sent; allowed are {allowed}") from None


def cuda_ready(t: torch.Tensor) -> None:
    """Make the work queued on ``t``'s CUDA stream visible to cupy's stream (a no-op on the CPU)."""
    if t.is_cuda:  # pragma: no cover - GPU only
        torch.cuda.current_stream(t.device).synchronize()


def to_array(t: torch.Tensor, what: str = "tensor") -> Any:
    """A numpy view (CPU) or cupy view (CUDA) of the contiguous tensor ``t``: no copy."""
    check_dtype(t, what)
    if not t.is_contiguous():
        raise InvalidArgument(f"{what}: expected a contiguous tensor (call .contiguous() first)")
    t = t.detach()
    if t.is_cuda:  # pragma: no cover - GPU only
        if _cp is None:
            raise InvalidArgument(f"{what}: CUDA tensors need cupy (pip install cupy-cuda12x) to be reduced on the GPU")
        cuda_ready(t)
        if t.dtype == torch.bfloat16:
            return _cp.from_dlpack(t.view(torch.int16)).view(_BF16)
        return _cp.from_dlpack(t)
    if t.device.type != "cpu":
        raise InvalidArgument(f"{what}: tensors on {t.device.type} are not supported (CPU and CUDA are)")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def from_array(a: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """The numpy or cupy array ``a`` as a tensor, without copying (on ``like``'s device when given)."""
    bf16 = _BF16 is not None and a.dtype == _BF16
    if _cp is not None and isinstance(a, _cp.ndarray):  # pragma: no cover - GPU only
        out = torch.from_dlpack(a.view(np.int16) if bf16 else a)
    else:
        a = np.ascontiguousarray(a)
        out = torch.from_numpy(a.view(np.int16) if bf16 else a)
    if bf16:
        out = out.view(torch.bfloat16)
    if like is not None and out.device != like.device:
        out = out.to(like.device)
    return out


def write_into(target: torch.Tensor, a: Any) -> torch.Tensor:
    """Copy ``a`` (an array or tensor of as many elements) into ``target`` in place; returns ``target``."""
    source = a if isinstance(a, torch.Tensor) else from_array(a, target)
    with torch.no_grad():
        target.copy_(source.view(target.shape))
    return target
