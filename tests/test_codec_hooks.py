"""The compiled codec (``zmqflow/wire/codec_c.c``) where Python code runs in the middle of a call:
a value's hook (``_extract`` calling a numpy scalar's ``item``, a frame's ``nbytes``) that
changes the list or dict being written, an entry that can be read only once, limits past what a
C integer holds, a struct field holding its own NaN default. Whatever the compiled path does, the
bytes sent are the Python codec's, or the call raises cleanly; nothing stale goes out."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from zmqflow.wire import codec
from zmqflow.wire.batch import decode_batch, encode_batch
from zmqflow.wire.codec import DecodeError, Limits, Message, decode, encode
from zmqflow.wire.message import REPLY, REQUEST

ROOT = Path(__file__).resolve().parent.parent
fast = codec.compiled_module()
pytestmark = [pytest.mark.skipif(fast is None, reason="the compiled codec (zmqflow/wire/codec_c.c) is not built here"),
              pytest.mark.usefixtures("compiled_codec")]




def python_side(make: Callable[[], Any]) -> Any:
    codec.use_compiled(False)
    try:
        return make()
    finally:
        codec.use_compiled(True)


class Hooked(np.float64):
    """A numpy scalar whose ``item`` (the codec's _extract calls it) runs ``act`` once."""

    act: Callable[[], None] | None

    def __new__(cls, value: float, act: Callable[[], None]) -> Hooked:
        made = super().__new__(cls, value)
        made.act = act
        return made

    def item(self) -> float:  # type: ignore[override]
        act, self.act = self.act, None
        if act is not None:
            act()
        return float(self)


# a list or dict changed while it is written ---------------------------------------------------


def test_a_list_shrunk_by_a_hook_is_sent_as_it_now_is():
    kept: list[Any] = []  # the item taken out stays alive: only the list's size changes
    body: list[Any] = []
    body += [Hooked(1.5, lambda: kept.append(body.pop())), "a", "b", "c"]
    assert fast.encode(False, 1, "", "", None, "", body) is None  # handed back to the Python codec
    body = []
    body += [Hooked(1.5, lambda: kept.append(body.pop())), "a", "b", "c"]
    assert decode(encode(Message(REPLY, 1, body=body))).body == [1.5, "a", "b"]


EMPTIED = """
import numpy as np
from zmqflow.wire import codec

class Hooked(np.float64):
    def item(self):
        body.clear()  # the list's array freed, and every item with it
        return float(self)

class Frame:
    @property
    def nbytes(self):
        frames.clear()
        return 1

body = [Hooked(1.5)] + [object() for _ in range(20)]
print(codec.compiled_module().encode(False, 1, "", "", None, "", body), body)
frames = [Frame()] + [object() for _ in range(20)]
print(codec.compiled_module().nbytes(frames), frames)
"""


def test_a_list_emptied_by_a_hook_is_handed_back():
    """In a process of its own: reading the freed items would crash it."""
    done = subprocess.run([sys.executable, "-c", EMPTIED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == ["None []", "1 []", ""]


def test_a_list_grown_by_a_hook_is_sent_whole():
    body: list[Any] = []
    body += [Hooked(1.5, lambda: body.append("d")), "a"]
    assert decode(encode(Message(REPLY, 1, body=body))).body == [1.5, "a", "d"]


def test_a_dict_shrunk_by_a_hook_is_sent_as_it_now_is():
    kept: list[Any] = []
    body: dict[str, Any] = {"f": None, "x": 1, "y": 2}
    body["f"] = Hooked(1.5, lambda: kept.append(body.pop("y")))
    frames = encode(Message(REPLY, 1, body=body))
    assert decode(frames).body == {"f": 1.5, "x": 1}


class Frame:
    """A frame without a buffer: its size comes from ``nbytes``, which runs ``act`` once."""

    def __init__(self, size: Any, act: Callable[[], None] | None = None) -> None:
        self.size, self.act = size, act

    @property
    def nbytes(self) -> Any:
        act, self.act = self.act, None
        if act is not None:
            act()
        return self.size


def test_frames_changed_by_a_frame_s_nbytes_are_counted_as_they_now_are():
    kept: list[Any] = []
    frames: list[Any] = []
    frames += [Frame(1, lambda: kept.append(frames.pop())), b"x" * 10, b"y" * 20]
    assert fast.nbytes(frames) == 11  # as a loop over the list counts: the frame taken out is not


def test_a_negative_nbytes_raises_a_value_error():
    with pytest.raises(ValueError, match="negative"):
        fast.nbytes([b"ok", Frame(-1)])
    with pytest.raises(OverflowError):
        fast.nbytes([Frame(1 << 70)])


# batch entries read once ----------------------------------------------------------------------


ONE_SHOT: dict[str, Callable[[list[Any]], Any]] = {
    "generator": lambda frames: (f for f in frames),
    "iterator": iter,
    "map": lambda frames: map(bytes, frames),
}


@pytest.mark.parametrize("make", list(ONE_SHOT.values()), ids=list(ONE_SHOT))
def test_an_entry_read_only_once_is_joined_as_the_python_path_joins_it(make):
    frames = [b"A" * 20001, b"B" * 24000]
    want = b"A" * 20001 + bytes(7) + b"B" * 24000
    got = encode_batch(9, [[b"head"], make(frames), (b"t",)])
    assert got == python_side(lambda: encode_batch(9, [[b"head"], make(frames), (b"t",)]))
    assert got[1] == b"head" + bytes(4) + want + bytes(-len(want) & 7) + b"t"
    assert [[bytes(f) for f in e] for e in decode_batch(got).entries] == [[b"head"], frames, [b"t"]]


def test_the_compiled_join_refuses_a_one_shot_entry_before_reading_it():
    it = iter([b"a", b"b"])
    with pytest.raises(TypeError):
        fast.join([[b"x"], it])
    assert list(it) == [b"a", b"b"]  # left whole for the Python path


# limits past a C integer, and a negative depth --------------------------------------------------


LIMITS = {
    "message bytes 2**64": Limits(max_message_bytes=1 << 64),
    "frame bytes 2**63": Limits(max_frame_bytes=1 << 63),
    "header bytes 2**70": Limits(max_header_bytes=1 << 70),
    "frames -2**70": Limits(max_frames=-(1 << 70)),
    "container 2**63": Limits(max_container_len=1 << 63),
    "container -2**64": Limits(max_container_len=-(1 << 64)),
    "depth -2**32+5": Limits(max_depth=-(1 << 32) + 5),
    "depth -1": Limits(max_depth=-1),
    "depth 2**40": Limits(max_depth=1 << 40),
    "float frames": Limits(max_frames=4096.0),  # type: ignore[arg-type]
}


def outcome(frames: list[bytes], limits: Limits) -> Any:
    try:
        msg = decode(list(frames), limits)
    except DecodeError as exc:
        return type(exc).__name__
    return (msg.kind, msg.id, msg.service, msg.op, msg.body)


@pytest.mark.parametrize("limits", list(LIMITS.values()), ids=list(LIMITS))
@pytest.mark.parametrize("body", [{"x": 1}, {"x": [[[1]]]}, np.arange(3.0)], ids=["flat", "nested", "tensor"])
def test_limits_of_any_int_are_applied_as_the_python_codec_applies_them(limits, body):
    frames = python_side(lambda: encode(Message(REQUEST, 4, "s", "o", body)))
    got = outcome(frames, limits)
    want = python_side(lambda: outcome(frames, limits))
    assert repr(got) == repr(want)


# a struct field holding its NaN default ---------------------------------------------------------


class Clip(msgspec.Struct):
    clip: float = float("nan")
    scale: float = 1.0
    n: int = 3


@pytest.mark.parametrize("value", [Clip(), Clip(clip=float("nan")), Clip(clip=2.0, scale=1.0, n=3), Clip(n=4)],
                         ids=["the default's own nan", "another nan", "floats", "int"])
def test_a_struct_field_is_sent_by_both_codecs_alike(value):
    msg = Message(REQUEST, 1, "svc", "op", value)
    want = python_side(lambda: encode(msg))
    assert encode(msg) == want
    assert fast.encode(True, 1, "svc", "op", None, "", value) == want
