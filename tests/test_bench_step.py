"""``zmqflow bench step``: both ways of a small step run against a real shard process and agree;
the table and JSON say what was measured; bad sizes are refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zmqflow.bench import small_step
from zmqflow.cli.bench import bench


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_the_step_bench_times_both_ways_on_a_shard_process(tmp_path, sync: bool) -> None:
    out = tmp_path / "step.json"
    optimizer = "sgd" if sync else "adam"
    rows = small_step.run([2, 8], sync=sync, json_out=str(out), steps=5, rounds=2, optimizer=optimizer)
    assert [r["model_kb"] for r in rows] == [2, 8] and all(r["sync"] is sync for r in rows)
    for r in rows:
        assert r["push_then_pull_us"] > 0 and r["push_pull_us"] > 0 and r["read_back"] is True
        assert r["model_bytes"] == r["model_kb"] * 1000
        assert r["optimizer"]["kind"] == ("sync_replicas" if sync else "adam") and r["base_optimizer"] == optimizer
        assert r["speedup"] == r["push_then_pull_us"] / r["push_pull_us"]
    assert [json.loads(line)["bench"] for line in out.read_text().splitlines()] == ["small_step"] * 2
    assert f"2 KB, 4 variables | tcp | {optimizer} | {sync} |" in small_step.format_table(rows)


def test_a_model_of_four_variables_of_the_size_asked() -> None:
    for kb in (0.001, 0.016, 0.1, 0.2, 4, 48):
        model = small_step.model_of(kb)
        assert len(model) == 4 and all(v.size for v in model.values())
        assert sum(v.nbytes for v in model.values()) == max(160, int(kb * 1000 / 4) * 4)


def test_a_model_of_many_variables_of_one_size() -> None:
    model = small_step.model_of(100, variables=100)
    assert len(model) == 100 and {v.shape for v in model.values()} == {(250,)}
    assert len(small_step.model_of(0.001, variables=7)) == 7  # none empty
    rows = small_step.run([8], sync=True, steps=3, rounds=2, variables=80)  # past 64 tensors a message
    assert rows[0]["variables"] == 80 and rows[0]["read_back"] is True


def test_a_model_too_big_to_read_back_says_so() -> None:
    rows = small_step.run([1100], sync=False, steps=3, rounds=2)  # past READ_BYTES a shard
    assert rows[0]["read_back"] is False and "no: too big" in small_step.format_table(rows)


def test_bench_step_on_the_command_line() -> None:
    assert CliRunner().invoke(bench, ["step", "--help"]).exit_code == 0
    for bad in ("x", "0", "-1", "nan", "4,inf"):
        result = CliRunner().invoke(bench, ["step", "--kb", bad])
        assert result.exit_code != 0 and "--kb" in result.output, bad
    for bad in ("0", "4001", "x"):
        result = CliRunner().invoke(bench, ["step", "--vars", bad])
        assert result.exit_code != 0 and "--vars" in result.output, bad
    result = CliRunner().invoke(bench, ["step", "--optimizer", "rmsprop"])
    assert result.exit_code != 0 and "--optimizer" in result.output
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        small_step.run([2], optimizer="rmsprop")
