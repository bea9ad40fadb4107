"""Property-based tests of what a peer can send: the codec, every op's request declaration, and a
live server answering random requests. Hypothesis runs a fixed number of derandomized examples,
so the suite is deterministic; ``protocol/fuzz/`` holds the coverage-guided harnesses, and the
inputs they found are kept in ``protocol/vectors/fuzz/`` and replayed here."""

from __future__ import annotations

import json
import math
import time
import typing
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zmqflow as zf
from zmqflow.errors import (DeadlineExceeded, InvalidArgument, RemoteError, VersionMismatch, ZmqflowError,
                            error_class)
from zmqflow.loop import LoopThread
from zmqflow.rpc.client import RpcClient
from zmqflow.testing import local_cluster
from zmqflow.wire import ERROR, REPLY, REQUEST, DecodeError, Limits, Message, decode, encode
from zmqflow.wire.codec import LimitExceeded
from zmqflow.wire.dtypes import WIRE_DTYPES
from zmqflow.wire.requests import OPEN, SERVICES, ArraySpec, Item, compile_validator
from zmqflow.wire.requests.base import Spec, field_types, unwrap

from .conftest import arun

ROOT = Path(__file__).resolve().parents[1]
FUZZ_VECTORS = sorted((ROOT / "protocol" / "vectors" / "fuzz").glob("*.json"))

FAST = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HANG = 5.0  # seconds: one decode or validation of a small input taking longer is a hang


# values -------------------------------------------------------------------------------------

DTYPES = sorted(WIRE_DTYPES)


@st.composite
def arrays(draw: Any, dtypes: list[str] = DTYPES, ndim: int | None = None, max_side: int = 4) -> np.ndarray:
    """An array of a wire dtype, any bit pattern (NaNs included), 0-d and empty shapes included."""
    dtype = WIRE_DTYPES[draw(st.sampled_from(dtypes))]
    rank = draw(st.integers(0, 3)) if ndim is None else ndim
    shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=rank, max_size=rank)))
    raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if draw(st.booleans()) and arr.ndim >= 2:  # a non-contiguous view: the codec copies it
        arr = arr.T
    return arr


plain = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=20),
)
values = st.recursive(
    st.one_of(plain, arrays()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
plain_values = st.recursive(  # what a spec (optimizer, initializer, table) may hold: no tensors
    plain,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
names = st.text(min_size=1, max_size=128)


@st.composite
def messages(draw: Any) -> Message:
    kind = draw(st.sampled_from([REQUEST, REPLY, ERROR]))
    msg = Message(kind=kind, id=draw(st.integers(0, (1 << 64) - 1)), source=draw(st.text(max_size=128)))
    if kind == REQUEST:
        msg.service, msg.op = draw(names), draw(names)
        msg.deadline = draw(st.none() | st.floats(min_value=1e-9, max_value=1e9))
    if kind == ERROR:
        msg.error = {k: draw(st.text(max_size=30)) for k in ("code", "type", "message", "traceback")}
        if draw(st.booleans()):
            msg.error["details"] = draw(st.dictionaries(st.text(max_size=8), plain, max_size=3))
    else:
        msg.body = draw(values)
    return msg


def same(a: Any, b: Any) -> bool:
    """Equal as the wire carries them: arrays by dtype, shape and bytes; tuples as lists."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.ascontiguousarray(a).tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# the codec ----------------------------------------------------------------------------------


@FAST
@given(messages())
def test_every_generated_message_round_trips(msg):
    frames = encode(msg)
    back = decode([bytes(memoryview(f)) for f in frames])
    assert (back.kind, back.id, back.service, back.op, back.deadline, back.source) == (
        msg.kind, msg.id, msg.service, msg.op, msg.deadline, msg.source)
    assert back.error == msg.error
    assert same(msg.body, back.body)


def decode_safely(frames: list[bytes], limits: Limits = Limits()) -> Message | DecodeError:
    """decode's result or its DecodeError; anything else raised fails the test, as does a hang."""
    start = time.monotonic()
    try:
        out: Message | DecodeError = decode(frames, limits)
    except DecodeError as exc:
        out = exc
        if exc.request_id is not None:
            assert 0 <= exc.request_id < 1 << 64 and exc.kind in (REQUEST, REPLY, ERROR, None)
    assert time.monotonic() - start < HANG
    return out


@FAST
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_arbitrary_bytes_only_ever_raise_decode_error(frames):
    decode_safely(frames)


SMALL = Limits(max_header_bytes=600, max_frame_bytes=64, max_frames=4, max_container_len=6, max_depth=5,
               max_message_bytes=100)


@st.composite
def mutated(draw: Any) -> list[bytes]:
    """A valid message's frames, then broken: bytes flipped, cut, inserted; frames dropped or added."""
    frames = [bytearray(memoryview(f)) for f in encode(draw(messages()))]
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "drop_frame", "add_frame", "swap"]))
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if how == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            f[j] = draw(st.integers(0, 255))
        elif how == "cut":
            del f[draw(st.integers(0, len(f))):]
        elif how == "insert":
            j = draw(st.integers(0, len(f)))
            f[j:j] = draw(st.binary(min_size=1, max_size=8))
        elif how == "drop_frame" and len(frames) > 1:
            del frames[i]
        elif how == "add_frame":
            frames.append(bytearray(draw(st.binary(max_size=16))))
        elif how == "swap" and len(frames) > 1:
            frames[0], frames[-1] = frames[-1], frames[0]
    return [bytes(f) for f in frames]


