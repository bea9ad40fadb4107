"""The base of every request declaration, its field types, and the validator compiled per op.

A declaration is a ``msgspec.Struct``: its fields are the op's arguments, their annotations the
types and limits (``msgspec.Meta``: lengths, ranges) and, for arrays, :class:`ArraySpec`. The
server converts a decoded body into it at its edge (``msgspec.convert``: C speed, no per-field
Python loop); the client builds the same class and the codec sends its fields (``wire/codec.py``: a request as
the map of its fields less their defaults, an item as its list). Items of lists are
``array_like`` structs, so they travel as the positional lists they always were.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from ...errors import InvalidArgument

__all__ = [
    "Request", "Item", "ArraySpec", "Validator", "compile_validator", "field_types", "unwrap",
    "NAME_MAX", "PATH_MAX", "MAX_PARTS", "MAX_ITEMS", "MAX_NDIM", "INT64_MAX",
    "Name", "Part", "Row", "Count", "Int", "Step", "Shape", "RowRange", "Dtype", "Spec", "Flag",
]

NAME_MAX = 1024  # variable, table and function names
PATH_MAX = 4096  # file system paths
MAX_PARTS = 1 << 16  # parts of one variable
MAX_ITEMS = 1 << 20  # entries of a list (the codec's container limit)
MAX_NDIM = 32
INT64_MAX = (1 << 63) - 1

# Descriptions read after "must be": they are the error's words and the SPEC's.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, description="a name of 1..1024 characters")]
Part = Annotated[int, msgspec.Meta(ge=0, lt=MAX_PARTS, description="a part index in 0..65535")]
Row = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX, description="a row index >= 0")]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX, description="an integer >= 0")]
Int = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX, description="an integer")]
Step = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX, description="an integer >= -1")]
Shape = Annotated[list[Row], msgspec.Meta(max_length=MAX_NDIM, description="a list of at most 32 dimensions >= 0")]
RowRange = Annotated[list[Row], msgspec.Meta(min_length=2, max_length=2, description="a row range [start, stop]")]
Dtype = Annotated[typing.Literal["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                 "float16", "bfloat16", "float32", "float64", "complex64", "complex128"],
                  msgspec.Meta(description="a wire dtype name (section 3)")]
Spec = Annotated[dict[str, Any], msgspec.Meta(max_length=64, description="a map of at most 64 entries")]
Flag = bool


@dataclass(frozen=True)
class ArraySpec:
    """What is known of an array field before the target variable is: its rank and dtype kinds
    (numpy ``dtype.kind`` letters). Checked at the edge; shapes against a part, by the store."""

    ndim: int | None = None
    kinds: str | None = None
    what: str = "an array"

    def fails(self, x: np.ndarray) -> bool:
        return (self.ndim is not None and x.ndim != self.ndim) or (self.kinds is not None and x.dtype.kind not in self.kinds)


class Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Arguments of one op. Unknown fields are refused; defaults are left off the wire."""


