"""Reads into caller-owned buffers (``out=``), reused across reads, and checked before anything is sent."""

from __future__ import annotations

import os

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.client.variables import SLICE_BYTES
from zmqflow.testing import make_spec


@pytest.fixture(params=["bulk", "zeromq"])
def sess(request, monkeypatch):
    """A session on two shards over tcp: large pulls through bulk streams, or (ZMQFLOW_BULK=0)
    over ZeroMQ alone."""
    if request.param == "zeromq":
        monkeypatch.setenv("ZMQFLOW_BULK", "0")
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


def test_a_one_piece_read_is_the_received_frame_and_yours_to_write(sess):
    """Without out=, a variable that came in one reply is that reply's array (nothing copied):
    the right values, writeable, and writing it changes only the caller's copy."""
    v = sess.variable("one", shape=(16, 4))
    v.assign(np.arange(64, dtype=np.float32).reshape(16, 4))
    s = sess.variable("scalar", 3.0)
    got = sess.pull([v, s])
    assert list(got) == ["one", "scalar"]
    assert got["one"].shape == (16, 4) and got["one"].dtype == np.float32
    assert (got["one"] == np.arange(64, dtype=np.float32).reshape(16, 4)).all()
    assert got["scalar"].shape == () and got["scalar"] == 3.0
    assert got["one"].flags.writeable
    got["one"][:] = -1
    assert (v.read() == np.arange(64, dtype=np.float32).reshape(16, 4)).all()
    rows = 2 * SLICE_BYTES // (64 * 4) + 3  # over a slice: still one frame, no copy
    big = sess.variable("big_whole", shape=(rows, 64))
    want = np.arange(rows * 64, dtype=np.float32).reshape(rows, 64)
    big.assign(want)
    whole = sess.pull([big])["big_whole"]
    assert whole.shape == (rows, 64) and whole.flags.writeable and (whole == want).all()
    if os.environ.get("ZMQFLOW_BULK") == "0":
        assert not whole.flags.owndata  # a view of the received frame, not an array it was copied into
    else:
        assert whole.flags.owndata  # the array the stream's bytes landed in, copied by no one


def test_a_many_piece_read_without_out_is_assembled_whole(sess):
    rows = 2 * SLICE_BYTES // (64 * 4) + 3
    v = sess.variable("parts", shape=(rows, 64), partitioner=zf.fixed_size_partitioner(2))
    want = np.arange(rows * 64, dtype=np.float32).reshape(rows, 64)
    v.assign(want)
    small = sess.variable("small", shape=(3,))
    got = sess.pull([v, small])
    assert got["parts"].shape == (rows, 64) and (got["parts"] == want).all()
    assert (got["small"] == 0).all()


def test_a_read_with_one_shard_gone_fails_typed_and_leaves_the_session_usable():
    """One part's shard is down: the read raises a typed error within its timeout (the other
    part's replies cancelled or done, nothing left running), and reads of the live shard go on."""
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    with zf.Server(spec, "ps:0"), zf.Server(spec, "worker:0") as w:
        ps1 = zf.Server(spec, "ps:1")
        try:
            with zf.Session(w.target, timeout=2.0) as s:
                rows = 2 * SLICE_BYTES // (64 * 4) + 3
                v = s.variable("split", shape=(rows, 64), partitioner=zf.fixed_size_partitioner(2))
                with zf.device("/job:ps/task:0"):
                    live = s.variable("live", shape=(4,))
                ps1.stop()
                buf = np.zeros((rows, 64), np.float32)
                with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
                    s.pull([v], out={"split": buf}, timeout=1.0)
                assert (s.pull([live])["live"] == 0).all()
        finally:
            ps1.stop()