@FAST
@given(mutated())
def test_mutated_frames_only_ever_raise_decode_error(frames):
    for limits in (Limits(), SMALL):
        out = decode_safely(frames, limits)
        if isinstance(out, Message):
            assert_within(out, frames, limits)


def shape_of_header(header: bytes) -> tuple[int, int]:
    """(nesting depth, the longest container) of a header, the header map counted at depth 1."""
    head = msgpack.unpackb(header, raw=False, strict_map_key=False, ext_hook=lambda code, data: None)

    def walk(obj: Any) -> tuple[int, int]:
        if isinstance(obj, (list, dict)):
            items = list(obj.values()) if isinstance(obj, dict) else obj
            inner = [walk(v) for v in items] or [(0, 0)]
            return 1 + max(d for d, _ in inner), max([len(obj)] + [n for _, n in inner])
        return 0, 0

    return walk(head)


def assert_within(msg: Message, frames: list[bytes], limits: Limits) -> None:
    assert len(frames) <= limits.max_frames and len(frames[0]) <= limits.max_header_bytes
    assert all(len(f) <= limits.max_frame_bytes for f in frames[1:])
    assert sum(map(len, frames[1:])) <= limits.max_message_bytes
    depth, longest = shape_of_header(frames[0])
    assert depth <= limits.max_depth and longest <= limits.max_container_len


@FAST
@given(messages(), st.data())
def test_limits_refuse_exactly_what_exceeds_them(msg, data):
    frames = [bytes(memoryview(f)) for f in encode(msg)]
    depth, longest = shape_of_header(frames[0])
    tensors = [len(f) for f in frames[1:]]
    actual = {"max_header_bytes": len(frames[0]), "max_frames": len(frames), "max_frame_bytes": max(tensors, default=0),
              "max_message_bytes": sum(tensors), "max_container_len": longest, "max_depth": depth}
    # each limit near its actual value: at, just under or just over it
    limits = Limits(**{k: max(1, v + data.draw(st.integers(-1, 1), label=k)) for k, v in actual.items()})
    over = [k for k, v in actual.items() if v > getattr(limits, k)]
    out = decode_safely(frames, limits)
    if over:
        assert isinstance(out, LimitExceeded), (over, out)
        assert out.request_id in (None, msg.id)  # answered when the id is readable
    else:
        assert isinstance(out, Message) and same(msg.body, out.body)