class Item(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One entry of a list argument, sent as a positional list."""


# validation (server side) ----------------------------------------------------------------------

Validator = Callable[[Any], Request]
_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def compile_validator(service: str, op: str, cls: type[Request]) -> Validator:
    """``body -> cls`` for one op: ``msgspec.convert`` plus the array checks the declaration
    names (none on most ops), with errors turned into ``InvalidArgument`` naming op and field."""
    convert, ValidationError = msgspec.convert, msgspec.ValidationError
    arrays = _array_checks(cls)
    specs = _spec_fields(cls)
    empty: dict[str, Any] = {}

    def validate(body: Any) -> Request:
        if body is None:  # no arguments: an empty map (explained as one when fields are missing)
            body = empty
        elif not isinstance(body, dict):  # msgspec would read an array's attributes or mapping protocol
            raise InvalidArgument(explain(service, op, cls, body, ""))
        try:
            req = convert(body, cls)
        except ValidationError as exc:
            raise InvalidArgument(explain(service, op, cls, body, str(exc))) from None
        except (AttributeError, TypeError):  # msgspec reads an array (mapping protocol) as a map, and fails
            raise InvalidArgument(_misfit(service, op, cls, body)) from None
        if arrays is not None:
            arrays(req, service, op)
        for name in specs:  # optimizer, initializer and table specs: recorded, compared, sent back
            if _holds_array(getattr(req, name)):
                raise InvalidArgument(f"{service}.{op}: {name} must hold plain values, not tensors")
        return req

    return validate


def _spec_fields(cls: type[Request]) -> tuple[str, ...]:
    """The fields of ``cls`` declared as a ``Spec`` (plain values only: they are kept and compared)."""
    mark = Spec.__metadata__[0]
    return tuple(n for n, tp in field_types(cls).items() if any(m is mark for m in unwrap(tp)[1]))


def _holds_array(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, dict):
        return any(_holds_array(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_array(v) for v in value)
    return False


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def unwrap(tp: Any) -> tuple[Any, list[Any]]:
    """(the bare type, its Annotated metadata), through Optional."""
    meta: list[Any] = []
    while typing.get_origin(tp) is Annotated:
        meta += list(tp.__metadata__)
        tp = tp.__origin__
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        inner, more = unwrap(next(a for a in args if a is not type(None)))
        return inner, meta + more
    return tp, meta


def _array_checks(cls: type[Request]) -> Callable[[Request, str, str], None] | None:
    """A checker for the ArraySpec fields of ``cls`` and of the items of its list fields, or None."""
    top: list[tuple[str, ArraySpec]] = []
    nested: list[tuple[str, list[tuple[int, str, ArraySpec]]]] = []
    for name, tp in field_types(cls).items():
        bare, meta = unwrap(tp)
        specs = [m for m in meta if isinstance(m, ArraySpec)]
        if specs:
            top.append((name, specs[0]))
        elif typing.get_origin(bare) is list:
            item, _ = unwrap(typing.get_args(bare)[0])
            if isinstance(item, type) and issubclass(item, Item):
                fields = [(i, n, s) for i, (n, t) in enumerate(field_types(item).items())
                          for s in unwrap(t)[1] if isinstance(s, ArraySpec)]
                if fields:
                    nested.append((name, fields))
    if not top and not nested:
        return None

    def check(req: Request, service: str, op: str) -> None:
        for name, spec in top:
            x = getattr(req, name)
            if x is not None and spec.fails(x):
                _bad_array(service, op, name, spec, x)
        for name, fields in nested:
            for i, it in enumerate(getattr(req, name)):
                for _, field, spec in fields:
                    x = getattr(it, field)
                    if spec.fails(x):
                        _bad_array(service, op, f"{name}[{i}].{field}", spec, x)

    return check


def _bad_array(service: str, op: str, field: str, spec: ArraySpec, x: np.ndarray) -> None:
    raise InvalidArgument(f"{service}.{op}: {field} must be {spec.what}, got {x.dtype} of shape {list(x.shape)}")


def explain(service: str, op: str, cls: type[Request], body: Any, detail: str) -> str:
    """A msgspec validation error as a sentence naming the op and the field at fault."""
    where = f"{service}.{op}"
    if not isinstance(body, dict) and body is not None:
        return f"{where}: arguments must be a map, got {type(body).__name__}"
    text, path = _AT.match(detail).groups()  # type: ignore[union-attr]
    fields = cls.__struct_fields__
    if not path and "unknown field" in text:
        unknown = ", ".join(sorted(str(k) for k in body if k not in fields))  # type: ignore[union-attr]
        return f"{where}: unexpected argument(s) {unknown}"
    if not path and "missing required field" in text:
        missing = ", ".join(f for f in cls.__struct_fields__ if f not in body and f in _required(cls))  # type: ignore[operator]
        return f"{where}: missing argument(s) {missing}"
    if not path:
        return f"{where}: {_lower(text)}"
    named, top, leaf = _name_path(cls, path)
    inner = f"{named}: {_lower(text)}"
    if leaf is not None and _description(leaf):
        inner = f"{named} must be {_description(leaf)}: {_lower(text)}"
    outer = _description(field_types(cls).get(top))
    if outer and named != top:
        return f"{where}: {top} must be {outer} ({inner})"
    return f"{where}: {inner}"


def _misfit(service: str, op: str, cls: type[Request], body: Any) -> str:
    """Why a body msgspec could not even read is refused: an array where a map is declared."""
    where = f"{service}.{op}"
    if isinstance(body, dict):
        for name, value in body.items():
            if isinstance(value, np.ndarray) and name in cls.__struct_fields__:
                outer = _description(field_types(cls).get(name))
                return f"{where}: {name} must be {outer or 'a map'}, got an array"
    return f"{where}: arguments do not match the declaration (an array where a map is expected)"


def _required(cls: type[Request]) -> set[str]:
    defaults = len(cls.__struct_defaults__)
    fields = cls.__struct_fields__
    return set(fields[: len(fields) - defaults])


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]


def _name_path(cls: type, path: str) -> tuple[str, str, Any]:
    """``.items[0][1]`` as ``items[0].part`` (positions in array-like items named), the top
    field, and the type of the last step (None when unknown)."""
    out, top, tp = "", "", cls
    for field, index in _STEP.findall(path):
        bare, _ = unwrap(tp) if tp is not None else (None, [])
        if field:
            out += ("." if out else "") + field
            top = top or field
            tp = field_types(bare).get(field) if isinstance(bare, type) and issubclass(bare, msgspec.Struct) else None
        elif isinstance(bare, type) and issubclass(bare, Item):
            names = list(field_types(bare))
            i = int(index)
            name = names[i] if i < len(names) else index
            out += f".{name}"
            tp = field_types(bare).get(name)
        else:
            out += f"[{index}]"
            args = typing.get_args(bare) if bare is not None else ()
            tp = args[-1] if args else None
    return out, top, tp


def _description(tp: Any) -> str | None:
    if tp is None:
        return None
    for m in unwrap(tp)[1]:
        if isinstance(m, msgspec.Meta) and m.description:
            return m.description
    return None
