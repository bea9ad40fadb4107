"""The dtypes that may cross the wire, by name.

Names (``"float32"``), not numpy's byte-order strings, travel in headers so that any reader can
check them against a fixed list; object, string and structured dtypes are refused because they
cannot be rebuilt from raw bytes safely.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

__all__ = ["AS_IS", "WIRE_DTYPES", "dtype_name", "dtype_from_name"]

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

WIRE_DTYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in _BASE}
WIRE_DTYPES["bool"] = np.dtype(bool)
WIRE_DTYPES["int8"] = np.dtype("int8")
WIRE_DTYPES["uint8"] = np.dtype("uint8")

try:  # bfloat16 and float8 exist only where ml_dtypes is installed
    import ml_dtypes  # type: ignore[import-not-found]

    WIRE_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    pass

_BY_DTYPE = {dt: name for name, dt in WIRE_DTYPES.items()}


def _exports_buffer(dt: np.dtype) -> bool:
    try:
        memoryview(np.zeros(1, dt))
    except (ValueError, TypeError):
        return False
    return True


# Wire names of the dtypes whose C-ordered arrays are sent as they are (the encoder's fast path):
# little-endian or byte-order free, and exporting a buffer (bfloat16 does not: sent as a uint8 view).
# A big-endian dtype never equals its little-endian wire dtype, so it is not found here.
AS_IS: dict[np.dtype, str] = {dt: name for name, dt in WIRE_DTYPES.items() if _exports_buffer(dt)}


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a (native or little-endian) dtype; refuses what cannot travel."""
    name = _BY_DTYPE.get(dtype)
    if name is None and dtype.byteorder == ">":
        name = _BY_DTYPE.get(dtype.newbyteorder("<"))
    if name is None:
        raise InvalidArgument(
            f"dtype {dtype} cannot be sent: allowed are {', '.join(sorted(WIRE_DTYPES))}"
        )
    return name


def dtype_from_name(name: object) -> np.dtype:
    dt = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise InvalidArgument(f"unknown wire dtype {name!r}")
    return dt
