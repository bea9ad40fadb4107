"""How a declared request goes on the wire: a msgspec struct as the map of its fields, leaving
off those equal to their defaults (the receiver fills them in), and an item (``array_like``) as
the list of all its fields. The Python codec and the compiled one (``codec_c.c``) both write
structs by the rules here, so their bytes agree.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["REQUIRED", "layout", "sent_fields"]

REQUIRED = object()  # the "default" of a field that has none: always sent
_astuple = msgspec.structs.astuple
_defaults: dict[type, dict[str, Any] | None] = {}


def _defaults_of(cls: type) -> dict[str, Any] | None:
    """None for an array-like struct (sent as a list); else its fields' defaults, left off the
    wire. Worked out once per struct type."""
    if cls in _defaults:
        return _defaults[cls]
    found = None
    if not cls.__struct_config__.array_like:
        found = {}
        for f in msgspec.structs.fields(cls):
            if f.default is not msgspec.NODEFAULT:
                found[f.name] = f.default
            elif f.default_factory is not msgspec.NODEFAULT:
                found[f.name] = f.default_factory()
    _defaults[cls] = found
    return found


def _sent(value: Any, default: Any) -> bool:
    """Whether a field goes on the wire: always when required, else when it is not its default
    (compared only with a value of the default's own type: arrays are never defaults)."""
    if default is REQUIRED:
        return True
    if default is None:
        return value is not None
    return type(value) is not type(default) or value != default


def sent_fields(obj: msgspec.Struct) -> list[Any] | dict[str, Any]:
    """``obj``'s fields as they go on the wire (values not yet encoded): a list for an item, else
    a map of the fields that differ from their defaults."""
    cls = type(obj)
    found = _defaults_of(cls)
    values = _astuple(obj)
    if found is None:
        return list(values)
    if not found:  # no defaults (a ring deposit): every field goes
        return dict(zip(cls.__struct_fields__, values))
    return {k: v for k, v in zip(cls.__struct_fields__, values) if _sent(v, found.get(k, REQUIRED))}


def layout(cls: type) -> tuple[bool, tuple[str, ...], tuple[Any, ...]]:
    """What the compiled writer needs to apply the same rules: whether the struct goes as a list,
    its fields, and each one's default (``REQUIRED`` where it has none)."""
    found = _defaults_of(cls)
    names = tuple(cls.__struct_fields__)
    if found is None:
        return True, names, (REQUIRED,) * len(names)
    return False, names, tuple(found.get(k, REQUIRED) for k in names)
