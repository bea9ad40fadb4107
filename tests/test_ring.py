"""Ring collectives: correctness across real processes, mismatches, dead ranks."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.ring import AsyncRing
from zmqflow.testing import REPLY, faulty_cluster, local_cluster

from .conftest import arun, launch_script

SIZES = (0, 1, 7, 1000, 1_000_003)
DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = ("sum", "mean", "min", "max")


def rank_array(rank: int, size: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + size)
    if np.dtype(dtype).kind == "f":
        return rng.uniform(-4, 4, size).astype(dtype)
    return rng.integers(-1000, 1000, size).astype(dtype)


def cases():
    for size in SIZES:
        for dtype in DTYPES:
            for op in OPS:
                if size == 1_000_003 and (dtype not in ("float32", "int64") or op not in ("sum", "max")):
                    continue  # the big size once per kind of arithmetic keeps the suite quick
                yield size, dtype, op


WORKER = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    sys.path.insert(0, sys.argv[2])
    from tests.test_ring import cases, rank_array
    out = {}
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, chunk_bytes=64 << 10, bucket_bytes=1 << 20)
        for size, dtype, op in cases():
            out[f"{size}-{dtype}-{op}"] = ring.allreduce(rank_array(ring.rank, size, dtype), op=op)
        # a fused list of many tensors, of two dtypes, in one call
        fused = ring.allreduce([rank_array(ring.rank, n, d) for n, d in [(3, "float64"), (5, "int32"), (0, "float64"), (9, "float64")]])
        for i, a in enumerate(fused):
            out[f"fused-{i}"] = a
        gathered = ring.allgather(np.full(3, ring.rank, np.int64))
        out["gather"] = gathered
        out["bcast"] = ring.broadcast(np.full(5, float(ring.rank)), root=ring.size - 1)
        ring.barrier()
        np.savez(f"{sys.argv[1]}/rank{ring.rank}.npz", **out)
    """
)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_equals_numpy_across_processes(tmp_path, procs, n):
    root = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    p = launch_script(procs, tmp_path / "worker.py", WORKER, tmp_path, root, workers=n)
    assert p.wait(240) == 0, p.output
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(n)]
    for size, dtype, op in cases():
        key = f"{size}-{dtype}-{op}"
        inputs = np.stack([rank_array(r, size, dtype) for r in range(n)]).astype(np.float64)
        ref = {"sum": inputs.sum(0), "mean": inputs.mean(0), "min": inputs.min(0), "max": inputs.max(0)}[op]
        if np.dtype(dtype).kind in "iu" and op == "mean":
            ref = np.trunc(ref)
        got = results[0][key]
        assert got.dtype == np.dtype(dtype) and got.shape == (size,), key
        if np.dtype(dtype).kind in "iu" or op in ("min", "max"):
            np.testing.assert_array_equal(got, ref.astype(dtype), err_msg=key)  # exact
        else:
            tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol, atol=tol * 4 * n, err_msg=key)
        for r in range(1, n):  # every rank holds the very same bytes
            np.testing.assert_array_equal(results[r][key], got, err_msg=f"{key} rank {r}")
    for i, (m, d) in enumerate([(3, "float64"), (5, "int32"), (0, "float64"), (9, "float64")]):
        ref = np.sum([rank_array(r, m, d) for r in range(n)], axis=0) if m else np.zeros(0, d)
        np.testing.assert_allclose(results[0][f"fused-{i}"], ref, rtol=1e-12)
    np.testing.assert_array_equal(results[1]["gather"], np.repeat(np.arange(n), 3).reshape(n, 3))
    np.testing.assert_array_equal(results[0]["bcast"], np.full(5, float(n - 1)))


def test_a_mismatch_raises_on_every_rank_naming_both_sides():
    async def main():
        async with local_cluster({"worker": 3}, timeout=10, transport="tcp") as servers:
            rings = [zf.Ring(servers[f"worker:{i}"]) for i in range(3)]
            shapes = [(10,), (10,), (11,)]
            results = await asyncio.gather(
                *(r.allreduce(np.ones(s, np.float32), timeout=10) for r, s in zip(rings, shapes)), return_exceptions=True
            )
            for res in results:
                assert isinstance(res, errors.CollectiveMismatch), res
                assert "element count" in str(res) and "worker:2" in str(res)
            # the ring is usable again once every rank agrees
            again = await asyncio.gather(*(r.allreduce(np.full(4, i, np.int64)) for i, r in enumerate(rings)))
            for out in again:
                np.testing.assert_array_equal(out, np.full(4, 3, np.int64))
            dtypes = await asyncio.gather(
                *(r.allreduce(np.ones(4, d), timeout=10) for r, d in zip(rings, ["float32", "float64", "float32"])),
                return_exceptions=True,
            )
            assert all(isinstance(x, errors.CollectiveMismatch) and "dtype" in str(x) for x in dtypes)

    arun(main())


def test_a_silent_rank_gives_deadline_exceeded_naming_it():
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="inproc") as servers:
            r0 = zf.Ring(servers["worker:0"])
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded, match=r"waiting for rank 1 \(worker:1\)"):
                await r0.allreduce(np.ones(4), timeout=0.5)
            assert time.monotonic() - start < 5

    arun(main())


def test_a_single_rank_ring_and_bad_arguments():
    async def main():
        async with local_cluster({"worker": 1}, timeout=10, transport="inproc") as servers:
            ring = zf.Ring(servers["worker:0"])
            x = np.arange(5.0)
            np.testing.assert_array_equal(await ring.allreduce(x, op="mean"), x)
            with pytest.raises(errors.InvalidArgument, match="op must be one of"):
                await ring.allreduce(x, op="prod")
            with pytest.raises(errors.ConfigError, match="not a member"):
                zf.Ring(servers["worker:0"], members=["worker:1"])

    arun(main())


