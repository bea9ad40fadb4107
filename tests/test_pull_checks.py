"""Reads that could hand back the wrong bytes: shard memory, a changed part, shared out= arrays,
parts that do not cover the variable. Each is refused or made safe."""

from __future__ import annotations

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.variables import VarInfo, create_parts
from zmqflow.testing import local_cluster
from zmqflow.wire.requests import cluster as crq

from .conftest import arun


def test_a_whole_read_over_inproc_is_read_only_and_never_writes_the_shard():
    """Over inproc the received frame is the shard's own memory: the array comes read-only (the
    shard writes to a copy while it is out), where a write to it used to change the variable."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                v = await sess.variable("w", np.arange(1 << 18, dtype=np.float32))
                got = await v.read()
                assert not got.flags.writeable
                with pytest.raises(ValueError, match="read-only"):
                    got[:4] = -1
                await v.assign_add(np.ones(1 << 18, np.float32))
                np.testing.assert_array_equal(got[:4], [0, 1, 2, 3])  # the shard wrote a copy
                np.testing.assert_array_equal((await v.read())[:4], [1, 2, 3, 4])
                mine = await v.read(out=np.empty(1 << 18, np.float32))  # out= stays the caller's, writeable
                mine[:] = 0
                np.testing.assert_array_equal((await v.read())[:4], [1, 2, 3, 4])

    arun(main())


def test_a_reply_of_another_shape_or_dtype_than_the_part_known_is_refused():
    """A part made again differently since the session looked (a restarted shard): the reply
    used to be cast and broadcast into the expected array without a word."""
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                v = await sess.variable("w", np.zeros((4, 3), np.float32), partitioner=zf.fixed_size_partitioner(2))
                one = await sess.variable("one", np.zeros((2, 3), np.float32))
                for name, part, task, rows in (("w", 1, "ps:1", [2, 4]), ("one", 0, one.info.parts[0][0], [0, 2])):
                    store = servers[str(task)].service("ps").store
                    store.parts.pop((name, part))
                    store.create(name, part, [4 if name == "w" else 2, 1], rows, "float64",
                                 num_parts=2 if name == "w" else 1, value=np.full((2, 1), 7.0))
                want = r"variable 'w' \(part 1\) on ps:1 is now \[2, 1\] float64 where this session expects \[2, 3\]"
                with pytest.raises(errors.VariableConflict, match=want):
                    await v.read()
                with pytest.raises(errors.VariableConflict, match=r"'one' \(part 0\) .* is now \[2, 1\] float64"):
                    await one.read()

    arun(main())


def test_out_arrays_that_share_memory_are_refused_before_anything_is_sent():
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("a", np.full(4, 1.0, np.float32))
                await sess.variable("b", np.full(4, 2.0, np.float32))
                buf = np.zeros(8, np.float32)
                with pytest.raises(errors.InvalidArgument, match="out= for 'a' and 'b' share memory"):
                    await sess.pull(["a", "b"], out={"a": buf[:4], "b": buf[2:6]})
                assert not buf.any()
                got = await sess.pull(["a", "b"], out={"a": buf[:4], "b": buf[4:]})  # side by side: fine
                assert buf.tolist() == [1, 1, 1, 1, 2, 2, 2, 2] and got["a"].base is buf

    arun(main())


def test_part_rows_that_do_not_cover_the_variable_are_refused_by_the_catalog_and_the_client():
    """Parts [0, 2) twice for six rows: the catalog refuses the declaration; a record like it
    (from an older catalog) is refused by the client instead of reading rows no shard wrote."""
    async def main():
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                req = crq.Declare(name="g", shape=[6, 2], dtype="float32", part_rows=[[0, 2], [0, 2]],
                                  part_bytes=[16, 16], device=None, policy="round_robin", optimizer=None,
                                  initializer=zf.init.constant(5.0).spec())
                with pytest.raises(errors.InvalidArgument, match=r"variable 'g': part rows \[\[0, 2\], \[0, 2\]\] "
                                                                 r"do not cover \[0, 6\)"):
                    await sess.call_catalog("declare", req)
                assert await sess.variables() == []
                record = {"name": "g", "shape": [6, 2], "dtype": "float32", "table": None,
                          "parts": [{"task": "ps:0", "rows": [0, 2]}, {"task": "ps:1", "rows": [4, 6]}]}
                with pytest.raises(errors.InvalidArgument, match=r"'g': part rows .* do not cover \[0, 6\)"):
                    VarInfo.from_record(record)
                record["parts"][1]["rows"] = [2, 6]
                info = VarInfo.from_record(record)
                await create_parts(sess, info, None)
                assert info.parts[1][1:] == (2, 6)

    arun(main())


def test_an_empty_variable_takes_glorot_uniform():
    """Its fans are zero: creating it used to fail on the shard with a ZeroDivisionError."""
    async def main():
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc") as servers:
            async with zf.AsyncSession(servers["worker:0"].target, timeout=5) as sess:
                for shape in [(0,), (0, 0)]:
                    v = await sess.variable("e" + "x".join(map(str, shape)), shape=shape,
                                            initializer=zf.init.glorot_uniform())
                    assert (await v.read()).shape == shape
                assert (await sess.get("e0", timeout=0)).shape == (0,)

    arun(main())
