"""Settings read from the environment: a bad value stops the process naming the variable."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["bounded_int"]


def bounded_int(name: str, low: int, high: int, default: int, environ: Mapping[str, str] | None = None) -> int:
    """The integer in ``name`` (``default`` when unset or blank); ConfigError unless ``low <= n <= high``."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = low - 1
    if not low <= n <= high:
        raise ConfigError(f"{name} must be an integer from {low} to {high}, got {raw!r}")
    return n
