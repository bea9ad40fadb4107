"""``--cluster``'s value, for launch and stop: inline JSON or a file's path, every error one
line naming the value and what was expected."""

from __future__ import annotations

import json
import os
from typing import Any

from ..cluster import ClusterSpec, resolve
from ..errors import ConfigError

__all__ = ["load_cluster_arg"]


_CLUSTER_SHAPE = 'a JSON object mapping job names to address lists, e.g. {"worker": ["127.0.0.1:2222"]}'
_JSON_KINDS = {list: "a JSON array", str: "a JSON string", int: "a JSON number", float: "a JSON number",
               bool: "a JSON boolean", type(None): "JSON null"}


def load_cluster_arg(value: str) -> ClusterSpec:
    """``--cluster``'s value: inline JSON (it starts with ``{`` or ``[``) or a file's path.

    Every error is one line naming the value and what was expected."""
    shown = value if len(value) <= 80 else value[:77] + "..."
    text = value.strip()
    if text[:1] in ("{", "["):
        source = f"--cluster {shown!r}"
    else:
        source = f"--cluster file {shown!r}"
        if not os.path.exists(value):
            raise ConfigError(f"--cluster {shown!r}: no such file; expected a cluster file's path or inline JSON, "
                              f"{_CLUSTER_SHAPE}")
        try:
            with open(value, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{source}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                          f"expected {_CLUSTER_SHAPE}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} is {_JSON_KINDS.get(type(data), 'not an object')}; expected {_CLUSTER_SHAPE}")
    if not data:
        raise ConfigError(f"{source} names no jobs; expected {_CLUSTER_SHAPE}")
    try:
        spec, _ = resolve(data, None, env={}, require_task=False)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return spec
