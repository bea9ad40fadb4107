"""The compiled codec (``zmqflow/wire/codec_c.c``) against the Python one it stands in for, and
its batch envelope join and split against ``wire/batch.py``'s own loops.

It must write the same bytes for every request and reply, and whenever it reads a message, read
exactly what the Python codec reads; anything else it hands back (None), and the Python codec
then decides. These tests call both sides directly, on generated, mutated and hand-made frames.
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqflow.wire import codec
from zmqflow.wire.batch import decode_batch, encode_batch
from zmqflow.wire.codec import DecodeError, Limits, Message, decode, encode
from zmqflow.wire.message import ERROR, REPLY, REQUEST
from zmqflow.wire.requests.ps import Assign, Pull, PullItem, RowsItem

from .test_fuzz import FAST, SMALL, messages, mutated, same, values

pytestmark = [pytest.mark.skipif(codec._built is None, reason="the compiled codec (zmqflow/wire/codec_c.c) is not "
                                 "built here: the Python codec runs alone, and test_codec/test_fuzz test it"),
              pytest.mark.usefixtures("compiled_codec")]




def python_encode(msg: Message) -> list[Any]:
    codec.use_compiled(False)
    try:
        return encode(msg)
    finally:
        codec.use_compiled(True)


def python_decode(frames: list[Any], limits: Limits = Limits()) -> Message | DecodeError:
    codec.use_compiled(False)
    try:
        return decode(frames, limits)
    except DecodeError as exc:
        return exc
    finally:
        codec.use_compiled(True)


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


def assert_same_message(a: Message, b: Message) -> None:
    assert (a.kind, a.id, a.service, a.op, a.deadline, a.source, a.error) == (
        b.kind, b.id, b.service, b.op, b.deadline, b.source, b.error)
    assert type(a.deadline) is type(b.deadline)
    assert same(a.body, b.body) and same(b.body, a.body)


def check_read(frames: list[Any], limits: Limits = Limits()) -> Message | None:
    """What the compiled reader makes of ``frames``; when it reads them, the Python codec must
    read the same message."""
    fast = codec._built.decode(list(frames), limits)
    if fast is not None:
        slow = python_decode(list(frames), limits)
        assert isinstance(slow, Message), f"compiled codec read what the Python codec refuses: {slow}"
        assert_same_message(fast, slow)
    return fast


# writing --------------------------------------------------------------------------------------


@FAST
@given(messages())
def test_both_codecs_write_the_same_frames(msg):
    assert as_bytes(encode(msg)) == as_bytes(python_encode(msg))


class Color(enum.IntEnum):
    RED = 3


class Name(str):
    pass


ODD_BODIES = [
    None, 0, -1, -32, -33, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63,
    (1 << 64) - 1, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63), 1.5, float("inf"),
    "x" * 31, "x" * 32, "x" * 255, "x" * 256, "é" * 40000, b"", b"b" * 300, b"b" * 70000,
    list(range(15)), list(range(16)), list(range(70000)), {str(i): i for i in range(16)},
    (1, (2, 3)), {1: "int key", b"k": "bytes key"}, {"x": np.float32(2.5), "n": np.int64(7)},
    {"c": Color.RED, "s": Name("sub")}, bytearray(b"ba"), [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    {"t": np.arange(12, dtype=np.float32).reshape(3, 4).T, "b": np.arange(4, dtype=">i4"), "e": np.zeros((0, 3))},
    np.float64(3.0), np.arange(5), [np.ones(2)] * 3, msgpack.ExtType(5, b"abc"),
    Pull(items=[PullItem("w", 0, None, 4), PullItem("b", 1, 2, None)]),
    Assign(items=[RowsItem("w", 0, 0, 2, np.ones((2, 3), np.float32))], mode="add"),
]


@pytest.mark.parametrize("body", ODD_BODIES, ids=lambda b: type(b).__name__)
@pytest.mark.parametrize("kind", [REQUEST, REPLY])
def test_unusual_bodies_give_the_same_frames_or_the_same_error(kind, body):
    msg = Message(kind, 7, "svc", "op", body, 2.0 if kind == REQUEST else None, "src")
    try:
        want = as_bytes(python_encode(msg))
    except Exception as exc:  # the compiled path must refuse it the same way
        with pytest.raises(type(exc)):
            encode(msg)
        return
    assert as_bytes(encode(msg)) == want


def test_the_compiled_writer_takes_the_common_case():
    frames = codec._built.encode(True, 1, "worker", "sink", 30.0, "c", {"x": np.zeros(4), "n": 2})
    assert frames is not None and len(frames) == 2
    assert codec._built.encode(False, 1, "", "", None, "", [1, "two", None]) is not None
    declared = Assign(items=[RowsItem("w", 0, None, None, np.ones(3, np.float32))], mode="add")
    assert codec._built.encode(True, 1, "ps", "assign", 30.0, "", declared) is not None


class Counting:
    """The compiled module, counting the messages it wrote."""

    def __init__(self) -> None:
        self.written = 0

    def encode(self, *args: Any) -> Any:
        out = codec._built.encode(*args)
        self.written += out is not None
        return out


def test_a_whole_number_deadline_takes_the_compiled_path(monkeypatch):
    counting = Counting()
    monkeypatch.setattr(codec, "_fast", counting)
    msg = Message(REQUEST, 1, "s", "o", {"n": 1}, 30, "")  # a session's timeout may be an int
    frames = encode(msg)
    assert counting.written == 1
    monkeypatch.setattr(codec, "_fast", None)
    assert as_bytes(frames) == as_bytes(encode(msg))


# reading --------------------------------------------------------------------------------------


@FAST
@given(messages(), st.sampled_from(["bytes", "memoryview"]))
def test_what_the_compiled_codec_reads_the_python_codec_reads_alike(msg, form):
    frames = as_bytes(python_encode(msg))
    if form == "memoryview":  # as batch entries arrive: views into one frame
        frames = [memoryview(f) for f in frames]
    for limits in (Limits(), SMALL):
        check_read(frames, limits)


@FAST
@given(mutated())
def test_mutated_frames_are_read_alike_or_handed_back(frames):
    for limits in (Limits(), SMALL):
        check_read(frames, limits)


@FAST
@given(values)
def test_plain_requests_and_replies_take_the_compiled_path(body):
    for msg in (Message(REQUEST, 9, "s", "o", body, 1.0, "me"), Message(REPLY, 9, body=body)):
        frames = as_bytes(python_encode(msg))
        assert check_read(frames) is not None


def head(**fields: Any) -> bytes:
    base = {"v": 1, "k": REQUEST, "id": 5, "svc": "s", "op": "o", "a": {"n": 1}, "t": []}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not _GONE}, use_bin_type=True)


_GONE = object()
REF0 = msgpack.ExtType(1, b"\0\0\0\0")
TABLE = [["float32", [2], 1]]
DATA = np.ones(2, np.float32).tobytes()

HANDED_BACK = {
    "error kind": [head(k=ERROR, e={"code": "X"})],
    "unknown field": [head(x=1)],
    "no version": [head(v=_GONE)],
    "version 2": [head(v=2)],
    "bool version": [head(v=True)],
    "negative id": [head(id=-1)],
    "unknown kind": [head(k="bat")],
    "empty op": [head(op="")],
    "long service": [head(svc="s" * 129)],
    "bytes source": [head(src=b"me")],
    "zero deadline": [head(dl=0.0)],
    "infinite deadline": [head(dl=float("inf"))],
    "string deadline": [head(dl="soon")],
    "reply with an op": [head(k=REPLY, svc=_GONE, op="o")],
    "other extension": [head(a={"x": msgpack.ExtType(2, b"\0\0\0\0")})],
    "reference outside the body": [head(src=REF0)],
    "reference past the table": [head(a=REF0, t=[])],
    "unreferenced tensor": [head(t=TABLE), DATA],
    "table and frames disagree": [head(a=REF0, t=TABLE)],
    "wrong frame size": [head(a=REF0, t=TABLE), DATA + b"x"],
    "unknown dtype": [head(a=REF0, t=[["float128", [2], 1]]), DATA],
    "negative dimension": [head(a=REF0, t=[["float32", [-2], 1]]), DATA],
    "frame index twice": [head(a=[REF0, REF0], t=[["float32", [2], 1], ["float32", [2], 1]]), DATA, DATA],
    "trailing bytes": [head() + b"\xc0"],
    "truncated": [head()[:-1]],
    "not a map": [msgpack.packb([1, 2])],
    "int map key": [head(a={1: 2})],
    "bad utf-8": [b"\x84\xa1v\x01\xa1k\xa3rep\xa2id\x05\xa3src\xa2\xff\xfe"],
}


@pytest.mark.parametrize("frames", list(HANDED_BACK.values()), ids=list(HANDED_BACK))
def test_what_the_compiled_codec_does_not_take_goes_to_the_python_codec(frames):
    assert codec._built.decode(list(frames), Limits()) is None
    got = python_decode(list(frames))
    try:
        decoded: Message | DecodeError = decode(list(frames))
    except DecodeError as exc:
        decoded = exc
    assert type(decoded) is type(got) and str(decoded) == str(got)


def test_a_repeated_key_is_handed_back():
    body = b"\x82\xa1x\x01\xa1x\x02"  # {"x": 1, "x": 2}: msgpack keeps the last
    frames = [b"\x85\xa1v\x01\xa1k\xa3rep\xa2id\x05\xa1a" + body + b"\xa1t\x90"]
    assert codec._built.decode(frames, Limits()) is None
    assert decode(frames).body == {"x": 2}


def test_tensors_anywhere_in_the_body_are_read_alike():
    arrays = [np.arange(6, dtype=np.int16).reshape(2, 3), np.float64(1.5) * np.ones(()), np.zeros(0, np.uint8)]
    body = {"a": arrays[0], "l": [arrays[1], {"deep": arrays[2]}], "again": arrays[0]}
    frames = as_bytes(python_encode(Message(REPLY, 3, body=body)))
    assert check_read(frames) is not None
    shared = [head(a=[REF0, {"x": REF0}], t=TABLE), DATA]  # one tensor referenced twice: one array
    got = check_read(shared)
    assert got is not None and got.body[0] is got.body[1]["x"]
    whole = as_bytes(python_encode(Message(REPLY, 4, body=arrays[0])))
    assert same(check_read(whole).body, arrays[0])


@pytest.mark.parametrize("count", [64, 65, 200, 4000])
def test_many_tensors_are_read_by_the_compiled_codec_alike(count: int):
    """Past the 64 references read without an allocation (a model of hundreds of variables
    pushes as many tensors): read alike, in lists and maps."""
    arrays = [np.full(3, i, np.float32) for i in range(count)]
    body = {"l": arrays[:count // 2], "m": {f"v{i}": a for i, a in enumerate(arrays[count // 2:])}, "x": arrays[0]}
    frames = as_bytes(python_encode(Message(REQUEST, 9, "ps", "push", body, 5.0)))
    got = check_read(frames)
    assert got is not None and len(got.body["l"]) + len(got.body["m"]) == count
    assert [int(a[0]) for a in got.body["l"]] == list(range(count // 2)) and int(got.body["x"][0]) == 0
    unnamed = frames[:-1]  # the table names a frame that is not there: handed back, refused by the Python codec
    assert codec._built.decode(unnamed, Limits()) is None and isinstance(python_decode(unnamed), DecodeError)
    over = Limits(max_frame_bytes=len(frames[-1]) - 1)  # the pack's
    assert codec._built.decode(frames, over) is None  # over a limit: the Python codec decides


def test_non_canonical_encodings_read_alike():
    raw = b"\x86\xa1v\xcc\x01\xa1k\xa3rep\xa2id\xcf" + (5).to_bytes(8, "big") + b"\xa1a\xca\x3f\xc0\x00\x00" + \
        b"\xa3src\xd9\x02me\xa1t\xdc\x00\x00"
    got = check_read([raw])
    assert got is not None and (got.id, got.body, got.source) == (5, 1.5, "me")


def test_limits_are_never_loosened():
    deep = Message(REPLY, 1, body=[[[[[1]]]]])  # the innermost list at depth 6 (the header map is 1)
    frames = as_bytes(python_encode(deep))
    assert check_read(frames, Limits(max_depth=6)) is not None
    assert codec._built.decode(frames, Limits(max_depth=5)) is None
    assert isinstance(python_decode(frames, Limits(max_depth=5)), DecodeError)
    long = as_bytes(python_encode(Message(REPLY, 1, body=list(range(10)))))
    assert codec._built.decode(long, Limits(max_container_len=9)) is None
    big = as_bytes(python_encode(Message(REPLY, 1, body=np.zeros(8, np.uint8))))
    assert codec._built.decode(big, Limits(max_frame_bytes=7)) is None
    assert codec._built.decode(big, Limits(max_message_bytes=7)) is None
    assert codec._built.decode(big, Limits(max_frames=1)) is None
    assert codec._built.decode(big, Limits(max_header_bytes=len(big[0]) - 1)) is None


# the batch envelope ---------------------------------------------------------------------------

frame_st = st.one_of(st.binary(max_size=40), st.binary(max_size=40).map(lambda b: np.frombuffer(b, np.uint8)),
                     st.binary(max_size=40).map(memoryview))


@FAST
@given(st.lists(st.lists(frame_st, min_size=1, max_size=4), min_size=1, max_size=6), st.integers(0, (1 << 64) - 1))
def test_both_paths_join_and_split_envelopes_alike(entries, bid):
    frames = encode_batch(bid, entries)
    codec.use_compiled(False)
    try:
        assert as_bytes(frames) == as_bytes(encode_batch(bid, entries))
        slow = decode_batch(as_bytes(frames))
    finally:
        codec.use_compiled(True)
    fast = decode_batch(as_bytes(frames))
    assert [[bytes(f) for f in e] for e in fast.entries] == [[bytes(f) for f in e] for e in slow.entries] == [
        [bytes(memoryview(f)) for f in e] for e in entries]


SPLIT_HANDED_BACK = {
    "empty entry": [[]],
    "length not an int": [[1.0]],
    "negative length": [[-1]],
    "too many frames": [[1] * 5],
    "past the end": [[9]],
    "bytes left over": [[1]],
    "not a list": [(1,)],
}


@pytest.mark.parametrize("table", list(SPLIT_HANDED_BACK.values()), ids=list(SPLIT_HANDED_BACK))
def test_a_table_the_compiled_split_does_not_take_is_refused_by_name(table):
    data = memoryview(b"12345678\x00\x00")[: 8 if table != [[1]] else 10]
    assert codec._built.split(table, data, 4) is None
    header = msgpack.packb({"v": 1, "k": "bat", "id": 3, "n": table}, use_bin_type=True)
    with pytest.raises(DecodeError, match="batch envelope 3 refused"):
        decode_batch([header, bytes(data)], Limits(max_frames=4))


def test_frames_that_are_not_buffers_are_joined_by_the_python_path():
    with pytest.raises(TypeError):
        codec._built.join([[b"ok", 5]])
    with pytest.raises(TypeError):  # the Python path's own error, as before
        encode_batch(1, [[b"ok", 5]])
