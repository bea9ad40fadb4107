"""Dtypes at the edges of a ring's arithmetic, on each of its three paths (the one-step exchange,
the chunked TCP ring, shared memory), between rings on real sockets and segments: integer means
past 2**53, half-precision means whose sum overflows, and arrays in the other byte order."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest

from zmqflow.client.ring import AsyncRing
from zmqflow.state.reduce import finish_mean, reduce_in_order
from zmqflow.testing import local_cluster

from .conftest import arun

PATHS = {"exchange": dict(shm=False), "ring": dict(shm=False, small_bytes=0, chunk_bytes=16), "shm": dict(shm=True)}
try:
    from ml_dtypes import bfloat16  # registers numpy's bfloat16
    HALF = ["float16", np.dtype(bfloat16).name]
except ImportError:
    HALF = ["float16"]


def paths() -> list[str]:
    return [p for p in PATHS if p != "shm" or os.access("/dev/shm", os.W_OK)]


def allreduce(path: str, inputs: list[np.ndarray], op: str) -> list[Any]:
    """Every rank's result of one allreduce of ``inputs`` (one per rank) on ``path``."""
    async def main() -> list[Any]:
        async with local_cluster({"worker": len(inputs)}, timeout=10, transport="tcp") as servers:
            rings = [AsyncRing(servers[f"worker:{i}"], timeout=10, **PATHS[path]) for i in range(len(inputs))]
            outs = await asyncio.gather(*(r.allreduce(x, op=op) for r, x in zip(rings, inputs)))
            assert all((r.shm_channel is not None) == (path == "shm") for r in rings)
            return outs

    return arun(main(), timeout=60)


def trunc_mean(column: list[int]) -> int:
    """The mean of Python ints, truncated toward zero, exactly."""
    total = sum(column)
    return (abs(total) // len(column)) * (1 if total >= 0 else -1)


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("dtype", ["int64", "uint64"])
def test_an_integer_mean_is_exact_past_2_53(path, dtype):
    n = 3
    if dtype == "int64":
        rows = [[2**60 + 1 + r, -(2**60) - 2 - r, 2**53 + 1, -7 + r, 2**61 + r] for r in range(n)]  # sums fit
    else:
        rows = [[2**62 + 1 + r, 2**53 + 1, 7 + r, 2**61 + 3 * r] for r in range(n)]  # sums past 2**63
    inputs = [np.array(row, dtype) for row in rows]
    expected = np.array([trunc_mean(list(col)) for col in zip(*rows)], dtype)
    for out in allreduce(path, inputs, "mean"):
        assert out.dtype == np.dtype(dtype)
        assert out.tolist() == expected.tolist()


def test_an_integer_mean_truncates_toward_zero_in_every_integer_dtype():
    for dtype in ("int8", "int16", "int32", "int64", "uint8", "uint32"):
        info = np.iinfo(dtype)
        summed = np.array([info.max, info.min, -7 if info.min < 0 else 7, 0, 1], dtype)
        want = [trunc_mean([int(v)] + [0] * 2) for v in summed.tolist()]  # a sum over 3 ranks
        finish_mean(summed, 3)
        assert summed.tolist() == want, dtype
    for n, want in ((300, [0, 0, 0]), (128, [0, 0, -1])):  # more ranks than the dtype counts
        few = np.array([100, -100, -128], np.int8)
        finish_mean(few, n)
        assert few.tolist() == want, n


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("dtype", HALF)
def test_a_half_precision_mean_is_summed_in_float32(path, dtype):
    """Three float16 40000s sum past float16's largest value (65504) though their mean fits; and
    summed in float32 the mean is rounded once, where summing in the half dtype rounds each step."""
    n, rng = 3, np.random.default_rng(5)
    big = [40000.0] * 3 if dtype == "float16" else []
    inputs = [np.concatenate([big, rng.uniform(-4, 4, 61)]).astype(dtype) for _ in range(n)]
    outs = allreduce(path, inputs, "mean")
    wide = inputs[0].astype(np.float32)
    for x in inputs[1:]:
        wide += x
    wide /= n
    ulp = 2.0 ** -10 if dtype == "float16" else 2.0 ** -7
    for out in outs:
        assert out.dtype == np.dtype(dtype) and out.tobytes() == outs[0].tobytes()  # the same bits on every rank
        np.testing.assert_allclose(out.astype(np.float64), wide, rtol=ulp)
    if path != "ring":  # the exchange and shared memory fold in rank order: exactly that float32 sum
        assert outs[0].tobytes() == wide.astype(dtype).tobytes() == reduce_in_order(inputs, "mean").tobytes()


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("dtype", [">f4", ">i8", ">f8"])
def test_arrays_in_the_other_byte_order_reduce_like_native_ones(path, dtype):
    inputs = [(np.arange(9) * (r + 1)).astype(dtype) for r in range(2)]
    assert not inputs[0].dtype.isnative
    for out in allreduce(path, inputs, "sum"):
        np.testing.assert_array_equal(out, np.arange(9) * 3)
        assert out.dtype == np.dtype(dtype).newbyteorder("=")
