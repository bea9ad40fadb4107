"""Rival anchors of the benchmarks: a missing optional extra is a clear message before anything
runs, the tf1 rows and JSON have their shape with zmqflow's side alone, and (where tensorflow is
installed) both sides do the same work. Figures are reported, never asserted."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from zmqflow.bench import allreduce as allreduce_bench
from zmqflow.bench.anchors import plot, tf1
from zmqflow.bench.anchors.tf1_side import DENSE_LR
from zmqflow.cli.bench import bench

TINY = {"reps": 2, "trips": 20, "rows": 2000, "batches": 3}
MEASURES = ["assign_add", "dense pull", "dense pull out=", "dense push", "dense step", "embedding lookup",
            "embedding push", "embedding step", "8 tables lookup", "8 tables push", "8 tables step"]
needs_tf = pytest.mark.skipif(not tf1.tf_available(), reason="tensorflow is not installed (the [anchors] extra)")


def _invoke(*args: str):
    return CliRunner().invoke(bench, list(args))


def _clean_failure(result, *words: str) -> None:
    """A non-zero exit with the message, and no traceback (a ClickException, not a crash)."""
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)
    for word in words:
        assert word in result.output
    assert "Traceback" not in result.output


def test_vs_tf1_without_tensorflow_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(tf1, "tf_available", lambda: False)  # as in an environment without the extra
    out = tmp_path / "rows.jsonl"
    result = _invoke("ps", "--vs", "tf1", "--quick", "--json", str(out))
    _clean_failure(result, "TensorFlow", "pip install 'zmqflow[anchors]'")
    assert not out.exists()  # refused before anything ran


def test_vs_gloo_without_torch_names_the_extra(monkeypatch):
    monkeypatch.setattr(allreduce_bench, "gloo_available", lambda: False)
    _clean_failure(_invoke("allreduce", "--vs", "gloo", "--quick"), "PyTorch", "pip install 'zmqflow[torch]'")


def test_device_cuda_without_cupy_says_what_to_install(monkeypatch, tmp_path):
    real_find_spec = allreduce_bench.importlib.util.find_spec
    monkeypatch.setattr(allreduce_bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "cupy" else real_find_spec(name, *a))  # as where cupy is missing
    out = tmp_path / "rows.jsonl"
    _clean_failure(_invoke("allreduce", "--device", "cuda", "--quick", "--json", str(out)), "cupy", "pip install cupy-cuda")
    assert not out.exists()


def test_the_allreduce_benchmark_refuses_an_unknown_device():
    with pytest.raises(allreduce_bench.ConfigError, match="device must be one of cpu, cuda, got 'tpu'"):
        allreduce_bench.run(device="tpu")
    assert _invoke("allreduce", "--device", "tpu").exit_code == 2  # click names the choices


@pytest.mark.skipif(plot.available(), reason="matplotlib is installed: the plots themselves are tested")
@pytest.mark.parametrize("command", ["ps", "allreduce"])
def test_plot_without_matplotlib_names_the_extra(command, tmp_path):
    _clean_failure(_invoke(command, "--quick", "--plot", str(tmp_path / "x.png")), "matplotlib", "zmqflow[plot]")
    assert not (tmp_path / "x.png").exists()


def _check_rows(rows: list[dict], shards: tuple[int, ...], with_tf: bool, reps: int = TINY["reps"]) -> None:
    assert [(r["ps"], r["measure"]) for r in rows] == [(n, m) for n in shards for m in MEASURES]
    for r in rows:
        assert r["zmqflow"] > 0 and r["zmqflow_ms"] > 0
        assert r["security"] == "plaintext"  # as TF's gRPC: no keys on either side
        if with_tf:
            assert r["tf1"] > 0 and r["tf1_ms"] > 0
            assert r["ratio"] == pytest.approx(r["zmqflow"] / r["tf1"])
        else:
            assert r["tf1"] is None and r["tf1_ms"] is None and r["ratio"] is None
    steps = [r for r in rows if r["measure"] == "dense step"]
    pulls = [r for r in rows if r["measure"] == "dense pull"]
    for step, pull in zip(steps, pulls):
        # a step moves the model twice (pull, push); its throughput counts both
        assert step["size_bytes"] == pull["size_bytes"] == 1_000_000
        # the wire's own time for the same bytes, measured beside it
        assert step["wire_ms"] > 0 and step["over_wire"] == pytest.approx(step["zmqflow_ms"] / step["wire_ms"])
        # warm-up + reps SGD pushes of 1e-3 on zeros: the pushes were applied, not only sent
        expected = -(reps + 1) * DENSE_LR * 1e-3
        assert step["final_value"]["zmqflow"] == pytest.approx(expected, rel=1e-4)
        if with_tf:
            assert step["final_value"]["tf1"] == pytest.approx(expected, rel=1e-4)


def test_tf1_rows_json_and_table_with_zmqflow_alone(tmp_path):
    out = tmp_path / "rows.jsonl"
    rows = tf1.run(shards=(1, 2), model_mbs=(1,), json_out=str(out), echo=lambda _: None, tf=False, **TINY)
    _check_rows(rows, (1, 2), with_tf=False)
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert all(r["bench"] == "ps_vs_tf1" for r in rows)
    table = tf1.format_table(rows)
    for m in MEASURES:
        assert m in table
    assert "above 1: zmqflow faster" in table
    assert "for raw pyzmq to move the same bytes" in table


@pytest.mark.skipif(not plot.available(), reason="matplotlib is not installed (the [plot] extra)")
def test_plots_are_drawn(tmp_path):
    rows = tf1.run(shards=(1,), model_mbs=(1, 2), echo=lambda _: None, tf=False, **TINY)
    ar_rows = [{"ranks": 2, "bytes": b, "zf_busbw": 0.1 * i + 0.1, "gloo_busbw": None, "ps_busbw": 0.05}
               for i, b in enumerate((1024, 65536))]
    ps_rows = [{"shards": 1, "model_mb": mb, "zf_pull_gbps": 1.0, "raw_pull_gbps": 1.2, "zf_push_gbps": 0.9,
                "raw_push_gbps": 1.1} for mb in (1, 2)]
    for draw, data in ((plot.plot_ps_vs_tf1, rows), (plot.plot_allreduce, ar_rows), (plot.plot_ps, ps_rows)):
        path = tmp_path / f"{draw.__name__}.png"
        draw(data, str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_tf
def test_cli_vs_tf1_does_the_same_work_on_both_sides_prints_the_ratios_and_writes_json(tmp_path):
    out = tmp_path / "rows.jsonl"  # 2 ps: the variables spread over both, on both sides
    args = ["ps", "--vs", "tf1", "--quick", "--shards", "2", "--model-mb", "1", "--vars", "4", "--json", str(out)]
    if plot.available():
        args += ["--plot", str(tmp_path / "curve.png")]
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    assert "ratio" in result.output and "dense step" in result.output and "1 MB / 4 vars" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    _check_rows(lines, (2,), with_tf=True, reps=tf1.plan(quick=True)["reps"])
    assert all(r["ratio"] > 0 for r in lines)
    if plot.available():
        assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_vars_goes_with_the_tf1_anchor_only():
    result = _invoke("ps", "--quick", "--vars", "3")
    assert result.exit_code != 0 and "--vars goes with --vs tf1" in result.output
    result = _invoke("ps", "--vs", "tf1", "--vars", "0")
    assert result.exit_code != 0 and "--vars" in result.output


def test_allreduce_runs_the_ranks_and_sizes_asked(tmp_path):
    out = tmp_path / "rows.jsonl"
    result = _invoke("allreduce", "--quick", "--ranks", "2", "--sizes", "64K,4K", "--no-ps", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["ranks"], r["bytes"]) for r in rows] == [(2, 64 << 10), (2, 4 << 10)]
    for r in rows:
        assert r["zf_ms"] > 0 and r["ps_ms"] is None  # the PS columns left out
        assert (r["gloo_ms"] is None) == (not allreduce_bench.gloo_available())
        assert r["security"] == "plaintext" and r["memcpy_gbps"] > 0
        # each side's figure is the median of its own repetitions, taken side by side
        assert r["zf_ms"] == pytest.approx(statistics.median(r["zf_ms_reps"]))
        if r["gloo_ms"] is not None:
            assert len(r["gloo_ms_reps"]) == len(r["zf_ms_reps"])
            assert r["busbw_vs_gloo"] == pytest.approx(r["gloo_ms"] / r["zf_ms"])  # the ratio of the medians


@pytest.mark.parametrize("sizes, words", [("64K,1X", "malformed size '1X'"), ("6", "multiple of 4"), (",", "no size")])
def test_allreduce_refuses_bad_sizes_before_running(sizes, words):
    result = _invoke("allreduce", "--sizes", sizes)
    assert result.exit_code == 2 and "--sizes" in result.output and words in result.output
