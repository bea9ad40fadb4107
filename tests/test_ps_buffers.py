"""Reads into caller-owned buffers (``out=``), reused across reads, and checked before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.variables import SLICE_BYTES
from zmqflow.testing import make_spec


@pytest.fixture()
def sess():
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    with zf.Server(spec, "ps:0"), zf.Server(spec, "ps:1"), zf.Server(spec, "worker:0") as w:
        with zf.Session(w.target) as s:
            yield s


def test_read_into_a_reused_out_buffer(sess):
    rows = 2 * SLICE_BYTES // (64 * 4) + 3  # several slices on each of two parts
    v = sess.variable("big", shape=(rows, 64), partitioner=zf.fixed_size_partitioner(2))
    buf = np.full((rows, 64), -1.0, np.float32)
    for step in range(1, 3):
        v.assign_add(np.ones((rows, 64), np.float32))
        got = v.read(out=buf)
        assert got is buf  # the caller's array, filled in place, no new one
        assert (buf == step).all()
    pulled = sess.pull([v], out={"big": buf})
    assert pulled["big"] is buf and (buf == 2).all()
    s = sess.variable("s", 5.0)
    sbuf = np.zeros((), np.float32)
    assert s.read(out=sbuf) is sbuf and sbuf == 5.0


def test_wrong_out_buffer_is_refused_naming_it_and_changes_nothing(sess):
    v = sess.variable("w", shape=(8, 4))
    v.assign(np.arange(32, dtype=np.float32).reshape(8, 4))
    bad = [np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float64), np.zeros((4, 8), np.float32).T, [[0.0] * 4] * 8]
    for out in bad:
        before = out.copy() if isinstance(out, np.ndarray) else None
        with pytest.raises(errors.InvalidArgument, match="out= for 'w'"):
            v.read(out=out)
        if before is not None:
            assert (out == before).all()
    ro = np.zeros((8, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(errors.InvalidArgument, match="writeable"):
        v.read(out=ro)
    with pytest.raises(errors.InvalidArgument, match="not pulled: other"):
        sess.pull(["w"], out={"other": np.zeros((8, 4), np.float32)})
    assert (v.read() == np.arange(32, dtype=np.float32).reshape(8, 4)).all()
