"""``zmqflow bench optim``: both sides run and agree, the table and JSON say what was measured."""

from __future__ import annotations

import json

from click.testing import CliRunner

from zmqflow.bench import optim as optim_bench
from zmqflow.cli.bench import bench
from zmqflow.state import kernels


def test_the_optimizer_bench_times_both_ways_and_leaves_the_switch_as_it_was(tmp_path) -> None:
    out = tmp_path / "optim.json"
    rows = optim_bench.run(mb=1, reps=1, names=["sgd", "adam"], json_out=str(out))
    assert [r["optimizer"] for r in rows] == ["sgd", "adam"]
    for r in rows:
        assert r["numpy_ms"] > 0 and len(r["numpy_s"]) == 1
        if kernels.compiled():
            assert r["one_pass_ms"] > 0 and r["speedup"] == r["numpy_ms"] / r["one_pass_ms"]
    assert kernels.compiled() == (kernels._built is not None)  # turned back on after each side
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["bench"] for r in records] == ["optim", "optim"]
    table = optim_bench.format_table(rows)
    assert "adam" in table and "same bits" in table


def test_bench_optim_on_the_command_line() -> None:
    result = CliRunner().invoke(bench, ["optim", "--quick", "--dtype", "float64", "--help"])
    assert result.exit_code == 0 and "one-pass" in result.output
    result = CliRunner().invoke(bench, ["optim", "--dtype", "float16"])
    assert result.exit_code != 0 and "float16" in result.output
