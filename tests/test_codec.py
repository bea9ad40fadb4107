"""The wire codec: round trips, zero copy, golden vectors, errors as data."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from zmqflow import errors
from zmqflow.errors import InvalidArgument, RemoteError, VersionMismatch
from zmqflow.wire import ERROR, REPLY, REQUEST, Message, decode, encode
from zmqflow.wire import error_message, raise_error
from zmqflow.wire.dtypes import WIRE_DTYPES
from zmqflow.wire.tensors import PACK_BELOW

from .codec_helpers import VECTORS, mv, roundtrip, decode_error, assert_same, sample, SHAPES


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
    for arr in inputs:  # alone in its message, an array has a frame of its own
        frames = encode(Message(REPLY, 1, body=[arr]))
        assert len(frames) == 2 and bytes(memoryview(frames[1])) == np.ascontiguousarray(arr).tobytes()
    frames = encode(Message(REPLY, 1, body=inputs))  # together, these small ones share a pack
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
    assert len(frames) == 2 and len(frames[1]) == 32 + arr.nbytes  # both in one pack, the second at 32
    a, b = decode(frames).body
    np.testing.assert_array_equal(a, b)
    assert not np.shares_memory(a, b)
    big = np.arange(PACK_BELOW)
    assert len(encode(Message(REPLY, 1, body=[big, big]))) == 3


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
