"""Encode and decode messages: a msgpack header frame followed by raw tensor frames.

Sans-IO: frames in, frames out. Arrays anywhere in a message body are replaced in the header
by an extension reference (ext type 1, a 4-byte index) into the header's tensor table ``t``,
whose entries ``[dtype, shape, frame]`` describe the raw frames that follow. Decoding checks
the version first, then every type, count and size, before it builds a single array; arrays are
rebuilt over the received frame (``np.ndarray(shape, dtype, frame)``), so they share its memory.
Nothing here is ever pickled. ``protocol/SPEC.md`` is the normative description.

Requests and replies of plain data take a compiled path where it is built (``codec_c.c``): one
call each way, byte for byte the same frames and the same checks; whatever it does not take (an
error, an unusual body, anything malformed) comes here, which handles it or names the fault.
"""

from __future__ import annotations

import importlib
import math
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec
import numpy as np

from ..errors import InvalidArgument
from .message import (DEFAULT_LIMITS, ERROR, KINDS, REPLY, REQUEST, VERSION, DecodeError, LimitExceeded, Limits,
                      Message, VersionError)
from .dtypes import AS_IS, LOADED as _LOADED_DTYPES
from .peek import container_marks, read_start, too_deep
from .structs import REQUIRED, layout as struct_layout, sent_fields
from .tensors import read as read_table, short as _short, wire_buffer as _wire_buffer, write as write_table

__all__ = [
    "VERSION",
    "REQUEST",
    "REPLY",
    "ERROR",
    "Limits",
    "Message",
    "DecodeError",
    "LimitExceeded",
    "encode",
    "encode_request",
    "encode_reply",
    "decode",
    "compiled",
    "compiled_module",
    "use_compiled",
]

_EXT_TENSOR = 1
_MAX_ID = (1 << 64) - 1
_MAX_NAME = 128
_U32 = struct.Struct(">I")
_from_bytes = int.from_bytes
_INF = math.inf


class _TensorRef:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


# encoding ---------------------------------------------------------------------------------


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``: the header bytes, then one buffer per array (zero-copy views)."""
    kind = msg.kind
    if _fast is not None and (kind == REQUEST or kind == REPLY):
        dl = msg.deadline
        if dl is not None and kind == REQUEST:
            dl = float(dl)  # as below: a session's timeout may be an int
        if dl is None or kind == REPLY or 0.0 < dl < _INF:
            frames = _fast.encode(kind == REQUEST, msg.id, msg.service, msg.op, dl, msg.source, msg.body)
            if frames is not None:
                return frames
    if msg.kind not in KINDS:
        raise InvalidArgument(f"message kind must be one of {', '.join(KINDS)}, got {msg.kind!r}")
    arrays: list[np.ndarray] = []
    head: dict[str, Any] = {"v": VERSION, "k": msg.kind, "id": msg.id}  # insertion order is wire order
    if msg.kind == REQUEST:
        head["svc"] = msg.service
        head["op"] = msg.op
        if msg.deadline is not None:
            dl = float(msg.deadline)
            if not 0.0 < dl < math.inf:
                raise InvalidArgument(f"deadline must be a positive finite number of seconds, got {msg.deadline!r}")
            head["dl"] = dl
    if msg.source:
        head["src"] = msg.source
    if msg.kind == ERROR:
        head["e"] = msg.error or {}
    else:
        head["a"] = _extract(msg.body, arrays)
    head["t"], tail = write_table(arrays)
    frames: list[Any] = [None, *tail]
    try:
        frames[0] = _packer().pack(head)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"cannot send the body of {msg.service}.{msg.op or msg.kind}: {exc}") from None
    return frames


def encode_request(rid: int, service: str, op: str, body: Any, deadline: float, source: str) -> list[Any]:
    """``encode(Message(REQUEST, rid, service, op, body, deadline, source))`` without building the
    Message where the compiled path takes it: the frames of a client's every call."""
    if _fast is not None and deadline.__class__ is float and 0.0 < deadline < _INF:
        frames = _fast.encode(True, rid, service, op, deadline, source, body)
        if frames is not None:
            return frames
    return encode(Message(REQUEST, rid, service, op, body, deadline, source))


