"""``zmqflow bench fold``: both sides run and agree, the table and JSON say what was measured."""

from __future__ import annotations

import json

from click.testing import CliRunner

from zmqflow.bench import fold as fold_bench
from zmqflow.cli.bench import bench
from zmqflow.state import kernels


def test_the_fold_bench_times_both_ways(tmp_path) -> None:
    out = tmp_path / "fold.json"
    rows = fold_bench.run(mb=5, reps=1, ranks=(2, 3), json_out=str(out))
    assert [r["ranks"] for r in rows] == [2, 3]
    for r in rows:
        assert r["numpy_ms"] > 0 and len(r["numpy_s"]) == 1 and r["streamed"]  # 5 MB: past FOLD_STREAM_FROM
        if kernels.compiled():
            assert r["one_pass_ms"] > 0 and r["speedup"] == r["numpy_ms"] / r["one_pass_ms"]
        else:
            assert "one_pass_ms" not in r
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["bench"], r["ranks"]) for r in records] == [("fold", 2), ("fold", 3)]
    assert "same bits" in fold_bench.format_table(rows)


def test_a_small_result_is_not_streamed() -> None:
    (row,) = fold_bench.run(mb=1, reps=1, ranks=(3,))
    assert row["streamed"] is False and row["mb"] == 1.0


def test_bench_fold_on_the_command_line() -> None:
    result = CliRunner().invoke(bench, ["fold", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output and "float64" in result.output
    result = CliRunner().invoke(bench, ["fold", "--dtype", "int8"])
    assert result.exit_code != 0 and "int8" in result.output