def test_fuzz_vectors_are_refused_as_they_say():
    """Inputs a fuzzer found are kept: decoder vectors must be refused with their error and id;
    request vectors decode, and their body is refused by the op's validator (not a crash)."""
    assert FUZZ_VECTORS, "protocol/vectors/fuzz holds the inputs the harnesses found"
    for path in FUZZ_VECTORS:
        vector = json.loads(path.read_text())
        assert vector["name"] == path.stem and vector["description"]
        frames = [bytes.fromhex(h) for h in vector["frames_hex"]]
        expect = vector["expect"]
        out = decode_safely(frames)
        if vector["decoded"] is None:
            assert isinstance(out, DecodeError), path.stem
            assert isinstance(out, VersionMismatch) == (expect["error"] == "VersionMismatch")
            assert out.request_id == expect["request_id"]
        elif not expect.get("handler"):  # refused by a handler (a shard's state), not the edge: replayed below
            assert isinstance(out, Message) and (out.service, out.op) == (vector["decoded"]["service"], vector["decoded"]["op"])
            validate = compile_validator(out.service, out.op, SERVICES[out.service][out.op])
            with pytest.raises(error_class(expect["code"]), match=f"^{out.service}.{out.op}: "):
                validate(out.body)


# request vectors, less those whose replay would try to allocate what the finding is about
REQUEST_VECTORS = [p for p in FUZZ_VECTORS if json.loads(p.read_text())["decoded"] is not None
                   and json.loads(p.read_text())["expect"].get("replay", True)]


@pytest.mark.parametrize("path", REQUEST_VECTORS, ids=lambda p: p.stem)
def test_fuzz_request_vectors_get_their_typed_error_from_a_live_server(path):
    vector = json.loads(path.read_text())
    msg = decode([bytes.fromhex(h) for h in vector["frames_hex"]])
    expected = error_class(vector["expect"]["code"])

    async def main() -> None:
        async with local_cluster({"ps": 1}, timeout=10, transport="inproc") as servers:
            ps = servers["ps:0"]
            with pytest.raises(ZmqflowError) as caught:
                await ps.call("ps:0", msg.service, msg.op, msg.body, timeout=5)
            assert await ps.call("ps:0", "ps", "ping", timeout=5) == {"service": "ps"}
        assert type(caught.value) is expected, caught.value

    arun(main())


# request declarations ------------------------------------------------------------------------

DECLARED = sorted((s, o) for s, ops in SERVICES.items() for o, cls in ops.items() if cls is not OPEN)
JUNK = st.one_of(
    st.none(), st.booleans(), st.sampled_from([-1, -(1 << 63) - 1, 1 << 64, 0.5, float("nan"), float("inf")]),
    st.sampled_from(["", "x" * 5000, "\x00"]), st.binary(max_size=4), st.just([]), st.just({}),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    arrays(max_side=2), st.just(np.zeros((1, 1), "float32").T),
)


def _meta(tp: Any) -> tuple[Any, dict[str, Any], ArraySpec | None, bool]:
    """(bare type, msgspec.Meta limits, ArraySpec, optional) of an annotation."""
    limits: dict[str, Any] = {}
    spec = None
    optional = False
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            for m in tp.__metadata__:
                if isinstance(m, msgspec.Meta):
                    limits.update({k: getattr(m, k) for k in ("ge", "gt", "le", "lt", "min_length", "max_length")
                                   if getattr(m, k) is not None})
                elif isinstance(m, ArraySpec):
                    spec = m
            tp = tp.__origin__
            continue
        args = typing.get_args(tp)
        if type(None) in args and len(args) == 2:
            optional = True
            tp = next(a for a in args if a is not type(None))
            continue
        return tp, limits, spec, optional


def strategy(tp: Any) -> st.SearchStrategy:
    """Values a declaration's field type accepts, drawn from its type and limits."""
    bare, lim, spec, optional = _meta(tp)
    if any(m is Spec.__metadata__[0] for m in unwrap(tp)[1]):
        out = st.dictionaries(st.text(max_size=8), plain_values, max_size=4)
    else:
        out = _bare(bare, lim, spec)
    return st.none() | out if optional else out