def encode_reply(rid: int, body: Any) -> list[Any]:
    """``encode(Message(REPLY, rid, body=body))`` without building the Message where the compiled
    path takes it: the frames of a server's every answer."""
    if _fast is not None:
        frames = _fast.encode(False, rid, "", "", None, "", body)
        if frames is not None:
            return frames
    return encode(Message(REPLY, rid, body=body))


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's packer: building one per message costs more than packing a small header.
    Per thread, since encoders run on several (loops, the shared-memory ring's worker)."""
    try:
        return _local.packer
    except AttributeError:
        _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        return _local.packer


_ndarray, _generic = np.ndarray, np.generic


_REFS = [msgpack.ExtType(_EXT_TENSOR, _U32.pack(i)) for i in range(64)]
_PLAIN = frozenset((int, float, str, bool, bytes, type(None)))  # leaves that pass through unchanged


def _ref(index: int) -> msgpack.ExtType:
    return _REFS[index] if index < 64 else msgpack.ExtType(_EXT_TENSOR, _U32.pack(index))


def _extract(obj: Any, arrays: list[np.ndarray]) -> Any:
    """``obj`` with each array replaced by a tensor reference (appended to ``arrays``)."""
    t = type(obj)
    if t is dict:  # the usual body: a map of plain values and arrays, handled without a call per value
        out = {}
        for k, v in obj.items():
            c = v.__class__
            if c in _PLAIN:
                out[k] = v
            elif c is _ndarray:
                arrays.append(v)
                out[k] = _ref(len(arrays) - 1)
            else:
                out[k] = _extract(v, arrays)
        return out
    if t is list or t is tuple:
        return [_extract(v, arrays) for v in obj]
    if isinstance(obj, _ndarray):
        arrays.append(obj)
        return _ref(len(arrays) - 1)
    if isinstance(obj, _generic):
        return obj.item()
    if isinstance(obj, _Struct):  # a declared request as the map of its fields, an item as its list
        return _extract(sent_fields(obj), arrays)
    if isinstance(obj, dict):  # subclasses (OrderedDict, defaultdict) after the exact-type fast path
        return {k: _extract(v, arrays) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_extract(v, arrays) for v in obj]
    return obj


_Struct = msgspec.Struct


# decoding ---------------------------------------------------------------------------------


class _BadExt:
    __slots__ = ("code", "size")

    def __init__(self, code: int, size: int):
        self.code = code
        self.size = size


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode frames (bytes or zmq Frames) into a Message; raises DecodeError."""
    if _fast is not None:
        msg = _fast.decode(frames, limits)
        if msg is not None:
            return msg
    if not frames:
        raise DecodeError("empty message: no header frame")
    header_view = memoryview(frames[0])
    try:
        head, exts = _unpack(frames, header_view, limits)
    except DecodeError as exc:  # an unreadable header may still say whom to answer
        exc.request_id, exc.kind = _peek_id(header_view, limits)
        raise
    if not isinstance(head, dict):
        raise DecodeError(f"header must be a map, got {type(head).__name__}")
    try:
        return _from_header(head, frames, limits, exts, header_view)
    except RecursionError:
        raise DecodeError("header nests containers too deeply") from None


def _unpack(frames: Sequence[Any], header_view: memoryview, limits: Limits) -> tuple[Any, list[object]]:
    if len(frames) > limits.max_frames:
        raise LimitExceeded(f"{len(frames)} frames exceed the limit of {limits.max_frames}")
    if header_view.nbytes > limits.max_header_bytes:
        raise LimitExceeded(f"header of {header_view.nbytes} bytes exceeds the limit of {limits.max_header_bytes}")
    cap = limits.max_container_len
    # Extensions are recorded, not judged, while unpacking: the version must be checked first,
    # and any encoding of ext type 1 (fixext 4 or ext 8/16/32) must count as a reference.
    exts: list[object] = []  # every extension seen; a _BadExt, if any, comes first

    def ext_hook(code: int, data: bytes) -> object:
        if code == _EXT_TENSOR and len(data) == 4:
            ref = _TensorRef(_from_bytes(data, "big"))
            exts.append(ref)
            return ref
        bad = _BadExt(code, len(data))
        exts.insert(0, bad)
        return bad

    try:
        head = msgpack.unpackb(
            header_view,
            raw=False,
            strict_map_key=True,
            ext_hook=ext_hook,
            max_bin_len=limits.max_header_bytes,
            max_str_len=limits.max_header_bytes,
            max_array_len=cap,
            max_map_len=cap,
            max_ext_len=16,
        )
    except msgpack.StackError:
        raise LimitExceeded(f"header nests containers deeper than the limit of {limits.max_depth}") from None
    except Exception as exc:  # msgpack raises several types for truncated or malformed data
        if isinstance(exc, ValueError) and " exceeds max_" in str(exc):  # a string or container over its limit
            raise LimitExceeded(f"header: {exc}") from None
        raise DecodeError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    return head, exts


def _peek_id(header_view: memoryview, limits: Limits) -> tuple[int | None, str | None]:
    """(id, kind) of a version-1 header that failed to decode as a whole, so that a message too
    big, too deep or too long is answered rather than dropped."""
    found = read_start(header_view, limits.max_container_len)
    rid, kind = found.get("id"), found.get("k")
    if found.get("v") == VERSION and found["v"].__class__ is int and rid.__class__ is int and 0 <= rid <= _MAX_ID and kind in KINDS:
        return rid, kind
    return None, None


def _from_header(head: dict, frames: Sequence[Any], limits: Limits, exts: list[object], header: memoryview) -> Message:
    rid = head.get("id")
    rid = rid if rid.__class__ is int and 0 <= rid <= _MAX_ID else None  # msgpack makes exact ints (never bools)
    kind = head.get("k")
    kind = kind if kind in KINDS else None
    version = head.get("v")
    if version.__class__ is not int or version != VERSION:
        raise VersionError(f"protocol version {_short(version)} is not supported (this side speaks {VERSION})",
                           request_id=rid, kind=kind)
    if kind is None:
        raise DecodeError(f"unknown message kind {_short(head.get('k'))}", request_id=rid)
    if rid is None:
        raise DecodeError(f"request id must be an integer in 0..2**64-1, got {_short(head.get('id'))}")
    if header.nbytes > limits.max_depth and container_marks(header) > limits.max_depth and too_deep(head, limits.max_depth - 1):
        raise LimitExceeded(f"header nests containers deeper than the limit of {limits.max_depth}", request_id=rid, kind=kind)
    if exts and exts[0].__class__ is _BadExt:
        bad = exts[0]
        raise DecodeError(f"unknown msgpack extension type {bad.code} (length {bad.size})", request_id=rid, kind=kind)
    table = head.get("t", _NO_TABLE)
    arrays = read_table(table, frames, limits, rid, kind) if table != [] or len(frames) > 1 else _NO_TABLE
    source = head.get("src", "")
    if source.__class__ is not str or len(source) > _MAX_NAME:
        _opt_str(head, "src", rid, kind)  # raises, naming the field
    if kind == REQUEST:
        service, op = head.get("svc"), head.get("op")
        if service.__class__ is not str or not 0 < len(service) <= _MAX_NAME:
            service = _name(head, "svc", rid)  # raises unless a str subclass that passes
        if op.__class__ is not str or not 0 < len(op) <= _MAX_NAME:
            op = _name(head, "op", rid)
        dl = head.get("dl")
        if dl is not None:
            c = dl.__class__
            if (c is not float and c is not int) or not 0 < dl < _INF:  # msgpack makes exact floats and ints
                raise DecodeError(f"deadline must be a positive number of seconds, got {_short(dl)}",
                                  request_id=rid, kind=kind)
            dl = float(dl)
        msg = Message(kind, rid, service, op, None, dl, source)
    else:
        msg = Message(kind, rid, "", "", None, None, source)
    if kind == ERROR:
        msg.error = _error_fields(head.get("e"), rid, bool(exts))
        if arrays:
            raise DecodeError("an error message carries no tensors", request_id=rid, kind=kind)
    elif exts or arrays:
        used = bytearray(len(arrays))
        msg.body = _resolve(head.get("a"), arrays, used, rid, kind) if exts else head.get("a")
        if used.count(0):
            unused = [i + 1 for i, u in enumerate(used) if not u]
            raise DecodeError(f"tensor frames {unused} are not referenced by the body", request_id=rid, kind=kind)
    else:
        msg.body = head.get("a")
    return msg


_NO_TABLE: list = []  # read only: "no tensors", without a new list per message


def _resolve(obj: object, arrays: list[np.ndarray], used: bytearray, rid: int, kind: str) -> object:
    c = obj.__class__
    if c is _TensorRef:
        index = obj.index  # type: ignore[attr-defined]
        if index >= len(arrays):
            raise DecodeError(f"reference to tensor {index} but only {len(arrays)} were described", request_id=rid, kind=kind)
        used[index] = 1
        return arrays[index]
    if c is dict:  # msgpack builds exact dicts and lists
        return {k: v if v.__class__ in _PLAIN else _resolve(v, arrays, used, rid, kind) for k, v in obj.items()}  # type: ignore[attr-defined]
    if c is list:
        return [v if v.__class__ in _PLAIN else _resolve(v, arrays, used, rid, kind) for v in obj]  # type: ignore[attr-defined]
    return obj


def _name(head: dict, key: str, rid: int) -> str:
    value = head.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME:
        raise DecodeError(f"request field {key!r} must be a non-empty string of at most {_MAX_NAME} characters", request_id=rid, kind=REQUEST)
    return value


def _opt_str(head: dict, key: str, rid: int, kind: str) -> str:
    value = head.get(key, "")
    if not isinstance(value, str) or len(value) > _MAX_NAME:
        raise DecodeError(f"field {key!r} must be a string of at most {_MAX_NAME} characters", request_id=rid, kind=kind)
    return value


def _error_fields(err: object, rid: int, has_ext: bool) -> dict[str, Any]:
    if not isinstance(err, dict) or not all(isinstance(err.get(k, ""), str) for k in ("code", "type", "message", "traceback")):
        raise DecodeError("error field 'e' must map code, type, message and traceback to strings", request_id=rid, kind=ERROR)
    out: dict[str, Any] = {k: err.get(k, "") for k in ("code", "type", "message", "traceback")}
    details = err.get("details")
    if details is not None:
        if (
            not isinstance(details, dict)
            or not all(isinstance(k, str) for k in details)
            or (has_ext and _contains_ref(details))
        ):
            raise DecodeError("error field 'details' must map strings to plain values", request_id=rid, kind=ERROR)
        out["details"] = details
    return out


def _contains_ref(obj: object) -> bool:
    if isinstance(obj, _TensorRef):
        return True
    if isinstance(obj, list):
        return any(_contains_ref(v) for v in obj)
    if isinstance(obj, dict):
        return any(_contains_ref(v) for v in obj.values())
    return False


# the compiled path ------------------------------------------------------------------------

try:  # by name: an import graph cannot see into a compiled module and takes it for the package
    _built: Any = importlib.import_module(".codec_c", __package__)
except ImportError:  # built without a C compiler: everything runs above
    _built = None
if VERSION != 1:  # codec_c.c reads and writes version 1 only
    _built = None
if _built is not None:
    _built.configure(REQUEST, REPLY, Message, _LOADED_DTYPES, AS_IS, np.ndarray, msgpack.ExtType, _extract,
                     _wire_buffer, _Struct, struct_layout, REQUIRED)
_fast = _built  # what encode and decode try first: the module, or None when not built or turned off


def compiled() -> bool:
    """Whether requests and replies take the compiled path."""
    return _fast is not None


def compiled_module() -> Any:
    """The compiled module while the compiled path is on, else None: the batch envelope
    (:mod:`.batch`) takes its ``join`` and ``split`` from it."""
    return _fast


def use_compiled(on: bool) -> bool:
    """Turn the compiled path on (where built) or off; returns the previous setting (for tests
    that run both codecs)."""
    global _fast
    before = _fast is not None
    _fast = _built if on else None
    return before
