"""Ring collectives on other array types: cupy on a GPU, DLPack tensors, bfloat16.

Each test runs only where its library (and device) is present and says why it skips otherwise.
"""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.testing import local_cluster

from .conftest import arun, launch_script


def _two_ranks(make, check, op="sum", ranks=2, shm=True):
    async def main():
        async with local_cluster({"worker": ranks}, timeout=10, transport="tcp") as servers:
            rings = [zf.Ring(servers[f"worker:{i}"], chunk_bytes=1 << 16, shm=shm) for i in range(ranks)]
            outs = await asyncio.gather(*(r.allreduce(make(i), op=op) for i, r in enumerate(rings)))
            for out in outs:
                check(out)

    arun(main())


def _gpu():
    cp = pytest.importorskip("cupy", reason="cupy is not installed: the GPU path is tested where a GPU is present")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("cupy is installed but no GPU is visible")
    except Exception as exc:  # no driver, no device
        pytest.skip(f"no usable GPU: {exc}")
    return cp


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("shm", [True, False], ids=["one-host", "tcp"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_cupy_arrays_are_reduced_and_come_back_as_cupy(dtype, shm, ranks):
    """On one host a GPU buffer goes through the host's shared memory; over TCP it is reduced on
    the GPU chunk by chunk (float16's 600 KB take the one-step exchange instead)."""
    cp = _gpu()
    n = 300_007

    def make(i):  # made as int64: float16 cannot count to n (it overflows past 65504)
        return (cp.arange(n) % 17 + i).astype(dtype)

    def check(out):
        assert isinstance(out, cp.ndarray) and out.dtype == np.dtype(dtype)
        expected = (np.arange(n) % 17) * ranks + sum(range(ranks))
        np.testing.assert_array_equal(cp.asnumpy(out).astype(np.float64), expected)

    _two_ranks(make, check, ranks=ranks, shm=shm)


GPU_WORKER = textwrap.dedent(
    """
    import sys, cupy as cp, numpy as np, zmqflow as zf
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, timeout=20)
        n, r = ring.size, ring.rank
        for size in (1, 1000, 300_007, (5 << 20) // 4 + 3):  # small exchange, then shared memory
            for op in ("sum", "mean", "max"):
                x = (cp.arange(size) % 13 + r).astype(cp.float32)
                before = x.copy()
                got = ring.allreduce(x, op=op)  # the blocking ring stages it on this thread
                parts = [(np.arange(size) % 13 + k).astype(np.float32) for k in range(n)]
                want = {"sum": sum(parts), "mean": sum(parts) / n, "max": parts[-1]}[op]
                assert isinstance(got, cp.ndarray) and bool((x == before).all()), (size, op)
                np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-6, err_msg=f"{size} {op}")
        print("SHM", ring.async_ring.shm_channel is not None, flush=True)
        ring.barrier()
        ring.leave()
    """
)


def test_the_blocking_ring_stages_cupy_arrays_through_shared_memory(tmp_path, procs):
    _gpu()
    p = launch_script(procs, tmp_path / "worker.py", GPU_WORKER, workers=2)
    assert p.wait(100) == 0, p.output
    assert p.output.count("SHM True") == 2, p.output


def test_dlpack_tensors_are_reduced_in_place():
    torch = pytest.importorskip("torch", reason="torch is not installed: DLPack interchange is tested where it is")
    tensors = [torch.arange(10, dtype=torch.float32) * (i + 1) for i in range(2)]

    def check(out):
        assert isinstance(out, torch.Tensor)
        np.testing.assert_array_equal(out.numpy(), np.arange(10, dtype=np.float32) * 3)

    _two_ranks(lambda i: tensors[i], check)
    for t in tensors:  # written back into the caller's tensors, zero-copy
        np.testing.assert_array_equal(t.numpy(), np.arange(10, dtype=np.float32) * 3)


def test_bfloat16_where_ml_dtypes_is_installed():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed: bfloat16 needs it")
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def check(out):
        assert out.dtype == bf16
        np.testing.assert_array_equal(out.astype(np.float32), np.full(5, 3.0, np.float32))

    _two_ranks(lambda i: np.full(5, i + 1, bf16), check)
