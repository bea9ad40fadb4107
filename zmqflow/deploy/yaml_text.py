"""Block-style YAML for manifests, without a YAML library.

The manifests are plain data (mappings, lists, strings, integers, booleans), so a small emitter
covers them: a string is written bare only when YAML cannot read it as anything else, else as a
double-quoted scalar (JSON's escapes, which YAML shares, plus ``\\u`` escapes for what YAML would
take for a line break or refuse in a stream), and a string of several lines as a literal block.
Header lines become comments line by line, so no text in them can reach the stream. Writing it
here keeps PyYAML out of the core dependencies for one command; the tests read every output back
with PyYAML to hold the emitter to that.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["dump_all"]

_PLAIN = re.compile(r"^[A-Za-z_/$][A-Za-z0-9_./$-]*$")
# words YAML 1.1 readers take for booleans or null
_RESERVED = frozenset({"y", "n", "yes", "no", "true", "false", "on", "off", "null"})
_BLOCK_LINE = re.compile(r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]*$")
# what JSON leaves raw but YAML reads as a line break (\x85, \u2028, \u2029) or refuses in a stream
_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")
# YAML's line breaks: a comment ends at any of them, so each line of a comment needs its own '#'
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")
# what a comment cannot hold: control characters and the above
_COMMENT_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _quoted(value: str) -> str:
    """``value`` as a YAML double-quoted scalar that reads back exactly. JSON escapes what is below
    0x20 and leaves astral characters raw (YAML reads no surrogate pairs); the rest is escaped here."""
    return _UNSAFE.sub(_escape, json.dumps(value, ensure_ascii=False))


def _comment(line: str) -> list[str]:
    """One header line as comment lines: each line break in it starts a new line with its own '#',
    so no text of it can land outside the comment."""
    return [f"# {_COMMENT_UNSAFE.sub(_escape, part)}".rstrip() for part in _LINE_BREAK.split(line)]


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        if _PLAIN.match(value) and value.lower() not in _RESERVED:
            return value
        return _quoted(value)
    if isinstance(value, Mapping) and not value:
        return "{}"
    if isinstance(value, Sequence) and not value:
        return "[]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as YAML")


def _literal(value: Any, pad: str) -> list[str] | None:
    """A string of several lines as a literal block (``|``), when it can be one."""
    if not isinstance(value, str) or "\n" not in value.rstrip("\n"):
        return None
    lines = value.rstrip("\n").split("\n")
    if lines[0].startswith(" ") or any(line != line.rstrip() or not _BLOCK_LINE.match(line) for line in lines):
        return None
    chomp = "" if value.endswith("\n") and not value.endswith("\n\n") else "-" if not value.endswith("\n") else None
    if chomp is None:
        return None
    return [f"|{chomp}"] + [f"{pad}{line}" if line else "" for line in lines]


def _block(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    out: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            head = f"{pad}{_scalar(str(key))}:"
            if isinstance(item, (Mapping, list, tuple)) and item:
                out.append(head)
                out.extend(_block(item, indent + 1))
            elif (block := _literal(item, pad + "  ")) is not None:
                out.append(f"{head} {block[0]}")
                out.extend(block[1:])
            else:
                out.append(f"{head} {_scalar(item)}")
        return out
    for item in value:
        if isinstance(item, (Mapping, list, tuple)) and item:
            inner = _block(item, indent + 1)
            out.append(f"{pad}- {inner[0][len(pad) + 2:]}")
            out.extend(inner[1:])
        else:
            out.append(f"{pad}- {_scalar(item)}")
    return out


def dump_all(documents: Iterable[Mapping[str, Any]], header: Sequence[str] = ()) -> str:
    """Documents separated by ``---``, after ``header`` lines written as comments."""
    lines = [text for line in header for text in _comment(line)]
    for doc in documents:
        lines.append("---")
        lines.extend(_block(doc, 0))
    return "\n".join(lines) + "\n"