KILLED = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, timeout=60)
        x = np.ones(int(sys.argv[1]), np.float32)
        try:
            for i in range(100000):
                ring.allreduce(x)
                print("iter", i, flush=True)
        except zf.errors.Unavailable as exc:
            print("unavailable:", exc, flush=True)
            sys.exit(3)
    """
)


@pytest.mark.parametrize("elements", [2_000_000, 1000])  # the ring, and the small buffers' exchange
def test_a_killed_rank_makes_the_others_raise_unavailable_within_5s(tmp_path, procs, elements):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    cfile = tmp_path / "c.json"
    from zmqflow.testing import free_port

    cfile.write_text(json.dumps({"worker": [f"127.0.0.1:{free_port()}" for _ in range(3)]}))
    ranks = [
        procs([sys.executable, str(script), str(elements)], env={"ZMQFLOW_CLUSTER": str(cfile), "ZMQFLOW_TASK": f"worker:{i}"})
        for i in range(3)
    ]
    for r in ranks:
        r.wait_for_line("iter 2", 60)
    ranks[2].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for r in ranks[:2]:
        assert r.wait(10) == 3, r.output
        assert time.monotonic() - killed_at < 5
        assert "worker:2" in r.wait_for_line("unavailable:", 1)


def test_a_rank_that_completed_the_last_call_and_left_is_not_taken_for_a_death():
    """worker:0 completes an allreduce, but its acknowledgements of worker:1's chunks are lost;
    it leaves and stops. worker:1 holds every chunk it needs: its call completes, instead of
    failing on the lost acknowledgement or on worker:0's connection going down."""
    async def main(leave: bool):
        async with faulty_cluster({"worker": 2}, timeout=10) as (servers, faults):
            a, b = servers["worker:0"], servers["worker:1"]
            ra, rb = AsyncRing(a, timeout=10, shm=False), AsyncRing(b, timeout=10, shm=False)
            faults.hold(direction=REPLY, op="ring.deposit", server="worker:0")
            slower = asyncio.ensure_future(rb.allreduce(np.arange(8.0)))
            np.testing.assert_array_equal(await ra.allreduce(np.arange(8.0)), 2 * np.arange(8.0))
            assert not slower.done()  # still waiting for worker:0's acknowledgement
            if leave:
                await ra.leave()
            await a.stop()
            return await slower

    np.testing.assert_array_equal(arun(main(leave=True), timeout=30), 2 * np.arange(8.0))
    with pytest.raises(errors.Unavailable, match="worker:0"):  # without the word, a lost acknowledgement is a death
        arun(main(leave=False), timeout=30)


def order_sensitive(rank: int, size: int) -> np.ndarray:
    """float32 values whose sum depends on the order of addition (large and tiny mixed)."""
    rng = np.random.default_rng(77 + rank)
    return (rng.uniform(-1, 1, size) * 10.0 ** rng.integers(-6, 7, size)).astype(np.float32)


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_gets_the_same_bits_on_the_exchange_and_ring_paths(n):
    """The small path reduces all buffers locally in rank order; the ring reduces each segment in
    a different order then allgathers: either way every rank must hold identical bytes."""
    async def main():
        async with local_cluster({"worker": n}, timeout=20, transport="tcp") as servers:
            rings = [AsyncRing(servers[f"worker:{i}"], small_bytes=4096, chunk_bytes=1024, shm=False) for i in range(n)]
            for size in (1000, 100_003):  # 4 KB: one exchange; 400 KB: the ring, chunked
                inputs = [order_sensitive(r, size) for r in range(n)]
                kept = [x.copy() for x in inputs]
                outs = await asyncio.gather(*(ring.allreduce(x) for ring, x in zip(rings, inputs)))
                for r in range(n):
                    np.testing.assert_array_equal(inputs[r], kept[r])  # numpy inputs are left alone
                    assert outs[r] is not inputs[r] and outs[r].tobytes() == outs[0].tobytes(), (size, r)
                ref = np.sum(np.stack(inputs).astype(np.float64), axis=0)
                np.testing.assert_allclose(outs[0], ref, rtol=1e-4, atol=1e-3)
                if size == 1000:  # the exchange folds in rank order: exactly numpy's left-to-right sum
                    expected = inputs[0].copy()
                    for x in inputs[1:]:
                        expected += x
                    assert outs[0].tobytes() == expected.tobytes()
                means = await asyncio.gather(*(ring.allreduce([x], op="mean") for ring, x in zip(rings, inputs)))
                assert all(m[0].tobytes() == means[0][0].tobytes() for m in means)

    arun(main(), timeout=60)


def test_a_rank_on_the_ring_and_one_on_the_exchange_raise_a_mismatch_not_a_deadlock():
    """Different sizes pick different algorithms; the exchange deposits where the ring's first
    chunk goes, so both sides still see each other's description."""
    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            rings = [AsyncRing(servers[f"worker:{i}"], small_bytes=1024, shm=False) for i in range(2)]
            start = time.monotonic()
            results = await asyncio.gather(
                rings[0].allreduce(np.ones(10, np.float32), timeout=8),
                rings[1].allreduce(np.ones(5000, np.float32), timeout=8), return_exceptions=True)
            assert time.monotonic() - start < 5
            for res in results:
                assert isinstance(res, errors.CollectiveMismatch), res
                assert "element count" in str(res) and "worker:0" in str(res) and "worker:1" in str(res)
            again = await asyncio.gather(*(r.allreduce(np.full(3, i + 1.0)) for i, r in enumerate(rings)))
            for out in again:
                np.testing.assert_array_equal(out, np.full(3, 3.0))

    arun(main(), timeout=30)
