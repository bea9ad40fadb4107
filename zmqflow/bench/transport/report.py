"""The transport benchmark's table: one line per transport x size, then which targets were met
and which rows other processes disturbed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..report import cell, size_label
from .plan import LAT_TARGET, LAT_TARGET_MAX_BYTES, SMALL_TPUT_TARGET, TPUT_TARGET, TPUT_TARGET_INPROC, TPUT_TARGET_MIN_BYTES

__all__ = ["DISTURBED_CPUS", "format_curve_table", "format_table"]

DISTURBED_CPUS = 0.25  # rows where other processes used more CPU than this are flagged

_COLUMNS = (
    # header, key, format spec
    ("transport", "transport", ""),
    ("security", "security", ""),
    ("size", "size", ""),
    ("zf msg/s", "zf_msgs_per_s", ",.0f"),
    ("zf GB/s", "zf_gbps", ".3g"),
    ("raw GB/s", "raw_gbps", ".3g"),
    ("zf/raw", "tput_ratio", ".2f"),
    ("zf p50 us", "zf_p50_us", ",.0f"),
    ("zf p99 us", "zf_p99_us", ",.0f"),
    ("raw p50 us", "raw_p50_us", ",.0f"),
    ("raw p99 us", "raw_p99_us", ",.0f"),
    ("lat zf/raw", "lat_ratio", ".2f"),
    ("memcpy GB/s", "memcpy_gbps", ".3g"),
    ("other CPU", "other_cpu", ".2f"),
)


def _cell(spec: str, value: Any) -> str:
    if isinstance(value, float) and spec == ",.0f" and abs(value) < 100:
        return f"{value:.1f}"  # a rate or latency under 100 keeps one decimal
    return cell(value, spec)


def format_table(rows: Sequence[dict[str, Any]], targets: bool = True) -> str:
    """The rows as an aligned text table, followed (``targets``) by which targets were met."""
    cells = [[h for h, _, _ in _COLUMNS]] + [[_cell(f, r.get(k)) for _, k, f in _COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    out = []
    for j, line in enumerate(cells):
        padded = (c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        out.append("  ".join(padded).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    if targets:
        out.append("")
        out.extend(_target_lines(rows))
    disturbed = [f"{r['transport']} {r['size']}" for r in rows if (r.get("other_cpu") or 0) > DISTURBED_CPUS]
    if any("other_cpu" in r for r in rows):
        out.append(
            "other CPU: CPUs kept busy by other processes while the row was measured"
            + (f"; disturbed (> {DISTURBED_CPUS}): {', '.join(disturbed)}" if disturbed else " (none disturbed)")
        )
    return "\n".join(out)


def _target_line(rows: Sequence[dict[str, Any]], met: str, ratio: str, what: str) -> list[str]:
    """``what: met k/n; missed: ...`` over the rows the target applies to (none: no line)."""
    judged = [r for r in rows if r.get(met) is not None]
    if not judged:
        return []
    missed = [f"{r['transport']} {r['size']} (x{r[ratio]:.2f})" for r in judged if not r[met]]
    return [f"{what}: met {len(judged) - len(missed)}/{len(judged)}" + (f"; missed: {', '.join(missed)}" if missed else "")]


def _target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    return _target_line(
        rows, "target_tput_met", "tput_ratio",
        f"throughput target (zmqflow >= {TPUT_TARGET}x raw at >= {size_label(TPUT_TARGET_MIN_BYTES)}; "
        f"inproc >= {TPUT_TARGET_INPROC}x)",
    ) + _target_line(
        rows, "target_small_tput_met", "tput_ratio",
        f"small-message target (zmqflow >= {SMALL_TPUT_TARGET}x raw throughput at {size_label(LAT_TARGET_MAX_BYTES)})",
    ) + _target_line(
        rows, "target_lat_met", "lat_ratio",
        f"latency target (zmqflow p50 <= {LAT_TARGET}x raw at {size_label(LAT_TARGET_MAX_BYTES)})",
    ) + _loop_floor_lines(rows)


def _loop_floor_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """zmqflow's small round trip beside raw pyzmq's awaited on an asyncio loop: how much of the
    gap to a blocking ``recv`` any loop-driven client pays, zmqflow's code or not."""
    floor = [r for r in rows if r.get("loop_p50_us")]
    if not floor:
        return []
    cells = [f"{r['transport']} {r['size']} {r['loop_p50_us']:.0f} us, zmqflow x{r['lat_ratio_loop']:.2f}"
             for r in floor]
    return ["raw pyzmq awaited on the asyncio loop (p50; the floor of a loop-driven client): " + "; ".join(cells)]


def format_curve_table(rows: Sequence[dict[str, Any]]) -> str:
    """What CurveZMQ costs: zmqflow's throughput and p50 latency with CURVE off and on, per
    transport and size, and raw pyzmq's throughput on and off for the same transfers."""
    plain = {(r["transport"], r["size_bytes"]): r for r in rows if r.get("security", "plain") == "plain"}
    lines = [["transport", "size", "zf GB/s off", "zf GB/s on", "on/off", "raw GB/s off", "raw GB/s on",
              "zf p50 us off", "zf p50 us on", "p50 on/off"]]
    for r in rows:
        off = plain.get((r["transport"], r["size_bytes"])) if r.get("security") == "curve" else None
        if off is None:
            continue
        lines.append([r["transport"], r["size"], cell(off["zf_gbps"], ".3g"), cell(r["zf_gbps"], ".3g"),
                      cell(r["zf_gbps"] / off["zf_gbps"], ".2f"), cell(off["raw_gbps"], ".3g"), cell(r["raw_gbps"], ".3g"),
                      _cell(",.0f", off["zf_p50_us"]), _cell(",.0f", r["zf_p50_us"]),
                      cell(r["zf_p50_us"] / off["zf_p50_us"], ".2f")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["CurveZMQ on beside off (encryption + authentication; inproc has no handshake, so no CURVE):"]
    for j, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
