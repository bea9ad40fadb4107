"""Write the golden wire vectors into ``protocol/vectors/`` (or the folder given as argument).

Each vector is one JSON file:

    {"name": ..., "description": ...,
     "frames_hex": [hex of frame 0 (header), hex of frame 1, ...],
     "decoded": {"kind", "id", "service", "op", "deadline", "source", "error", "body"}}

In ``decoded`` an array is ``{"__tensor__": {"dtype", "shape", "data"}}`` where ``data`` is a
nested list of values (a bare value for a 0-d array) or a string holding the base64 of the raw
little-endian C-ordered bytes; a msgpack bin value is ``{"__bytes__": base64}``. Vectors whose
``decoded`` is null are malformed messages; their ``expect`` names the error a decoder raises
(``VersionMismatch`` or ``DecodeError``) and the request id it can still report (or null).

Valid vectors must decode to ``decoded`` and ``decoded`` must re-encode to exactly
``frames_hex``. Batch envelopes (SPEC.md section 10) are written to ``vectors/batch/``: there
``entries_hex`` lists each entry's frames (null for a malformed envelope, whose ``expect`` names
the error and the envelope id). Run from anywhere: ``python protocol/make_vectors.py``; it also rewrites the
request tables of ``SPEC.md`` (section 9) from the declarations in ``zmqflow/wire/requests``.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zmqflow.wire.batch import decode_batch, encode_batch  # noqa: E402
from zmqflow.wire import ERROR, REPLY, REQUEST, Message, decode, encode, error_message  # noqa: E402
from zmqflow.errors import InvalidArgument  # noqa: E402
from zmqflow.wire.dtypes import WIRE_DTYPES, dtype_name  # noqa: E402
from zmqflow.wire.requests import ps as ps_requests  # noqa: E402
from zmqflow.wire.requests.doc import BEGIN, END, request_tables  # noqa: E402

HERE = Path(__file__).resolve().parent
# dtypes whose values are written as nested lists; the others travel as base64 of raw bytes
_LISTED = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


# JSON form ---------------------------------------------------------------------------------


def to_json_value(obj: Any, *, raw: bool = False) -> Any:
    """The JSON form of a decoded body (arrays as ``__tensor__``, bytes as ``__bytes__``)."""
    if isinstance(obj, np.ndarray):
        name = dtype_name(obj.dtype)
        wire = obj.astype(WIRE_DTYPES[name], order="C")  # keeps 0-d arrays 0-d
        if name in _LISTED and not raw:
            data: Any = wire.tolist()
        else:
            data = base64.b64encode(wire.tobytes()).decode("ascii")
        return {"__tensor__": {"dtype": name, "shape": list(obj.shape), "data": data}}
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, (list, tuple)):
        return [to_json_value(v, raw=raw) for v in obj]
    if isinstance(obj, dict):
        return {k: to_json_value(v, raw=raw) for k, v in obj.items()}
    return obj


def from_json_value(obj: Any) -> Any:
    """The inverse of :func:`to_json_value`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            spec = obj["__tensor__"]
            dtype = WIRE_DTYPES[spec["dtype"]]
            data = spec["data"]
            if isinstance(data, str):
                return np.frombuffer(base64.b64decode(data), dtype=dtype).reshape(spec["shape"]).copy()
            return np.array(data, dtype=dtype).reshape(spec["shape"])
        if set(obj) == {"__bytes__"}:
            return base64.b64decode(obj["__bytes__"])
        return {k: from_json_value(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_value(v) for v in obj]
    return obj


def message_to_json(msg: Message) -> dict[str, Any]:
    return {
        "kind": msg.kind,
        "id": msg.id,
        "service": msg.service,
        "op": msg.op,
        "deadline": msg.deadline,
        "source": msg.source,
        "error": msg.error,
        "body": to_json_value(msg.body),
    }


def message_from_json(d: dict[str, Any]) -> Message:
    return Message(
        kind=d["kind"],
        id=d["id"],
        service=d["service"],
        op=d["op"],
        body=from_json_value(d["body"]),
        deadline=d["deadline"],
        source=d["source"],
        error=d["error"],
    )


def frames_hex(frames: list[Any]) -> list[str]:
    return [bytes(memoryview(f)).hex() for f in frames]


# the vectors -------------------------------------------------------------------------------


def _valid(name: str, description: str, msg: Message) -> dict[str, Any]:
    frames = frames_hex(encode(msg))
    decoded = message_to_json(decode([bytes.fromhex(f) for f in frames]))
    again = frames_hex(encode(message_from_json(json.loads(json.dumps(decoded)))))
    if again != frames:
        raise AssertionError(f"vector {name}: the decoded form does not re-encode to the same bytes")
    return {"name": name, "description": description, "frames_hex": frames, "decoded": decoded}


def _invalid(name: str, description: str, frames: list[bytes], error: str, request_id: int | None) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "frames_hex": [f.hex() for f in frames],
        "decoded": None,
        "expect": {"error": error, "request_id": request_id},
    }