def _bare(bare: Any, lim: dict[str, Any], spec: ArraySpec | None) -> st.SearchStrategy:
    origin, args = typing.get_origin(bare), typing.get_args(bare)
    lo = lim.get("ge", lim["gt"] + 1 if "gt" in lim else None)
    hi = lim.get("le", lim["lt"] - 1 if "lt" in lim else None)
    small = dict(min_size=lim.get("min_length", 0), max_size=min(lim.get("max_length", 4), max(4, lim.get("min_length", 0))))
    if bare is bool:
        return st.booleans()
    if bare is int:
        edges = [v for v in (lo, hi) if v is not None]
        return st.sampled_from(edges) | st.integers(lo, hi) if edges else st.integers(lo, hi)
    if bare is float:
        return st.floats(min_value=lim.get("ge", lim.get("gt")), max_value=lim.get("le", lim.get("lt")), allow_nan=False,
                         exclude_min="gt" in lim, exclude_max="lt" in lim, allow_infinity=False)
    if bare is str:
        return st.text(min_size=small["min_size"], max_size=max(small["min_size"], 12)) | st.sampled_from(
            ["w", "fuzz_guard", "x" * lim.get("max_length", 12)])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if bare is Any:
        return values
    if bare is np.ndarray:
        dtypes = [n for n in DTYPES if spec is None or spec.kinds is None or WIRE_DTYPES[n].kind in spec.kinds]
        return arrays(dtypes, ndim=None if spec is None else spec.ndim)
    if origin is list:
        return st.lists(strategy(args[0]), **small)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy(args[1]), max_size=small["max_size"])
    if isinstance(bare, type) and issubclass(bare, Item):
        return st.tuples(*(strategy(t) for t in field_types(bare).values())).map(list)
    raise AssertionError(f"no strategy for {bare!r}")


def bodies(cls: type) -> st.SearchStrategy:
    """A body the declaration accepts: every required field, some of the optional ones."""
    required = set(cls.__struct_fields__[: len(cls.__struct_fields__) - len(cls.__struct_defaults__)])
    types = field_types(cls)
    return st.fixed_dictionaries({k: strategy(t) for k, t in types.items() if k in required},
                                 optional={k: strategy(t) for k, t in types.items() if k not in required})


@st.composite
def wrong(draw: Any, cls: type) -> tuple[dict[str, Any], str]:
    """A body broken one way: a field of junk, a required field left out, or an unknown field."""
    body = dict(draw(bodies(cls)))
    how = draw(st.sampled_from(["junk", "missing", "unknown"]))
    fields = list(cls.__struct_fields__)
    if how == "junk" and fields:
        body[draw(st.sampled_from(fields))] = draw(JUNK)
    elif how == "missing" and body and len(cls.__struct_defaults__) < len(fields):
        del body[draw(st.sampled_from(fields[: len(fields) - len(cls.__struct_defaults__)]))]
    else:
        how = "unknown"
        body["not_a_field"] = draw(plain)
    return body, how


def check_refusal(service: str, op: str, body: Any, must_refuse: bool) -> None:
    validate = compile_validator(service, op, SERVICES[service][op])
    start = time.monotonic()
    try:
        validate(body)
    except InvalidArgument as exc:
        assert str(exc).startswith(f"{service}.{op}: "), str(exc)
    else:
        assert not must_refuse, f"{service}.{op} accepted {body!r}"
    assert time.monotonic() - start < HANG


@pytest.mark.parametrize("service,op", DECLARED, ids=[f"{s}.{o}" for s, o in DECLARED])
def test_every_declared_op_accepts_bodies_drawn_from_its_declaration(service, op):
    cls = SERVICES[service][op]
    validate = compile_validator(service, op, cls)

    @settings(FAST, max_examples=25)
    @given(bodies(cls))
    def accepted(body):
        req = validate(body)
        assert isinstance(req, cls)
        for k, v in body.items():
            assert getattr(req, k) is v or not isinstance(v, np.ndarray)

    accepted()


