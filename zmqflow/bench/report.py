"""Tables, labels and JSON lines shared by the benchmarks, and the ``python -m`` entry of each."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["KiB", "MiB", "align", "cell", "script_main", "size_label", "write_jsonl"]

KiB, MiB = 1 << 10, 1 << 20


def align(lines: list[list[str]]) -> list[str]:
    """Rows of cells, right-aligned in columns."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines]


def cell(value: Any, spec: str = "") -> str:
    """``value`` formatted by ``spec``; ``-`` for a measurement that was not made."""
    return "-" if value is None else format(value, spec)


def size_label(size: int, kib: str = "KiB", mib: str = "MiB") -> str:
    """``64 B``, ``4 KiB``, ``16 MiB`` (binary units, under the names given)."""
    for unit, m in ((mib, MiB), (kib, KiB)):
        if size >= m and size % m == 0:
            return f"{size // m} {unit}"
    return f"{size} B"


def write_jsonl(path: str, records: Iterable[dict[str, Any]], append: bool = True) -> None:
    """One JSON object per line; ``append`` keeps what the file holds (several runs, one file)."""
    with open(path, "a" if append else "w") as fh:
        fh.writelines(json.dumps(record) + "\n" for record in records)


def script_main(doc: str | None, run: Callable[..., Any], format_table: Callable[[Any], str]) -> None:
    """``python -m zmqflow.bench.<name> [--quick] [--json FILE]``: run, then print the table."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(format_table(run(quick=args.quick, json_out=args.json)))