def _ref(i: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack(">I", i))


def valid_vectors() -> list[dict[str, Any]]:
    f32 = np.array([[0.5, -1.25, 3.0], [1e-3, np.inf, -0.0]], dtype=np.float32)
    out = [
        _valid(
            "request_ping",
            "A request without tensors or arguments: health.ping, no deadline, no source.",
            Message(REQUEST, 1, "health", "ping"),
        ),
        _valid(
            "request_tensors",
            "A request whose body nests arrays of several dtypes and shapes (an empty array, a 0-d "
            "array, a non-contiguous slice sent C-ordered) in lists and maps beside plain values. The "
            "small ones share one pack frame, each at an offset that is a multiple of 16; the empty "
            "array has a frame of its own.",
            Message(
                REQUEST,
                2,
                "ps",
                "push",
                {
                    "grads": {"w": f32, "b": np.arange(3, dtype=np.float64) / 4},
                    "ids": np.array([7, -1, 2**40], dtype=np.int64),
                    "mask": np.array([True, False, True]),
                    "empty": np.zeros((0, 3), dtype=np.float32),
                    "step": np.array(42, dtype=np.int32),
                    "slices": [
                        np.arange(12, dtype=np.uint16).reshape(3, 4)[:, ::2],
                        {"z": np.array([1 + 2j], np.complex64)},
                    ],
                    "meta": {"lr": 0.5, "names": ["w", "b"], "sync": True, "note": None, "tag": b"\x00\xff"},
                },
            ),
        ),
        _valid(
            "request_all_dtypes",
            "One 1-d array of every wire dtype (bfloat16 aside), in a list, in wire-name order.",
            Message(REQUEST, 3, "diag", "echo", [_sample(name) for name in sorted(WIRE_DTYPES) if name != "bfloat16"]),
        ),
        _valid(
            "request_deadline_source",
            "A request with a relative deadline (2.5 s left when sent) and the sender's task name.",
            Message(REQUEST, 4, "ps", "pull", {"names": ["w", "b"]}, deadline=2.5, source="worker:0"),
        ),
        _valid(
            "reply_tensor",
            "A reply whose body is one 3-d float32 array.",
            Message(REPLY, 5, body=np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 11.5, source="ps:0"),
        ),
        _valid(
            "reply_plain",
            "A reply of plain values only, to the largest request id (2**64-1).",
            Message(REPLY, 2**64 - 1, body=[1, -2, 3.5, "text", None, True, {"k": [], "n": 2**33}]),
        ),
        _valid(
            "reply_none",
            "A reply with a nil body (an op that returns nothing).",
            Message(REPLY, 6),
        ),
        _valid(
            "error_reply",
            "An error reply with details: a variable declared with another shape.",
            Message(
                ERROR,
                7,
                source="ps:0",
                error={
                    "code": "VARIABLE_CONFLICT",
                    "type": "VariableConflict",
                    "message": "variable 'w' exists with shape (3, 4), declared with (4, 3)",
                    "traceback": "Traceback (most recent call last):\n  ...\nVariableConflict: variable 'w'\n",
                    "details": {"variable": "w", "expected": [3, 4], "actual": [4, 3]},
                },
            ),
        ),
        _valid(
            "error_reply_unknown_code",
            "An error reply with a code receivers do not know (raised as RemoteError) and no details.",
            Message(
                ERROR,
                8,
                error={"code": "INTERNAL", "type": "ZeroDivisionError", "message": "division by zero", "traceback": ""},
            ),
        ),
    ]
    if "bfloat16" in WIRE_DTYPES:
        out.append(
            _valid(
                "request_bfloat16",
                "A request with a bfloat16 array (only where ml_dtypes is installed).",
                Message(REQUEST, 9, "ps", "push", {"g": np.array([1.0, -2.5, 0.0], dtype=WIRE_DTYPES["bfloat16"])}),
            )
        )
    return out


