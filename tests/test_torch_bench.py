"""The DistributedOptimizer-beside-DDP benchmark runs end to end (its figures are reported, never asserted)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from zmqflow.bench import torch_ddp  # noqa: E402


def test_quick_ddp_ratio_reports_both_step_times():
    result = torch_ddp.ddp_ratio(quick=True)
    assert result["bench"] == "torch_ddp" and result["ranks"] == 2
    assert result["params"] > 4_000_000
    assert result["zmqflow_step_ms"] > 0 and result["ddp_step_ms"] > 0
    assert result["ratio"] == pytest.approx(result["zmqflow_step_ms"] / result["ddp_step_ms"])
    assert len(result["zmqflow_rounds_ms"]) == len(result["ddp_rounds_ms"]) == result["rounds"]
    assert result["security"] == "plaintext"
    # the same model, data and steps on both sides: the two trained models agree
    assert result["max_param_diff"] < 1e-4
    assert "ratio zmqflow/DDP" in torch_ddp.format_table(result)


def test_the_ddp_benchmark_refuses_a_device_it_cannot_use():
    import torch
    from click.testing import CliRunner

    from zmqflow.cli.bench import bench
    from zmqflow.errors import ConfigError

    with pytest.raises(ConfigError, match="device must be cpu or cuda, got 'tpu'"):
        torch_ddp.ddp_ratio(quick=True, device="tpu")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the cuda case runs (bench/gpu_check.sh)")
    result = CliRunner().invoke(bench, ["torch", "--only", "ddp", "--device", "cuda", "--quick"])
    assert result.exit_code == 1 and "torch sees no CUDA device" in result.output and "Traceback" not in result.output
