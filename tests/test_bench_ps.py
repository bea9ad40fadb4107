"""The ps benchmark moves a real model both ways and reports GB/s, CPU per GB and their ratios."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from zmqflow.bench import ps
from zmqflow.bench.machine import cpu_seconds

pytestmark = pytest.mark.timeout(120)


def test_cpu_seconds_grow_with_work_and_say_none_for_a_missing_process() -> None:
    before = cpu_seconds([os.getpid()])
    assert before is not None
    x = np.ones(1 << 20)
    for _ in range(200):
        x = x * 1.000001
    after = cpu_seconds([os.getpid()])
    assert after is not None and after > before
    assert cpu_seconds([os.getpid(), 2**22 + 12345]) is None  # above the kernel's pid limit: no such process


def test_phases_note_wall_and_cpu_per_name() -> None:
    phases = ps.Phases()
    for _ in range(3):
        phases.timed("work", lambda: np.ones(1 << 18).sum())
    assert len(phases.wall["work"]) == 3 and phases.median_wall("work") > 0
    cpu = phases.median_cpu("work")
    assert cpu is not None and cpu >= 0
    assert phases.median_cpu("never") is None


def test_a_tiny_run_reports_every_ratio_and_its_cpu() -> None:
    printed: list[str] = []
    rows = ps.run(shards=(2,), model_mb=2, nvars=4, reps=2, trips=40, echo=printed.append)
    (row,) = rows
    assert row["shards"] == 2 and printed and "2 shard(s)" in printed[0]
    for name in ("zf_pull", "zf_fresh", "zf_push", "raw_pull", "raw_push"):
        assert math.isfinite(row[f"{name}_gbps"]) and row[f"{name}_gbps"] > 0
        assert row[f"{name}_cpu_s_per_gb"] is not None and row[f"{name}_cpu_s_per_gb"] > 0
    for what, zf, raw in (("pull", "zf_pull", "raw_pull"), ("pull_fresh", "zf_fresh", "raw_pull"),
                          ("push", "zf_push", "raw_push")):
        assert row[f"{what}_ratio"] == pytest.approx(row[f"{zf}_gbps"] / row[f"{raw}_gbps"])
        assert row[f"{what}_cpu_ratio"] == pytest.approx(row[f"{zf}_cpu_s_per_gb"] / row[f"{raw}_cpu_s_per_gb"])
    assert row["zf_assign_add_per_s"] > 0 and row["raw_rtt_per_s"] > 0 and row["raw_loop_rtt_per_s"] > 0
    assert row["scalar_loop_ratio"] == pytest.approx(row["zf_assign_add_per_s"] / row["raw_loop_rtt_per_s"])
    table = ps.format_table(rows)
    assert "CPU s/GB" in table and "targets:" in table and "2 shard(s):" in table
    assert "awaited on the asyncio loop" in table