@pytest.mark.parametrize("service,op", DECLARED, ids=[f"{s}.{o}" for s, o in DECLARED])
def test_every_declared_op_refuses_wrong_bodies_with_invalid_argument_only(service, op):
    cls = SERVICES[service][op]

    @settings(FAST, max_examples=30)
    @given(wrong(cls), JUNK)
    def refused(broken, junk):
        body, how = broken
        check_refusal(service, op, body, must_refuse=how != "junk")
        check_refusal(service, op, junk, must_refuse=not isinstance(junk, dict) and junk is not None)

    refused()


# a live server ------------------------------------------------------------------------------

# a fenced shard refuses everything (tested in test_recovery); a shutdown stops the server (its
# purpose: tested in test_stop, malformed bodies included)
LIVE_OPS = sorted((s, o) for s, ops in SERVICES.items() for o in ops
                  if (s, o) not in (("ps", "fence"), ("master", "shutdown")))
WAITS = {("catalog", "lookup"), ("catalog", "declare"), ("ring", "join")}  # may wait for others, then say so


def live_bodies(service: str, op: str) -> st.SearchStrategy:
    cls = SERVICES[service][op]
    if cls is OPEN:
        return st.dictionaries(st.text(max_size=8).filter(str.isidentifier), values, max_size=3)
    return st.one_of(bodies(cls), wrong(cls).map(lambda b: b[0]), JUNK)


GUARD = np.arange(12, dtype=np.float32).reshape(3, 4)


def test_a_live_server_answers_random_requests_to_every_op_and_keeps_serving(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a save that is accepted writes here
    lt = LoopThread("fuzz-live")
    cm = local_cluster({"ps": 1, "worker": 1}, timeout=10, transport="inproc")
    seen: dict[str, int] = {}
    servers = None
    try:
        servers = lt.call(cm.__aenter__(), timeout=20)
        ps = servers["ps:0"]

        async def setup() -> RpcClient:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                await sess.variable("fuzz_guard", GUARD)
            return RpcClient(identity="fuzzer", source="fuzzer", default_timeout=2.0)

        client = lt.call(setup(), timeout=20)

        async def guard() -> np.ndarray:
            return (await client.call(ps.target, "ps", "pull", {"items": [["fuzz_guard", 0, None, None]]}))[0].copy()

        async def one(service: str, op: str, body: Any) -> str:
            before = await guard()
            try:
                await client.call(ps.target, service, op, body, timeout=0.5 if (service, op) in WAITS else 2.0)
                outcome = "ok"
            except DeadlineExceeded:
                assert (service, op) in WAITS, f"{service}.{op} got no answer to {body!r}"
                outcome = "DeadlineExceeded"
            except ZmqflowError as exc:
                assert not isinstance(exc, RemoteError), f"{service}.{op}: untyped error {exc} for {body!r}"
                outcome = type(exc).__name__
                after = await guard()
                assert after.dtype == before.dtype and after.tobytes() == before.tobytes(), (service, op, body)
            assert await client.call(ps.target, "ps", "ping", timeout=2.0) == {"service": "ps"}
            return outcome

        @settings(FAST, max_examples=200)
        @given(st.sampled_from(LIVE_OPS).flatmap(lambda so: st.tuples(st.just(so), live_bodies(*so))))
        def fuzz(case):
            (service, op), body = case
            outcome = lt.call(one(service, op, body), timeout=10)
            seen[outcome] = seen.get(outcome, 0) + 1

        fuzz()
        # still serving: a ping answers and the guard variable still reads
        assert lt.call(client.call(ps.target, "master", "ping", timeout=2.0), timeout=5)["task"] == "ps:0"
        assert lt.call(guard(), timeout=5).shape == GUARD.shape
        assert "InvalidArgument" in seen and "ok" in seen, seen  # both sides of the edge were reached

        async def close() -> None:
            client.close()

        lt.call(close(), timeout=5)
    finally:
        if servers is not None:
            lt.call(cm.__aexit__(None, None, None), timeout=20)
        lt.stop()
