"""Reading timeline files and joining several into one trace (``zmqflow timeline merge``).

A file may come from a process that was killed: the JSON array then lacks its closing bracket,
and its last event may be cut short. Both are accepted (what was written whole is kept), as the
Trace Event Format's loaders do. The object form (``{"traceEvents": [...]}``) is read too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from ..errors import InvalidArgument, NotFound

__all__ = ["read_trace", "merge", "write_trace", "task_order"]

_decoder = json.JSONDecoder()


def _events_of(text: str, path: str) -> list[dict[str, Any]]:
    body = text.lstrip()
    if body.startswith("{"):
        try:
            doc = json.loads(body)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{path}: not a Chrome trace (a JSON object that does not parse: {exc})") from None
        events = doc.get("traceEvents") if isinstance(doc, dict) else None
        if not isinstance(events, list):
            raise InvalidArgument(f"{path}: not a Chrome trace (a JSON object without a traceEvents list)")
        return events
    if not body.startswith("["):
        raise InvalidArgument(f"{path}: not a Chrome trace (it does not start with '[' or '{{')")
    events: list[Any] = []
    i, n = 1, len(body)
    while True:
        while i < n and body[i] in " \t\r\n,":
            i += 1
        if i >= n or body[i] == "]":  # the end, with or without its closing bracket
            return events
        try:
            event, i = _decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            if body.rstrip().endswith("]"):  # the array is closed, so this is no cut-short tail
                raise InvalidArgument(f"{path}: not a Chrome trace (event {len(events) + 1} does not parse)") from None
            return events  # the last event was cut short by a kill: keep what came before
        events.append(event)


def read_trace(path: str) -> list[dict[str, Any]]:
    """The events of one trace file, checked to be events (objects with a ``ph``) whose fields the
    merge reads have the types it needs: a valid JSON file of anything else is named, not crashed on."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise NotFound(f"{path}: no such timeline file") from None
    except IsADirectoryError:
        raise InvalidArgument(f"{path}: a directory, not a timeline file") from None
    except UnicodeDecodeError:
        raise InvalidArgument(f"{path}: not a Chrome trace (not UTF-8 text)") from None
    events = _events_of(text, path)
    for k, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("ph"), str):
            raise InvalidArgument(f"{path}: not a Chrome trace (item {k + 1} is not an event with a 'ph')")
        problem = _field_problem(e)
        if problem is not None:
            raise InvalidArgument(f"{path}: not a Chrome trace (event {k + 1}, ph {e['ph']!r}: {problem})")
    return events


def _field_problem(event: dict[str, Any]) -> str | None:
    """What is wrong with the fields merge uses: ``pid`` and ``tid`` name tracks (a number or a
    string), ``args`` is an object."""
    for key in ("pid", "tid"):
        if key in event:
            value = event[key]
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                return f"{key!r} is {_json_kind(value)}, expected a number or a string"
    args = event.get("args")
    if args is not None and not isinstance(args, dict):
        return f"'args' is {_json_kind(args)}, expected an object"
    return None


def _json_kind(value: Any) -> str:
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"),
             ((int, float), "a number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def task_order(name: str) -> tuple[int, str, int, str]:
    """Chief, then ps, then workers, then anything else; by index within a job."""
    job, _, index = name.partition(":")
    rank = {"chief": 0, "ps": 1, "worker": 2, "evaluator": 3}.get(job, 4)
    return (rank, job, int(index) if index.isdigit() else 0, name)


def merge(paths: Iterable[str]) -> list[dict[str, Any]]:
    """One trace of several files: each task is one process (``pid``) whichever files hold it,
    each file's threads keep their own tracks, timestamps as recorded (they are wall-clock
    anchored, so tasks line up)."""
    loaded = [(p, read_trace(p)) for p in paths]
    names: dict[tuple[int, Any], str] = {}
    for f, (path, events) in enumerate(loaded):
        for e in events:
            if e["ph"] == "M" and e.get("name") == "process_name":
                names[(f, e.get("pid"))] = str((e.get("args") or {}).get("name"))
    for f, (path, events) in enumerate(loaded):
        for e in events:
            if "pid" in e and (f, e["pid"]) not in names:
                names[(f, e["pid"])] = f"{os.path.basename(path)}:{e['pid']}"
    tasks = sorted(set(names.values()), key=task_order)
    pid_of = {t: i + 1 for i, t in enumerate(tasks)}
    out: list[dict[str, Any]] = []
    for t in tasks:
        out.append({"ph": "M", "name": "process_name", "pid": pid_of[t], "tid": 0, "args": {"name": t}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid_of[t], "tid": 0,
                    "args": {"sort_index": pid_of[t]}})
    tids: dict[tuple[int, Any, Any], int] = {}
    per_pid: dict[int, int] = {}
    for f, (_, events) in enumerate(loaded):
        for e in events:
            if e["ph"] == "M" and e.get("name") in ("process_name", "process_sort_index"):
                continue
            e = dict(e)
            if "pid" in e:
                pid = pid_of[names[(f, e["pid"])]]
                if "tid" in e:
                    key = (f, e["pid"], e["tid"])
                    if key not in tids:
                        per_pid[pid] = per_pid.get(pid, 0) + 1
                        tids[key] = per_pid[pid]
                    e["tid"] = tids[key]
                e["pid"] = pid
            out.append(e)
    return out


def write_trace(path: str, events: list[dict[str, Any]], sources: list[str] | None = None) -> None:
    """``events`` as one trace file (the object form, so it names the files it came from)."""
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if sources:
        doc["otherData"] = {"merged_from": sources}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    os.replace(tmp, path)
