"""The dtypes that may cross the wire, by name.

Names (``"float32"``), not numpy's byte-order strings, travel in headers so that any reader can
check them against a fixed list; object, string and structured dtypes are refused because they
cannot be rebuilt from raw bytes safely.

bfloat16 comes from ml_dtypes where it is installed, imported on first need (a bfloat16 array
sent, its name received or looked up), not by every process: it costs a task server 2.6 MB of
resident memory, 5% of an idle one, for a dtype most never see.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping

import numpy as np

from ..errors import InvalidArgument

__all__ = ["AS_IS", "LOADED", "WIRE_DTYPES", "dtype_name", "dtype_from_name", "half_precision"]

_BASE = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)

# The wire dtypes imported so far, a plain dict for the decoder's hot path (WIRE_DTYPES has them all).
LOADED: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in _BASE}
LOADED["bool"] = np.dtype(bool)
LOADED["int8"] = np.dtype("int8")
LOADED["uint8"] = np.dtype("uint8")
_BY_DTYPE = {dt: name for name, dt in LOADED.items()}

# the names ml_dtypes adds, and whether it is there to add them (found, not imported)
_LAZY = ("bfloat16",) if importlib.util.find_spec("ml_dtypes") is not None else ()


def _load_lazy() -> None:
    """Import ml_dtypes and add its dtypes (once)."""
    if "bfloat16" in LOADED or not _LAZY:
        return
    import ml_dtypes  # type: ignore[import-not-found]

    LOADED["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    _BY_DTYPE[LOADED["bfloat16"]] = "bfloat16"


class _WireDtypes(Mapping[str, np.dtype]):
    """Every wire dtype by name; ml_dtypes' are imported when one is first looked up."""

    def __getitem__(self, name: str) -> np.dtype:
        if name in _LAZY:
            _load_lazy()
        return LOADED[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*_BASE, *_LAZY])

    def __len__(self) -> int:
        return len(_BASE) + len(_LAZY)

    def __contains__(self, name: object) -> bool:
        return name in LOADED or name in _LAZY

    def __repr__(self) -> str:
        return f"WIRE_DTYPES({', '.join(self)})"


WIRE_DTYPES: Mapping[str, np.dtype] = _WireDtypes()


def _exports_buffer(dt: np.dtype) -> bool:
    try:
        memoryview(np.zeros(1, dt))
    except (ValueError, TypeError):
        return False
    return True


# Wire names of the dtypes whose C-ordered arrays are sent as they are (the encoder's fast path):
# little-endian or byte-order free, and exporting a buffer (bfloat16 does not: sent as a uint8 view).
# A big-endian dtype never equals its little-endian wire dtype, so it is not found here.
AS_IS: dict[np.dtype, str] = {dt: name for name, dt in LOADED.items() if _exports_buffer(dt)}


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a (native or little-endian) dtype; refuses what cannot travel."""
    name = _BY_DTYPE.get(dtype)
    if name is None and dtype.byteorder == ">":
        name = _BY_DTYPE.get(dtype.newbyteorder("<"))
    if name is None and dtype.name in _LAZY and "bfloat16" not in LOADED:  # the caller has ml_dtypes' dtype
        _load_lazy()
        return dtype_name(dtype)
    if name is None:
        raise InvalidArgument(
            f"dtype {dtype} cannot be sent: allowed are {', '.join(sorted(WIRE_DTYPES))}"
        )
    return name


def dtype_from_name(name: object) -> np.dtype:
    """The dtype of a wire name; refuses an unknown one."""
    dt = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise InvalidArgument(f"unknown wire dtype {name!r}")
    return dt


_HALF: dict[np.dtype, bool] = {}  # the answers by dtype: asked for every gradient pushed, ``dtype.name`` takes ~2 us


def half_precision(dtype: object) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (ml_dtypes': numpy kind 'V'), whose sums of many
    terms are taken in float32: float16 overflows past 65504, bfloat16 stops counting at 256."""
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    half = _HALF.get(dt)
    if half is None:
        half = bool(dt == np.float16 or dt.name == "bfloat16")
        if len(_HALF) < 256:  # the wire's dtypes are a few; any other dtype is answered uncached
            _HALF[dt] = half
    return half
