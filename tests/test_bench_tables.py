"""``zmqflow bench tables``: both ways run on real shard processes, and the grouped way sends one
message a shard for a step's lookups and one for its pushes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from zmqflow.bench import embedding_tables
from zmqflow.cli.bench import bench


def test_the_tables_bench_times_each_way_and_counts_messages(tmp_path) -> None:
    out = tmp_path / "tables.json"
    r = embedding_tables.run(tables=3, batch=64, shards=2, rows=1000, steps=4, json_out=str(out))
    for way in ("separate", "grouped", "one_table"):
        assert r[f"{way}_ms"] > 0
    assert r["grouped_messages"] == 2 * 2  # a lookup and a push message to each shard
    assert r["separate_messages"] >= r["grouped_messages"]
    assert r["speedup"] == r["separate_ms"] / r["grouped_ms"]
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["bench"] == "embedding_tables" and record["tables"] == 3
    table = embedding_tables.format_table(r)
    assert "3 tables x 64 Zipf ids" in table and "grouped (lookup_many, push_many)" in table


def test_bench_tables_on_the_command_line() -> None:
    result = CliRunner().invoke(bench, ["tables", "--help"])
    assert result.exit_code == 0 and "table by table vs one request" in " ".join(result.output.split())
    result = CliRunner().invoke(bench, ["tables", "--tables", "0"])
    assert result.exit_code != 0 and "--tables" in result.output
