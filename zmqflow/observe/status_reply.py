"""A task's ``master.status`` reply, reduced to the fields its readers use, each of the type they expect.

Whatever answers at a task's address writes that reply: another version of zmqflow, a task half
broken, or a program that is not zmqflow at all. The readers (the status table, the watch's cells
and its rates) take a row through :func:`clean_status`, which drops every field of another type,
so one odd peer shows as a row with less in it, never as a crash that hides every other task.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["clean_status", "MALFORMED"]

# The error of the row of a task whose reply is not a map at all.
MALFORMED = "malformed status reply"

_PROGRESS_COUNTS = ("step", "samples", "restarts", "errors")
_PROGRESS_TIMES = ("error_at", "error_age_s", "reported_at")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or a finite float (a bool is not a number here, nor NaN: neither formats as one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not isinstance(value, float) or math.isfinite(value)


def _progress(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, Any] = {k: value[k] for k in _PROGRESS_COUNTS if _is_int(value.get(k))}
    out.update((k, value[k]) for k in _PROGRESS_TIMES if _is_number(value.get(k)))
    if isinstance(value.get("error"), str):
        out["error"] = value["error"]
    return out


def clean_status(row: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``row`` (a status reply, or a row of ``zmqflow status``) that the readers use,
    each only when of the expected type: numbers are ints or finite floats (not bools), ``roles`` a
    list of str, ``state`` a map of str to str (values made str), ``counters`` a map to ints."""
    if not isinstance(row, Mapping):
        return {}
    out: dict[str, Any] = {k: row[k] for k in ("task", "address", "error") if isinstance(row.get(k), str)}
    if isinstance(row.get("reachable"), bool):
        out["reachable"] = row["reachable"]
    if _is_int(row.get("pid")):
        out["pid"] = row["pid"]
    if _is_number(row.get("uptime_s")):
        out["uptime_s"] = row["uptime_s"]
    roles = row.get("roles")
    if isinstance(roles, (list, tuple)):
        out["roles"] = [r for r in roles if isinstance(r, str)]
    state = row.get("state")
    if isinstance(state, Mapping):
        out["state"] = {str(k): str(v) for k, v in state.items()}
    counters = row.get("counters")
    if isinstance(counters, Mapping):
        out["counters"] = {k: v for k, v in counters.items() if isinstance(k, str) and _is_int(v)}
    if "progress" in row:
        out["progress"] = _progress(row["progress"])
    return out
