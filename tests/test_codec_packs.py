"""Pack frames (``zmqflow.wire.tensors``): a message's small arrays share frames, each at an
aligned offset; both codecs write the same packs and read them alike, and a table whose packed
entries overlap, lie out of order or past their frame, or sit off their itemsize is refused."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from zmqflow.wire import codec
from zmqflow.wire.codec import DecodeError, Limits, LimitExceeded, Message, decode, encode
from zmqflow.wire.message import REPLY, REQUEST
from zmqflow.wire.tensors import MAX_TENSORS, PACK_ALIGN, PACK_BELOW, PACK_BYTES

from .codec_helpers import decode_error, header, ref


def _both(msg: Message) -> list[bytes]:
    """The frames each codec writes for ``msg``, checked equal (the compiled one where built)."""
    frames = [bytes(memoryview(f)) for f in encode(msg)]
    if codec._built is not None:
        codec.use_compiled(False)
        try:
            assert [bytes(memoryview(f)) for f in encode(msg)] == frames
        finally:
            codec.use_compiled(True)
    return frames


def _table(frames: list[Any]) -> list[list[Any]]:
    return msgpack.unpackb(frames[0], raw=False, strict_map_key=False)["t"]


def _read_alike(frames: list[Any]) -> Message:
    """The message both readers make of ``frames`` (the Python codec's, after the compiled one's)."""
    got = decode(list(frames))
    if codec._built is not None:
        codec.use_compiled(False)
        try:
            slow = decode(list(frames))
        finally:
            codec.use_compiled(True)
        flat = [list(m.body.values()) if isinstance(m.body, dict) else m.body for m in (slow, got)]
        assert len(flat[0]) == len(flat[1])
        for a, b in zip(*flat):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return got


def test_small_arrays_share_a_pack_at_aligned_offsets_and_arrive_equal():
    rng = np.random.default_rng(0)
    small = [rng.standard_normal(n).astype(np.float32) for n in (1, 3, 250, 7)]
    odd = [np.arange(5, dtype=">i2"), np.asfortranarray(np.ones((3, 2))), np.array(2.5), np.array([True, False])]
    big, empty = np.arange(PACK_BELOW // 4, dtype=np.float32), np.zeros((0, 4), np.float32)
    body = [*small, big, *odd, empty]
    frames = _both(Message(REQUEST, 3, "ps", "push", body, 5.0))
    table = _table(frames)
    assert len(frames) == 4 and [e[2] for e in table] == [3] * 4 + [1] + [3] * 4 + [2]  # big, empty, the pack
    offsets = [e[3] for e in table if len(e) == 4]
    assert offsets == sorted(offsets) and all(o % PACK_ALIGN == 0 for o in offsets) and offsets[0] == 0
    got = _read_alike(frames).body
    for sent, arrived in zip(body, got):
        assert arrived.shape == sent.shape and np.array_equal(arrived, sent) and arrived.flags.c_contiguous
    pack = bytearray(frames[3])  # writable, as a received zmq frame is
    arrays = decode([frames[0], frames[1], frames[2], pack]).body
    assert arrays[0].flags.writeable and np.shares_memory(arrays[0], np.frombuffer(pack, np.uint8))
    assert arrays[0].ctypes.data % PACK_ALIGN == np.frombuffer(pack, np.uint8).ctypes.data % PACK_ALIGN


def test_one_small_array_keeps_a_frame_of_its_own():
    frames = _both(Message(REPLY, 1, body=[np.arange(3), np.arange(PACK_BELOW)]))
    assert [len(e) for e in _table(frames)] == [3, 3] and len(frames) == 3


def test_a_pack_holds_at_most_pack_bytes_and_the_next_starts_a_new_frame():
    n = PACK_BELOW // 4 - 1  # the largest array packed: 2 packs of a 1 MiB cap hold 2 * 64 of them
    body = [np.full(n, i, np.float32) for i in range(2 * PACK_BYTES // (n * 4 + PACK_ALIGN) + 3)]
    frames = _both(Message(REPLY, 2, body=body))
    packs = sorted({e[2] for e in _table(frames)})
    assert len(packs) == len(frames) - 1 >= 3 and all(len(f) <= PACK_BYTES for f in frames[1:])
    assert [int(a[0]) for a in _read_alike(frames).body] == list(range(len(body)))


def test_a_model_of_thousands_of_small_variables_is_three_frames_not_thousands():
    body = {f"v{i}": np.full(64, i, np.float32) for i in range(5000)}  # past 4096 frames a message
    frames = _both(Message(REQUEST, 4, "ps", "push", body, 5.0))
    assert len(frames) == 3  # the header and two packs of 1.28 MB in all
    got = _read_alike(frames).body
    assert all(int(got[f"v{i}"][63]) == i for i in range(5000))


def test_the_compiled_codec_packs_as_the_python_codec_says():
    if codec._built is None:
        pytest.skip("the compiled codec is not built here: the Python codec packs alone")
    assert (codec._built.PACK_BELOW, codec._built.PACK_ALIGN, codec._built.PACK_BYTES) == (
        PACK_BELOW, PACK_ALIGN, PACK_BYTES)


def _two(t: list[list[Any]], *frames: bytes) -> list[bytes]:
    return [header(a=[ref(i) for i in range(len(t))], t=t), *frames]


@pytest.mark.parametrize("t, frame, says", [
    ([["float32", [2], 1, 0], ["float32", [2], 1, 4]], bytes(16), "offset 4 in frame 1"),  # overlapping
    ([["float32", [2], 1, 8], ["float32", [2], 1, 0]], bytes(16), "offset 0 in frame 1"),  # out of order
    ([["uint8", [4], 1, 0], ["float64", [1], 1, 4]], bytes(16), "offset 4 in frame 1"),  # off its itemsize
    ([["uint8", [4], 1, 0], ["float64", [1], 1, 16]], bytes(16), "needs 8 bytes but its frame has 16 from offset 16"),
    ([["uint8", [4], 1, -16], ["uint8", [4], 1, 0]], bytes(16), "offset -16"),
    ([["uint8", [4], 1, "0"], ["uint8", [4], 1, 8]], bytes(16), "offset '0'"),
    ([["uint8", [16], 1], ["uint8", [4], 1, 0]], bytes(16), "frame index 1 is out of range or used twice"),
    ([["uint8", [4], 1, 0], ["uint8", [16], 1]], bytes(16), "frame index 1 is out of range or used twice"),
    ([["uint8", [4], 1, 0], ["uint8", [4], 1, 8, 0]], bytes(16), "entry must be"),
])
def test_a_malformed_pack_is_refused_naming_the_tensor_at_fault(t, frame, says):
    err = decode_error(_two(t, frame))
    assert says in str(err), str(err)
    if codec._built is not None:
        assert codec._built.decode(_two(t, frame), Limits()) is None  # handed to the Python codec, which says why


def test_a_frame_no_entry_describes_is_refused_beside_a_pack():
    frames = _two([["uint8", [4], 1, 0], ["uint8", [4], 1, 8]], bytes(16), b"\x00")
    assert "header describes 2 tensors but 2 tensor frames" not in str(decode_error(frames))
    frames = _two([["uint8", [4], 2, 0], ["uint8", [4], 2, 8], ["uint8", [1], 3]], bytes(1), bytes(16), b"\x00")
    assert "tensor frames [1] are not described" in str(decode_error(frames))


def test_a_pack_counts_once_toward_the_message_limit_and_its_frame_toward_the_frame_limit():
    frames = _both(Message(REPLY, 5, body=[np.zeros(100, np.uint8), np.zeros(100, np.uint8)]))
    assert len(frames[1]) == 212
    assert len(decode(frames, Limits(max_message_bytes=212)).body) == 2
    assert "bytes in one message" in str(decode_error(frames, Limits(max_message_bytes=211)))
    assert "exceeds the limit of 211" in str(decode_error(frames, Limits(max_frame_bytes=211)))


def test_a_table_of_more_tensors_than_a_message_may_hold_is_refused_unread():
    t = [["uint8", [0], 1, 0]] * (MAX_TENSORS + 1)
    with pytest.raises(LimitExceeded, match=f"{MAX_TENSORS + 1} tensors exceed the limit of {MAX_TENSORS}"):
        decode([header(a=None, t=t), b""])
    assert isinstance(LimitExceeded("x"), DecodeError)
