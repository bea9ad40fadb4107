"""The wire codec: round trips, zero copy, golden vectors, and every way a message can be malformed."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from zmqflow import errors
from zmqflow.errors import InvalidArgument, ProtocolError, RemoteError, VersionMismatch
from zmqflow.wire import ERROR, REPLY, REQUEST, VERSION, DecodeError, Limits, Message, decode, encode
from zmqflow.wire import error_message, raise_error
from zmqflow.wire.dtypes import WIRE_DTYPES

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "protocol" / "vectors"


def _load_make_vectors():
    spec = importlib.util.spec_from_file_location("make_vectors", ROOT / "protocol" / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mv = _load_make_vectors()


# helpers ----------------------------------------------------------------------------------


def roundtrip(msg: Message) -> Message:
    return decode([bytes(memoryview(f)) for f in encode(msg)])


def ref(i: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack(">I", i))


def header(**fields: Any) -> bytes:
    base: dict[str, Any] = {"v": VERSION, "k": REPLY, "id": 9}
    base.update(fields)
    base.setdefault("t", [])
    return msgpack.packb({k: v for k, v in base.items() if v is not _DROP}, use_bin_type=True)


_DROP = object()


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


# round trips ------------------------------------------------------------------------------


def test_bfloat16_is_known_before_ml_dtypes_is_imported_and_decodes_once_it_arrives():
    """A process imports ml_dtypes (2.6 MB resident) only once a bfloat16 is looked up, sent or received."""
    if importlib.util.find_spec("ml_dtypes") is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    script = (
        "import sys, numpy as np\n"
        "from zmqflow.wire import REQUEST, Message, decode, encode\n"
        "from zmqflow.wire.dtypes import WIRE_DTYPES\n"
        "assert 'bfloat16' in WIRE_DTYPES and 'bfloat16' in sorted(WIRE_DTYPES) and 'ml_dtypes' not in sys.modules\n"
        "frames = encode(Message(REQUEST, 1, 's', 'op', {'x': np.arange(4, dtype=np.uint16)}))\n"
        "frames[0] = frames[0].replace(b'\\xa6uint16', b'\\xa8bfloat16')\n"
        "x = decode(frames).body['x']\n"
        "assert x.dtype.name == 'bfloat16' and 'ml_dtypes' in sys.modules, x.dtype\n"
        "assert x.view(np.uint16).tolist() == [0, 1, 2, 3]\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_every_dtype_and_shape_round_trips(name):
    rng = np.random.default_rng(1)
    dtype = WIRE_DTYPES[name]
    arrays = [sample(dtype, shape, rng) for shape in SHAPES]
    got = roundtrip(Message(REQUEST, 1, "s", "o", {"xs": arrays})).body
    assert_same({"xs": arrays}, got)
    for arr in got["xs"]:
        assert arr.dtype == dtype


@pytest.mark.parametrize("name", ["int16", "int64", "uint32", "float16", "float32", "float64", "complex128"])
def test_big_endian_input_arrives_equal_and_little_endian(name):
    arr = sample(WIRE_DTYPES[name], (3, 4), np.random.default_rng(2)).astype(WIRE_DTYPES[name].newbyteorder(">"))
    frames = encode(Message(REPLY, 1, body=arr))
    assert bytes(memoryview(frames[1])) == arr.astype(WIRE_DTYPES[name]).tobytes()
    got = decode(frames).body
    assert got.dtype == WIRE_DTYPES[name] and got.dtype.byteorder in "=<"
    np.testing.assert_array_equal(got, arr)


def test_fortran_and_strided_input_arrive_equal_and_c_ordered():
    base = np.arange(60, dtype=np.float64).reshape(3, 4, 5)
    inputs = [
        np.asfortranarray(base),
        base[:, ::2, ::-1],
        base.transpose(2, 0, 1),
        base[:, 1],
        np.arange(10, dtype=np.int32)[::3],
    ]
    assert not any(a.flags.c_contiguous for a in inputs)
    frames = encode(Message(REPLY, 1, body=inputs))
    for arr, frame in zip(inputs, frames[1:]):
        assert bytes(memoryview(frame)) == np.ascontiguousarray(arr).tobytes()
    got = decode(frames).body
    for sent, arrived in zip(inputs, got):
        assert arrived.flags.c_contiguous and arrived.shape == sent.shape
        np.testing.assert_array_equal(arrived, sent)


def test_c_contiguous_little_endian_arrays_are_sent_without_copy():
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    frames = encode(Message(REPLY, 1, body={"x": arr}))
    assert np.shares_memory(np.asarray(frames[1]), arr)


def test_header_keys_come_in_the_fixed_order():
    def keys(msg: Message) -> list[str]:
        return [k for k, _ in msgpack.unpackb(encode(msg)[0], object_pairs_hook=list, ext_hook=lambda c, d: None)]

    full = Message(REQUEST, 1, "ps", "pull", {"a": 1}, deadline=1.5, source="worker:0")
    assert keys(full) == ["v", "k", "id", "svc", "op", "dl", "src", "a", "t"]
    assert keys(Message(REQUEST, 1, "ps", "pull")) == ["v", "k", "id", "svc", "op", "a", "t"]
    assert keys(Message(REPLY, 1, body=np.zeros(2), source="ps:0")) == ["v", "k", "id", "src", "a", "t"]
    err = error_message(1, InvalidArgument("x"), source="ps:0")
    assert keys(err) == ["v", "k", "id", "src", "e", "t"]


def test_plain_values_and_numpy_scalars_round_trip():
    body = {"i": -(2**63), "u": 2**64 - 1, "f": 0.1, "nan": float("nan"), "s": "ü", "b": b"\x00\xff", "n": None,
            "t": True, "l": [], "d": {}, "tuple": (1, 2)}
    got = roundtrip(Message(REQUEST, 2**64 - 1, "s", "o", body)).body
    assert_same(body, got)
    scalars = roundtrip(Message(REPLY, 1, body=[np.float32(1.5), np.int64(-3), np.bool_(True)])).body
    assert scalars == [1.5, -3, True] and [type(v) for v in scalars] == [float, int, bool]


def test_one_array_sent_twice_travels_twice():
    arr = np.arange(3)
    frames = encode(Message(REPLY, 1, body=[arr, arr]))
    assert len(frames) == 3
    a, b = decode(frames).body
    np.testing.assert_array_equal(a, b)


# zero copy on receipt ---------------------------------------------------------------------


def test_decoded_array_shares_memory_with_a_bytearray_frame():
    frames = encode(Message(REPLY, 1, body=np.arange(16, dtype=np.int32)))
    buf = bytearray(memoryview(frames[1]))
    arr = decode([frames[0], buf]).body
    assert np.shares_memory(arr, np.frombuffer(buf, np.uint8))
    assert arr.flags.writeable
    buf[0:4] = (1234).to_bytes(4, "little")
    assert arr[0] == 1234


def test_decoded_array_shares_memory_with_a_zmq_frame():
    frames = encode(Message(REPLY, 1, body={"w": np.ones((256, 256), np.float32)}))
    zframes = [zmq.Frame(bytes(memoryview(f))) for f in frames]
    arr = decode(zframes).body["w"]
    assert np.shares_memory(arr, np.frombuffer(zframes[1].buffer, np.uint8))
    assert arr.shape == (256, 256) and float(arr.sum()) == 65536.0


def test_arrays_from_bytes_frames_are_read_only():
    arr = roundtrip(Message(REPLY, 1, body=np.arange(4))).body
    assert not arr.flags.writeable


# golden vectors ---------------------------------------------------------------------------

VECTOR_FILES = sorted(VECTORS.glob("*.json"))
VALID = [p for p in VECTOR_FILES if json.loads(p.read_text())["decoded"] is not None]
INVALID = [p for p in VECTOR_FILES if json.loads(p.read_text())["decoded"] is None]


def test_vector_set_covers_the_required_cases():
    names = {p.stem for p in VECTOR_FILES}
    required = {"request_ping", "request_tensors", "request_all_dtypes", "request_deadline_source", "reply_tensor",
                "reply_plain", "error_reply", "invalid_version"}
    assert required <= names
    if "bfloat16" in WIRE_DTYPES:
        assert "request_bfloat16" in names


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_golden_vector_decodes_to_its_decoded_form(path):
    vector = json.loads(path.read_text())
    assert vector["name"] == path.stem and vector["description"]
    frames = [bytes.fromhex(h) for h in vector["frames_hex"]]
    msg = decode(frames)
    expected = vector["decoded"]
    assert (msg.kind, msg.id, msg.service, msg.op, msg.deadline, msg.source, msg.error) == (
        expected["kind"], expected["id"], expected["service"], expected["op"], expected["deadline"],
        expected["source"], expected["error"],
    )
    assert_same(mv.from_json_value(expected["body"]), msg.body)
    assert mv.to_json_value(msg.body) == expected["body"]


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_golden_vector_re_encodes_to_the_same_bytes(path):
    vector = json.loads(path.read_text())
    frames = encode(mv.message_from_json(vector["decoded"]))
    assert [bytes(memoryview(f)).hex() for f in frames] == vector["frames_hex"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_golden_invalid_vector_is_refused(path):
    vector = json.loads(path.read_text())
    err = decode_error([bytes.fromhex(h) for h in vector["frames_hex"]])
    expect = vector["expect"]
    assert isinstance(err, VersionMismatch) == (expect["error"] == "VersionMismatch")
    assert err.request_id == expect["request_id"]


def test_committed_vectors_match_the_generator(tmp_path):
    assert mv.main(["make_vectors", str(tmp_path)]) == 0
    generated = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in VECTOR_FILES}
    assert set(committed) - set(generated) == set()
    extra = set(generated) - set(committed)
    assert extra <= {"request_bfloat16.json"}
    for name, text in committed.items():
        assert generated[name] == text, f"{name} drifted from protocol/make_vectors.py"


# malformed input --------------------------------------------------------------------------


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


@pytest.mark.parametrize("version", [0, 2, "1", True, 1.0, None, _DROP])
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


@pytest.mark.parametrize("rid", [-1, 1.0, "1", True, None, [1], _DROP])
def test_bad_request_id(rid):
    err = decode_error([header(id=rid)])
    assert err.request_id is None and "request id" in str(err)


@pytest.mark.parametrize("field", ["svc", "op"])
@pytest.mark.parametrize("value", [_DROP, "", 3, None, "x" * 129])
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
    good = encode(Message(REPLY, 6, body=[np.arange(3), np.arange(2)]))
    err = decode_error(good[:2])
    assert err.request_id == 6 and "2 tensors but 1 tensor frames" in str(err)
    assert "2 tensors but 0" in str(decode_error(good[:1]))


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


@pytest.mark.parametrize("entry", [["uint8", [1]], ["uint8", [1], 1, 0], "uint8", {"dtype": "uint8"}])
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
    frames = encode(Message(REPLY, 3, body=[np.zeros(1)] * 3))
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
    err = decode_error([header(k=ERROR, id=30, e=e, a=_DROP)])
    assert err.request_id == 30 and err.kind == ERROR


def test_error_message_with_tensors_is_refused():
    frames = [header(k=ERROR, id=30, e={"code": "X"}, a=ref(0), t=[["uint8", [1], 1]]), b"\x00"]
    assert "no tensors" in str(decode_error(frames))


def test_error_fields_default_to_empty_strings():
    msg = decode([header(k=ERROR, e={"code": "NOT_FOUND", "extra": 1})])
    assert msg.error == {"code": "NOT_FOUND", "type": "", "message": "", "traceback": ""}


# errors as data ---------------------------------------------------------------------------

KNOWN = [
    errors.ConfigError, errors.AddressInUse, errors.ClusterNotReady, errors.Unavailable, errors.DeadlineExceeded,
    errors.NotFound, errors.Recovering, errors.InvalidArgument, errors.VariableConflict, errors.CollectiveMismatch,
    errors.PermissionDenied, errors.Unauthenticated, errors.ResourceExhausted, errors.ShardStateLost,
    errors.ProtocolError, errors.VersionMismatch,
]


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


@pytest.mark.parametrize("cls", KNOWN, ids=lambda c: c.__name__)
def test_known_error_codes_round_trip_to_their_class(cls):
    exc = _raised(cls(f"{cls.__name__} happened", task="ps:0"))
    msg = roundtrip(error_message(17, exc, source="ps:0", with_traceback=True))
    assert msg.kind == ERROR and msg.id == 17 and msg.source == "ps:0"
    assert msg.error["code"] == cls.code and msg.error["type"] == cls.__name__
    with pytest.raises(cls) as info:
        raise_error(msg, context="from ps.pull")
    got = info.value
    assert type(got) is cls
    assert got.message == f"{cls.__name__} happened (from ps.pull)"
    assert got.details == {"task": "ps:0", "remote_type": cls.__name__}
    assert f"{cls.__name__} happened" in got.remote_traceback and "Traceback" in got.remote_traceback


def test_all_known_codes_are_covered():
    assert {c.code for c in KNOWN} == set(errors._BY_CODE)


def test_plain_exception_becomes_remote_error_with_its_type():
    msg = roundtrip(error_message(3, _raised(ZeroDivisionError("division by zero")), with_traceback=True))
    assert msg.error["code"] == "INTERNAL" and msg.error["type"] == "ZeroDivisionError"
    with pytest.raises(RemoteError) as info:
        raise_error(msg)
    assert info.value.remote_type == "ZeroDivisionError"
    assert info.value.message == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in info.value.remote_traceback


def test_unknown_code_becomes_remote_error():
    msg = Message(ERROR, 4, error={"code": "QUOTA", "type": "QuotaExceeded", "message": "too many", "traceback": "tb"})
    with pytest.raises(RemoteError) as info:
        raise_error(roundtrip(msg))
    assert info.value.remote_type == "QuotaExceeded" and info.value.remote_traceback == "tb"
    assert "too many" in str(info.value)


def test_details_round_trip():
    exc = errors.ClusterNotReady("2 tasks missing", missing=("worker:1", "ps:0"), waited=1.5, count=2, ok=False,
                                 none=None, shape=(3, 4), obj=object(), arr=np.zeros(2), mixed=[1, object()])
    msg = roundtrip(error_message(5, exc, with_traceback=False))
    assert msg.error["traceback"] == ""
    assert msg.error["details"] == {"missing": ["worker:1", "ps:0"], "waited": 1.5, "count": 2, "ok": False,
                                    "none": None, "shape": [3, 4]}
    with pytest.raises(errors.ClusterNotReady) as info:
        raise_error(msg)
    assert info.value.missing == ["worker:1", "ps:0"] and info.value.details["shape"] == [3, 4]


def test_error_without_details_has_no_details_key():
    msg = roundtrip(error_message(5, _raised(errors.NotFound("no variable 'w'"))))
    assert "details" not in msg.error


def test_reserved_detail_keys_do_not_break_raise_error():
    e = {"code": "NOT_FOUND", "type": "NotFound", "message": "gone", "traceback": "",
         "details": {"message": "x", "remote_traceback": "y", "var": "w"}}
    with pytest.raises(errors.NotFound) as info:
        raise_error(decode(encode(Message(ERROR, 1, error=e))))
    assert info.value.message == "gone" and info.value.details == {"var": "w", "remote_type": "NotFound"}


# randomized round trip --------------------------------------------------------------------


def _random_value(rng: random.Random, nprng: np.random.Generator, depth: int) -> Any:
    choice = rng.randrange(12 if depth < 4 else 9)
    if choice == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if choice == 1:
        return rng.choice([0.0, -0.0, 1e308, -1e-308, float("inf"), float("nan"), rng.uniform(-1e6, 1e6)])
    if choice == 2:
        return "".join(rng.choice("abcü€ \n\x00") for _ in range(rng.randrange(20)))
    if choice == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(20)))
    if choice == 4:
        return rng.choice([None, True, False])
    if choice in (5, 6, 7, 8):
        name = rng.choice(sorted(WIRE_DTYPES))
        shape = tuple(rng.randrange(4) for _ in range(rng.randrange(4)))
        arr = sample(WIRE_DTYPES[name], shape, nprng)
        layout = rng.randrange(4)
        if layout == 1 and arr.ndim >= 2:
            arr = np.asfortranarray(arr)
        elif layout == 2 and arr.ndim >= 1:
            arr = arr[::-1]
        elif layout == 3 and arr.dtype.itemsize > 1 and arr.dtype.kind in "iufc":
            arr = arr.astype(arr.dtype.newbyteorder(">"))
        return arr
    if choice in (9, 10):
        return [_random_value(rng, nprng, depth + 1) for _ in range(rng.randrange(5))]
    return {f"k{i}": _random_value(rng, nprng, depth + 1) for i in range(rng.randrange(5))}


def test_randomized_round_trips():
    rng = random.Random(20240607)
    nprng = np.random.default_rng(20240607)
    for i in range(300):
        body = _random_value(rng, nprng, 0)
        kind = rng.choice([REQUEST, REPLY])
        deadline = rng.choice([None, rng.uniform(1e-3, 1e3)])
        msg = Message(kind, rng.randrange(2**64), "svc", "op", body, deadline=deadline, source=rng.choice(["", "w:1"]))
        got = roundtrip(msg)
        assert (got.kind, got.id, got.source) == (msg.kind, msg.id, msg.source), i
        if kind == REQUEST:
            assert (got.service, got.op, got.deadline) == ("svc", "op", deadline)
        assert_same(body, got.body)
