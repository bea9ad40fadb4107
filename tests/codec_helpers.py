"""What the codec tests share: hand-built headers and frames, the vector generator, and
comparisons of what was sent with what arrived."""

from __future__ import annotations

import importlib.util
import math
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from zmqflow.wire import REPLY, REQUEST, VERSION, DecodeError, Limits, Message, decode, encode
from zmqflow.wire.dtypes import WIRE_DTYPES

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "protocol" / "vectors"


def _load_make_vectors():
    spec = importlib.util.spec_from_file_location("make_vectors", ROOT / "protocol" / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mv = _load_make_vectors()


def roundtrip(msg: Message) -> Message:
    return decode([bytes(memoryview(f)) for f in encode(msg)])


def ref(i: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack(">I", i))


def header(**fields: Any) -> bytes:
    base: dict[str, Any] = {"v": VERSION, "k": REPLY, "id": 9}
    base.update(fields)
    base.setdefault("t", [])
    return msgpack.packb({k: v for k, v in base.items() if v is not DROP}, use_bin_type=True)


DROP = object()


def request_header(**fields: Any) -> bytes:
    base: dict[str, Any] = {"k": REQUEST, "svc": "ps", "op": "pull", "a": None}
    base.update(fields)
    return header(**base)


def one_tensor(entry: list, frame: bytes, **fields: Any) -> list[bytes]:
    return [header(a=ref(0), t=[entry], **fields), frame]


def decode_error(frames: list[Any], limits: Limits | None = None) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode(frames) if limits is None else decode(frames, limits)
    return info.value


def wire_bytes(arr: np.ndarray) -> bytes:
    name = arr.dtype.name if arr.dtype.name in WIRE_DTYPES else None
    if name is None:  # a big-endian dtype's name is the same as the little-endian one
        name = arr.dtype.newbyteorder("<").name
    return arr.astype(WIRE_DTYPES[name], order="C").tobytes()


def assert_same(sent: Any, got: Any) -> None:
    """``got`` is what the wire makes of ``sent``: same types, arrays equal bit for bit and C-ordered."""
    if isinstance(sent, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.shape == sent.shape
        assert got.dtype == WIRE_DTYPES[got.dtype.name] and got.dtype.newbyteorder("<") == sent.dtype.newbyteorder("<")
        assert got.flags.c_contiguous
        assert got.tobytes() == wire_bytes(sent)
    elif isinstance(sent, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(sent)
        for a, b in zip(sent, got):
            assert_same(a, b)
    elif isinstance(sent, dict):
        assert isinstance(got, dict) and list(got) == list(sent)
        for k in sent:
            assert_same(sent[k], got[k])
    elif isinstance(sent, float) and math.isnan(sent):
        assert isinstance(got, float) and math.isnan(got)
    else:
        assert type(got) is type(sent) and got == sent


def sample(dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    n = math.prod(shape)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)
    if dtype.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype).reshape(shape)
    return (rng.standard_normal(n) * 100).astype(dtype).reshape(shape)


SHAPES = [(), (0,), (1,), (7,), (0, 3), (3, 0, 2), (2, 3, 4), (1, 1, 1, 1), (5, 1)]
