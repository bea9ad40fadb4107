"""Throughput against size, drawn from a benchmark's rows (``--plot FILE``): one curve per system and
shard or rank count, so where one system overtakes another is seen at a glance. matplotlib is an
optional extra (``[plot]``), imported only when a figure is drawn."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

__all__ = ["MISSING", "available", "plot_allreduce", "plot_ps", "plot_ps_vs_tf1"]

MISSING = "--plot needs matplotlib: pip install 'zmqflow[plot]'"

Series = dict[str, list[tuple[float, float]]]


def available() -> bool:
    """Whether matplotlib can be found (checked before a long run, not after it)."""
    return importlib.util.find_spec("matplotlib") is not None


def _draw(path: str, title: str, xlabel: str, ylabel: str, series: Series, logx: bool = False) -> None:
    """One line per series (markers on every point: a single size still shows), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for label, points in series.items():
            points = sorted(points)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                    linestyle="--" if label.startswith(("tf1", "raw", "gloo", "ps ")) else "-", label=label)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)  # ratios read honestly off the heights
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _add(series: Series, label: str, x: float, y: float | None) -> None:
    if y is not None:
        series.setdefault(label, []).append((x, y))


def plot_ps_vs_tf1(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Dense step GB/s (bytes pulled and pushed per second) against model size, zmqflow and tf1."""
    series: Series = {}
    for r in rows:
        if r["measure"] == "dense step":
            mb = r["size_bytes"] / 1e6
            _add(series, f"zmqflow {r['ps']} ps", mb, r["zmqflow"])
            _add(series, f"tf1 {r['ps']} ps", mb, r["tf1"])
    _draw(path, "dense step (pull + SGD push): zmqflow vs TF1 gRPC ps", "model MB", "GB/s", series)


def plot_ps(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Pull and push GB/s against model size per shard count, zmqflow and raw pyzmq."""
    series: Series = {}
    for r in rows:
        for what in ("pull", "push"):
            _add(series, f"zmqflow {what} {r['shards']} shard(s)", r["model_mb"], r[f"zf_{what}_gbps"])
            _add(series, f"raw {what} {r['shards']} shard(s)", r["model_mb"], r[f"raw_{what}_gbps"])
    _draw(path, "ps pull / push: zmqflow vs raw pyzmq", "model MB", "GB/s", series)


def plot_allreduce(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Bus bandwidth against tensor size per rank count: the ring, gloo and the PS way."""
    series: Series = {}
    for r in rows:
        _add(series, f"zmqflow ring {r['ranks']} ranks", r["bytes"], r["zf_busbw"])
        _add(series, f"gloo {r['ranks']} ranks", r["bytes"], r["gloo_busbw"])
        _add(series, f"ps push+pull {r['ranks']} ranks", r["bytes"], r["ps_busbw"])
    _draw(path, "allreduce (sum, float32)", "bytes", "busbw GB/s", series, logx=True)
