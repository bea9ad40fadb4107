"""The wire codec: every way a message can be malformed, refused with an error that names it."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from zmqflow.errors import InvalidArgument, ProtocolError, VersionMismatch
from zmqflow.wire import ERROR, REPLY, REQUEST, Limits, Message, decode, encode
from zmqflow.wire.tensors import PACK_BELOW

from .codec_helpers import roundtrip, ref, header, DROP, request_header, one_tensor, decode_error



def test_empty_frame_list():
    err = decode_error([])
    assert err.request_id is None and "empty" in str(err)


@pytest.mark.parametrize(
    "raw", [b"", b"\xc1", b"\x81\xa1v", b"\xa1v\x01"], ids=["empty", "never-used", "truncated", "trailing"]
)
def test_header_that_is_not_msgpack(raw):
    assert decode_error([raw]).request_id is None


def test_truncated_header():
    """Refused; answered when its start still holds v, k and id (read key by key), else not."""
    good = request_header(id=3)
    for cut, rid in ((1, None), (8, None), (len(good) // 2, 3), (len(good) - 1, 3)):
        err = decode_error([good[:cut]])
        assert "msgpack" in str(err) and err.request_id == rid and err.kind == ("req" if rid else None)


@pytest.mark.parametrize("value", [[1, 2], "text", 7, None])
def test_header_that_is_not_a_map(value):
    err = decode_error([msgpack.packb(value)])
    assert "map" in str(err)


@pytest.mark.parametrize("version", [0, 2, "1", True, 1.0, None, DROP])
def test_wrong_version_is_refused_with_version_mismatch(version):
    err = decode_error([request_header(v=version, id=41)])
    assert isinstance(err, VersionMismatch) and isinstance(err, ProtocolError)
    assert err.code == "VERSION_MISMATCH"
    assert err.request_id == 41 and err.kind == REQUEST


def test_version_is_checked_before_anything_else():
    frames = [header(v=2, id=5, k="bogus", a=msgpack.ExtType(7, b"1234"), t="nonsense"), b"extra", b"frames"]
    err = decode_error(frames)
    assert isinstance(err, VersionMismatch) and err.request_id == 5 and err.kind is None
    err = decode_error([header(v=2, id=-1)])
    assert isinstance(err, VersionMismatch) and err.request_id is None


def test_unknown_kind():
    err = decode_error([header(k="push", id=8)])
    assert not isinstance(err, VersionMismatch)
    assert err.request_id == 8 and "kind" in str(err)


@pytest.mark.parametrize("rid", [-1, 1.0, "1", True, None, [1], DROP])
def test_bad_request_id(rid):
    err = decode_error([header(id=rid)])
    assert err.request_id is None and "request id" in str(err)


@pytest.mark.parametrize("field", ["svc", "op"])
@pytest.mark.parametrize("value", [DROP, "", 3, None, "x" * 129])
def test_missing_or_bad_service_and_op(field, value):
    err = decode_error([request_header(id=4, **{field: value})])
    assert err.request_id == 4 and repr(field) in str(err)


def test_service_and_op_at_the_length_limit_are_accepted():
    msg = decode([request_header(svc="s" * 128, op="o" * 128)])
    assert (msg.service, msg.op) == ("s" * 128, "o" * 128)


@pytest.mark.parametrize("src", [3, b"ps:0", "x" * 129])
def test_bad_source(src):
    assert "'src'" in str(decode_error([header(src=src)]))


def test_more_frames_than_tensors():
    good = encode(Message(REPLY, 6, body=np.arange(3)))
    err = decode_error([*good, b"\x00" * 8])
    assert err.request_id == 6 and "1 tensors but 2 tensor frames" in str(err)
    err = decode_error([header(id=6, a=None), b"stray"])
    assert "0 tensors but 1 tensor frames" in str(err)


def test_fewer_frames_than_tensors():
    big = np.arange(PACK_BELOW // 8)  # a frame of its own
    good = encode(Message(REPLY, 6, body=[big, big + 1]))
    err = decode_error(good[:2])
    assert err.request_id == 6 and "2 tensors but 1 tensor frames" in str(err)
    assert "2 tensors but 0" in str(decode_error(good[:1]))
    packed = encode(Message(REPLY, 6, body=[big, np.arange(3), np.arange(2)]))  # the small two in one pack
    assert len(packed) == 3 and len(decode(packed).body) == 3
    err = decode_error(packed[:2])  # the pack is missing
    assert err.request_id == 6 and "frame index 2 is out of range" in str(err)


@pytest.mark.parametrize("size", [0, 15, 17, 32])
def test_frame_size_must_match_the_shape(size):
    err = decode_error(one_tensor(["float32", [2, 2], 1], b"\x00" * size))
    assert err.request_id == 9 and "needs 16 bytes" in str(err) and f"has {size}" in str(err)


@pytest.mark.parametrize("name", ["float128", "object", "str", "<f4", "f4", "Float32", 5, None])
def test_unknown_dtype(name):
    err = decode_error(one_tensor([name, [1], 1], b"\x00" * 4))
    assert "unknown wire dtype" in str(err) and err.request_id == 9


@pytest.mark.parametrize(
    "arr",
    [np.array([1, "a"], dtype=object), np.array(["ab"]), np.array([b"ab"]), np.zeros(2, dtype=[("a", "i4")]),
     np.array(["2020-01-01"], dtype="datetime64[D]"), np.zeros(2, dtype=np.longdouble)],
    ids=["object", "unicode", "bytes", "structured", "datetime", "longdouble"],
)
def test_unsendable_dtypes_are_refused_at_encode(arr):
    with pytest.raises(InvalidArgument, match="cannot be sent"):
        encode(Message(REPLY, 1, body={"x": arr}))


def test_unsendable_python_values_are_refused_at_encode():
    with pytest.raises(InvalidArgument, match="set"):
        encode(Message(REQUEST, 1, "s", "o", {"x": {1, 2}}))


def test_unknown_kind_is_refused_at_encode():
    with pytest.raises(InvalidArgument, match="kind"):
        encode(Message("push", 1))


@pytest.mark.parametrize("shape", [[-1], [2, -2], [1.0], ["2"], [True], 4, None, [1] * 33])
def test_bad_shapes(shape):
    err = decode_error(one_tensor(["uint8", shape, 1], b"\x00"))
    assert "shape" in str(err) and err.request_id == 9


def test_thirty_two_dimensions_are_accepted():
    arr = np.zeros([1] * 32, np.uint8)
    assert roundtrip(Message(REPLY, 1, body=arr)).body.shape == arr.shape


def test_empty_shape_with_an_overflowing_dimension():
    err = decode_error(one_tensor(["float32", [0, 2**62, 2**62], 1], b""))
    assert "too large" in str(err) and err.request_id == 9


@pytest.mark.parametrize("index", [0, 2, -1, 1.0, True, "1", None])
def test_frame_index_out_of_range(index):
    err = decode_error(one_tensor(["uint8", [1], index], b"\x00"))
    assert "frame index" in str(err) and err.request_id == 9


def test_frame_index_reused():
    frames = [header(a=[ref(0), ref(1)], t=[["uint8", [1], 1], ["uint8", [1], 1]]), b"\x01", b"\x02"]
    assert "used twice" in str(decode_error(frames))


def test_frames_may_be_listed_in_any_order():
    frames = [header(a=[ref(0), ref(1)], t=[["uint8", [1], 2], ["uint8", [2], 1]]), b"\x01\x02", b"\x03"]
    a, b = decode(frames).body
    assert a.tolist() == [3] and b.tolist() == [1, 2]


@pytest.mark.parametrize("entry", [["uint8", [1]], ["uint8", [1], 1, 0, 0], "uint8", {"dtype": "uint8"}])
def test_malformed_table_entry(entry):
    assert "entry" in str(decode_error([header(a=ref(0), t=[entry]), b"\x00"]))


@pytest.mark.parametrize("table", [None, {}, "t", 0])
def test_table_that_is_not_a_list(table):
    err = decode_error([header(a=None, t=table)])
    assert "tensor table" in str(err) and err.request_id == 9


def test_frame_over_the_size_limit():
    frames = encode(Message(REPLY, 3, body=np.zeros(4, np.float32)))
    assert decode(frames, Limits(max_frame_bytes=16)).body.shape == (4,)
    err = decode_error(frames, Limits(max_frame_bytes=15))
    assert "exceeds the limit of 15" in str(err) and err.request_id == 3


def test_header_over_the_size_limit():
    frames = encode(Message(REQUEST, 3, "s", "o", {"pad": "x" * 100}))
    size = len(frames[0])
    assert decode(frames, Limits(max_header_bytes=size)).body == {"pad": "x" * 100}
    err = decode_error(frames, Limits(max_header_bytes=size - 1))
    assert "header of" in str(err) and err.request_id == 3 and err.code == "RESOURCE_EXHAUSTED"  # read from its start


def test_too_many_frames():
    frames = encode(Message(REPLY, 3, body=[np.zeros(PACK_BELOW // 8)] * 3))  # too big to share a pack
    assert len(decode(frames, Limits(max_frames=4)).body) == 3
    assert "exceed the limit of 3" in str(decode_error(frames, Limits(max_frames=3)))


def test_container_over_the_length_limit():
    frames = encode(Message(REPLY, 3, body=list(range(50))))
    assert decode(frames, Limits(max_container_len=50)).body == list(range(50))
    decode_error(frames, Limits(max_container_len=49))


def test_nesting_too_deep_is_a_decode_error():
    body: Any = ref(0)
    for _ in range(1000):
        body = [body]
    err = decode_error([header(a=body, t=[["uint8", [1], 1]]), b"\x00"])
    assert "deep" in str(err)
    decode_error([b"\x91" * 5000 + b"\xc0"])


@pytest.mark.parametrize("ext", [msgpack.ExtType(2, b"abcd"), msgpack.ExtType(0, b""), msgpack.ExtType(1, b"\x00" * 8),
                                 msgpack.ExtType(1, b"\x00\x00")])
def test_unknown_extension_type(ext):
    err = decode_error([request_header(id=12, a={"x": ext})])
    assert "extension type" in str(err) and err.request_id == 12 and err.kind == REQUEST


def test_reference_written_as_ext8_is_still_a_reference():
    packed = header(id=2, a={"x": ref(0)}, t=[["uint8", [2], 1]])
    assert packed.count(b"\xd6\x01") == 1
    ext8 = packed.replace(b"\xd6\x01", b"\xc7\x04\x01")
    assert decode([ext8, b"\x05\x06"]).body["x"].tolist() == [5, 6]
    # without tensor frames the reference dangles: it must not leak into the body
    lone = request_header(id=2, a={"x": ref(0)}).replace(b"\xd6\x01", b"\xc7\x04\x01")
    assert "reference to tensor 0" in str(decode_error([lone]))


def test_reference_out_of_range():
    err = decode_error([header(a=[ref(0), ref(1)], t=[["uint8", [1], 1]]), b"\x00"])
    assert "reference to tensor 1" in str(err) and err.request_id == 9


def test_unreferenced_tensor_frame():
    frames = [header(a=ref(1), t=[["uint8", [1], 1], ["uint8", [1], 2]]), b"\x00", b"\x01"]
    err = decode_error(frames)
    assert "tensor frames [1] are not referenced" in str(err)


def test_tensor_referenced_twice_decodes_to_one_array():
    a, b = decode([header(a=[ref(0), ref(0)], t=[["int8", [1], 1]]), b"\x07"]).body
    assert a is b and a.tolist() == [7]


@pytest.mark.parametrize("dl", [0, 0.0, -1, -0.5, float("nan"), float("inf"), float("-inf"), "1", True, [1]])
def test_bad_deadline_values(dl):
    err = decode_error([request_header(id=21, dl=dl)])
    assert "deadline" in str(err) and err.request_id == 21


def test_good_deadline_values():
    assert decode([request_header(dl=3)]).deadline == 3.0
    assert decode([request_header(dl=1e-6)]).deadline == 1e-6
    assert decode([request_header()]).deadline is None
    assert roundtrip(Message(REQUEST, 1, "s", "o", deadline=0.25)).deadline == 0.25


@pytest.mark.parametrize("dl", [0, -1.0, float("nan"), float("inf")])
def test_bad_deadline_is_refused_at_encode(dl):
    with pytest.raises(InvalidArgument, match="deadline"):
        encode(Message(REQUEST, 1, "s", "o", deadline=dl))


@pytest.mark.parametrize(
    "e",
    [None, "boom", [], {"code": 1}, {"message": None}, {"details": []}, {"details": {"k": ref(0)}},
     {"details": {b"k": 1}}],
    ids=["nil", "str", "list", "int-code", "nil-message", "list-details", "tensor-details", "bytes-key-details"],
)
def test_malformed_error_field(e):
    err = decode_error([header(k=ERROR, id=30, e=e, a=DROP)])
    assert err.request_id == 30 and err.kind == ERROR


def test_error_message_with_tensors_is_refused():
    frames = [header(k=ERROR, id=30, e={"code": "X"}, a=ref(0), t=[["uint8", [1], 1]]), b"\x00"]
    assert "no tensors" in str(decode_error(frames))


def test_error_fields_default_to_empty_strings():
    msg = decode([header(k=ERROR, e={"code": "NOT_FOUND", "extra": 1})])
    assert msg.error == {"code": "NOT_FOUND", "type": "", "message": "", "traceback": ""}


_BIG = [0] * 500_000  # a field any peer may send: up to the header's limits, 500k elements here


@pytest.mark.parametrize(
    "frames, named",
    [
        ([header(v=_BIG, id=5)], "protocol version"),
        ([header(v=b"1" * 1_000_000, id=5)], "protocol version"),
        ([header(k="\u00e9" * 1_000_000, id=8)], "kind"),
        ([header(id=_BIG)], "request id"),
        ([request_header(id=21, dl=_BIG)], "deadline"),
        ([request_header(id=21, dl="9" * 1_000_000)], "deadline"),
        (one_tensor(["uint8", _BIG, 1], b""), "shape"),
        (one_tensor(["uint8", [[0] * 100_000], 1], b""), "shape"),
        (one_tensor(["uint8", [1], _BIG], b"\x00"), "frame index"),
        (one_tensor(["f" * 1_000_000, [1], 1], b"\x00"), "unknown wire dtype"),
        (one_tensor([_BIG, [1], 1], b"\x00"), "unknown wire dtype"),
    ],
    ids=["version", "version-bin", "kind", "id", "deadline", "deadline-str", "shape", "shape-nested", "index",
         "dtype", "dtype-list"],
)
def test_a_refusal_quotes_what_the_peer_sent_briefly_however_large(frames, named):
    """An error reply must not grow with the field it refuses (a 1 MB shape once made a 3 MB reply)."""
    err = decode_error(frames)
    assert named in str(err) and len(str(err)) < 200
