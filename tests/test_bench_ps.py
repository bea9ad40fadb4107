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


def test_raw_opens_a_connection_per_zmqflow_stream(monkeypatch) -> None:
    """The baseline gets as many connections (each with an I/O thread) as zmqflow's session opens
    streams: its lanes in all for a pull, one a shard at least; one a shard below the bulk size."""
    monkeypatch.delenv("ZMQFLOW_BULK_LANES", raising=False)
    monkeypatch.delenv("ZMQFLOW_BULK", raising=False)
    assert ps.zf_streams(1, 20_000_000) == [2]
    assert ps.zf_streams(2, 20_000_000) == [1, 1]
    assert ps.zf_streams(4, 100_000_000) == [1, 1, 1, 1]
    assert ps.zf_streams(1, 500_000) == [1]  # a share under BULK_FROM stays on ZeroMQ
    monkeypatch.setenv("ZMQFLOW_BULK_LANES", "3")
    assert ps.zf_streams(2, 64_000_000) == [2, 1]
    monkeypatch.setenv("ZMQFLOW_BULK", "0")
    assert ps.zf_streams(1, 64_000_000) == [1]


def test_both_sides_run_plaintext_whatever_zmqflow_keys_says(monkeypatch, tmp_path) -> None:
    """A ZMQFLOW_KEYS in the environment reaches neither zmqflow's servers nor its client (here a
    directory that does not exist: any process reading it would fail), and is put back after."""
    monkeypatch.setenv("ZMQFLOW_KEYS", str(tmp_path / "no-such-keys"))
    (row,) = ps.run(shards=(1,), model_mb=20, nvars=4, reps=1, trips=8, echo=lambda _: None)
    assert row["security"] == "plaintext"
    assert row["zf_pull_streams"] == row["raw_pull_conns"] and row["raw_io_threads"] >= sum(row["raw_pull_conns"])
    assert os.environ["ZMQFLOW_KEYS"] == str(tmp_path / "no-such-keys")
    assert "raw pyzmq over as many connections" in ps.format_table([row])