def _sample(name: str) -> np.ndarray:
    if name == "bool":
        return np.array([True, False])
    dt = WIRE_DTYPES[name]
    if dt.kind == "c":
        return np.array([1.5 - 2j, -0.25j], dtype=dt)
    if dt.kind == "f":
        return np.array([1.5, -0.25, 65504.0 if name == "float16" else 1e30], dtype=dt)
    info = np.iinfo(dt)
    return np.array([info.min, 0, info.max], dtype=dt)


def invalid_vectors() -> list[dict[str, Any]]:
    def head(fields: dict[str, Any]) -> bytes:
        return msgpack.packb(fields, use_bin_type=True)

    return [
        _invalid(
            "invalid_version",
            "A request from protocol version 2: refused unread with VersionMismatch; the id is reported.",
            [head({"v": 2, "k": "req", "id": 10, "svc": "health", "op": "ping", "a": None, "t": []})],
            "VersionMismatch",
            10,
        ),
        _invalid(
            "invalid_frame_size",
            "A float32 (2, 2) tensor whose frame has 12 bytes instead of 16.",
            [
                head({"v": 1, "k": "rep", "id": 11, "a": _ref(0), "t": [["float32", [2, 2], 1]]}),
                bytes(12),
            ],
            "DecodeError",
            11,
        ),
        _invalid(
            "invalid_unreferenced_frame",
            "A tensor frame that the body never references.",
            [head({"v": 1, "k": "rep", "id": 12, "a": None, "t": [["uint8", [1], 1]]}), b"\x01"],
            "DecodeError",
            12,
        ),
        _invalid(
            "invalid_ext_type",
            "A body holding msgpack extension type 2, which this version does not define.",
            [head({"v": 1, "k": "req", "id": 13, "svc": "s", "op": "o", "a": msgpack.ExtType(2, bytes(4)), "t": []})],
            "DecodeError",
            13,
        ),
        _invalid(
            "invalid_pack_overlap",
            "Two float32 tensors packed in one frame, the second starting inside the first (offset 4 of 8 bytes).",
            [head({"v": 1, "k": "rep", "id": 15, "a": [_ref(0), _ref(1)],
                   "t": [["float32", [2], 1, 0], ["float32", [2], 1, 4]]}), bytes(16)],
            "DecodeError",
            15,
        ),
        _invalid(
            "invalid_pack_offset",
            "A packed float64 tensor at offset 4, not a multiple of its itemsize.",
            [head({"v": 1, "k": "rep", "id": 16, "a": [_ref(0), _ref(1)],
                   "t": [["uint8", [4], 1, 0], ["float64", [1], 1, 4]]}), bytes(16)],
            "DecodeError",
            16,
        ),
        _invalid(
            "invalid_pack_past_end",
            "A packed tensor whose bytes run past the end of its frame (8 bytes from offset 16 of 16).",
            [head({"v": 1, "k": "rep", "id": 17, "a": [_ref(0), _ref(1)],
                   "t": [["uint8", [4], 1, 0], ["float64", [1], 1, 16]]}), bytes(16)],
            "DecodeError",
            17,
        ),
        _invalid(
            "invalid_truncated_header",
            "A header cut short: nothing, not even the id, can be read.",
            [head({"v": 1, "k": "req", "id": 14, "svc": "health", "op": "ping", "a": None, "t": []})[:9]],
            "DecodeError",
            None,
        ),
    ]


