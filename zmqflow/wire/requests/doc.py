"""The request tables of ``protocol/SPEC.md``, rendered from the declarations (a test compares)."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import numpy as np

from . import SERVICES
from .base import ArraySpec, Item, field_types, unwrap
from .cluster import OPEN

__all__ = ["request_tables", "BEGIN", "END"]

BEGIN = "<!-- requests: generated from zmqflow/wire/requests by protocol/make_vectors.py; do not edit -->"
END = "<!-- end of requests -->"


def _type(tp: Any) -> str:
    bare, meta = unwrap(tp)
    while typing.get_origin(tp) is typing.Annotated:
        tp = tp.__origin__
    optional = type(None) in typing.get_args(tp)
    base = _bare(bare, meta)
    return f"{base} or nil" if optional else base


def _bare(bare: Any, meta: list[Any]) -> str:
    if bare is np.ndarray:
        return "tensor"
    if typing.get_origin(bare) is typing.Literal:
        values = typing.get_args(bare)
        return "str" if len(values) > 4 else " \\| ".join(f"`{v}`" for v in values)
    if typing.get_origin(bare) is list:
        item, item_meta = unwrap(typing.get_args(bare)[0])
        if isinstance(item, type) and issubclass(item, Item):
            inner = ", ".join(f"{n}: {_type(t)}" for n, t in field_types(item).items())
            return f"array of [{inner}]"
        return f"array of {_bare(item, item_meta)}"
    if typing.get_origin(bare) is dict:
        return f"map of str to {_bare(*unwrap(typing.get_args(bare)[1]))}"
    names = {str: "str", int: "int", float: "float", bool: "bool", Any: "any"}
    return names.get(bare, getattr(bare, "__name__", str(bare)))


def _limits(tp: Any) -> str:
    for m in unwrap(tp)[1]:
        if isinstance(m, msgspec.Meta) and m.description:
            return m.description
        if isinstance(m, ArraySpec):
            return m.what
    return "an array" if unwrap(tp)[0] is np.ndarray else ""


def request_tables() -> str:
    """One markdown table per service: op, field, type, default, limits."""
    out = [BEGIN]
    for service, ops in SERVICES.items():
        out += ["", f"**{service}**", "", "| op | field | type | default | must be |", "|---|---|---|---|---|"]
        for op, cls in ops.items():
            if cls is OPEN:
                out.append(f"| `{op}` | (any) | map of str to any value | | any fields |")
                continue
            fields = list(field_types(cls).items())
            if not fields:
                out.append(f"| `{op}` | (none) | | | |")
            defaults = dict(zip(cls.__struct_fields__[len(cls.__struct_fields__) - len(cls.__struct_defaults__):],
                                cls.__struct_defaults__))
            for name, tp in fields:
                default = "required" if name not in defaults else f"`{_default(defaults[name])}`"
                if default == "`<factory>`":
                    default = "`[]`"
                out.append(f"| `{op}` | `{name}` | {_type(tp)} | {default} | {_limits(tp)} |")
    out += ["", END]
    return "\n".join(out)


def _default(value: Any) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