def dumps(obj: Any, indent: str = "") -> str:
    """Indented JSON whose innermost lists (of scalars or of scalar lists) stay on one line."""
    inner = indent + "  "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and obj and not _flat(obj):
        return "[\n" + ",\n".join(inner + dumps(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj, ensure_ascii=True)


def _flat(obj: Any) -> bool:
    if isinstance(obj, dict):
        return not obj
    if isinstance(obj, list):
        return all(_flat(v) for v in obj) and not (obj and isinstance(obj[0], str) and len(obj[0]) > 60)
    return True


def declared_vectors() -> list[dict[str, Any]]:
    """Requests built from their declarations: pinned so a declaration cannot change the bytes unseen."""
    push = ps_requests.Push(dense=[ps_requests.RowsItem("w", 0, 0, 2, np.arange(6, dtype=np.float32).reshape(2, 3))],
                            sparse=[ps_requests.SparseItem("e", 1, np.array([3, 1], np.int64), np.ones((2, 3), np.float32))],
                            step=7)
    assign = ps_requests.Assign(items=[ps_requests.RowsItem("b", 0, None, None, np.array(1.5, np.float64))], mode="add")
    return [
        _valid("request_ps_push", "ps.push built from its declaration: dense and sparse items travel as positional "
               "lists; fields left at their defaults are left off", Message(REQUEST, 11, "ps", "push", push, deadline=5.0)),
        _valid("request_ps_assign", "ps.assign of a scalar built from its declaration (the scalar-update hot path)",
               Message(REQUEST, 12, "ps", "assign", assign, deadline=5.0)),
    ]


def _batch(name: str, description: str, bid: int, messages: list[Message]) -> dict[str, Any]:
    entries = [frames_hex(encode(m)) for m in messages]
    frames = frames_hex(encode_batch(bid, [[bytes.fromhex(f) for f in e] for e in entries]))
    again = decode_batch([bytes.fromhex(f) for f in frames])
    if again.id != bid or [frames_hex(e) for e in again.entries] != entries:
        raise AssertionError(f"vector {name}: the envelope does not decode to its entries")
    return {"name": name, "description": description, "frames_hex": frames, "entries_hex": entries}


def batch_vectors() -> list[dict[str, Any]]:
    """Batch envelopes: two valid ones and the malformed shapes a receiver refuses whole."""
    reqs = [
        Message(REQUEST, 21, "worker", "echo", {"x": np.arange(3, dtype=np.float32)}, deadline=5.0, source="worker:0"),
        Message(REQUEST, 22, "master", "ping", None, deadline=5.0, source="worker:0"),
        Message(REQUEST, 23, "ps", "pull", {"items": [["w", 0, None, None]]}, deadline=5.0, source="worker:0"),
    ]
    reps = [
        Message(REPLY, 21, body={"x": np.arange(3, dtype=np.float32)}),
        error_message(22, InvalidArgument("master.ping: unexpected argument(s) x"), source="ps:0"),
    ]
    good = encode_batch(30, [encode(m) for m in reqs[1:]])

    def invalid(name: str, description: str, frames: list[bytes], error: str, bid: int | None) -> dict[str, Any]:
        vector = _invalid(name, description, frames, error, bid)
        vector["entries_hex"] = None
        return vector

    head = msgpack.unpackb(good[0])
    return [
        _batch("batch_requests", "Three requests in one envelope (id 20): the first carries a float32 tensor, so "
               "the next entry's header starts after zero padding to a multiple of 8 bytes.", 20, reqs),
        _batch("batch_replies", "A reply with a tensor and an error reply in one envelope; servers send reply "
               "envelopes with id 0.", 0, reps),
        invalid("invalid_batch_truncated", "The entries frame is 3 bytes shorter than its lengths say.",
                [good[0], good[1][:-3]], "DecodeError", 30),
        invalid("invalid_batch_n_not_a_list", "The entry table 'n' is a string.",
                [msgpack.packb({**head, "n": "two"}, use_bin_type=True), good[1]], "DecodeError", 30),
        invalid("invalid_batch_one_frame", "The entries frame is missing.", [good[0]], "DecodeError", 30),
        invalid("invalid_batch_too_many_entries", "1025 entries, one over the default limit.",
                encode_batch(31, [[b"\x80"]] * 1025), "LimitExceeded", 31),
    ]


def write_request_tables(spec: Path) -> None:
    """Replace the request tables of SPEC.md (between their markers) with the declarations'."""
    text = spec.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    spec.write_text(text[:start] + request_tables() + text[end:])


def main(argv: list[str]) -> int:
    folder = Path(argv[1]) if len(argv) > 1 else HERE / "vectors"
    folder.mkdir(parents=True, exist_ok=True)
    for vector in valid_vectors() + declared_vectors() + invalid_vectors():
        text = dumps(vector) + "\n"
        (folder / f"{vector['name']}.json").write_text(text)
        print(f"wrote {folder / vector['name']}.json")
    (folder / "batch").mkdir(exist_ok=True)
    for vector in batch_vectors():
        (folder / "batch" / f"{vector['name']}.json").write_text(dumps(vector) + "\n")
        print(f"wrote {folder / 'batch' / vector['name']}.json")
    if len(argv) <= 1:
        write_request_tables(HERE / "SPEC.md")
        print(f"wrote the request tables of {HERE / 'SPEC.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
