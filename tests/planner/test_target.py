"""The planner fits what the target device would hold: allocator reserve and CUDA context."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.estimate.target import upper_edge
from memfit.planner import NothingFits, plan
from memfit.targets import DEVICES
from memfit.units import MiB
from memfit.workload import load_workload

H100 = DEVICES["h100"]


def test_gpu_plans_fit_the_device_total():
    workload = load_workload("gpt2-tiny", 8, 64)
    overhead = H100.context_bytes + H100.workspaces_bytes
    # The CUDA context (measured), 100 MiB for the run, and the error band's upper edge.
    budget = upper_edge(overhead + 100 * MiB, True) // MiB
    result = plan(workload, f"{budget}MiB", device="h100")
    assert result.fits
    assert result.predicted_device_total_bytes == result.predicted_peak_reserved_bytes + overhead
    upper = upper_edge(result.predicted_device_total_bytes, True)
    assert result.predicted_device_total_upper_bytes == upper <= budget * MiB
    band = result.to_dict()["error_band"]["predicted_device_total_bytes"]
    assert band["high"] == pytest.approx(upper / result.predicted_device_total_bytes - 1, abs=1e-3)
    # Segments are at least 2 MiB: reserved bytes exceed this small model's tensor peak.
    assert result.predicted_peak_reserved_bytes > result.predicted_peak_bytes
    assert "CUDA context" in result.explanation
    data = result.to_dict()
    assert data["target_device"] == "h100"
    assert data["predicted_device_total_bytes"] == result.predicted_device_total_bytes
    assert data["predicted_peak_reserved_bytes"] == result.predicted_peak_reserved_bytes


def test_a_budget_below_the_cuda_context_gets_the_nothing_fits_paragraph():
    workload = load_workload("gpt2-tiny", 8, 64)
    budget = H100.context_bytes // MiB - 100
    with pytest.raises(NothingFits) as info:
        plan(workload, f"{budget}MiB", device="h100")
    message = str(info.value)
    assert "smallest device total reachable on h100" in message and "--allow" in message
    assert info.value.result.predicted_device_total_bytes > budget * MiB


def test_a_gpu_smaller_than_the_model_is_refused_with_a_sentence():
    # gpt2 (124M parameters, 500 MB of fp32 weights) on a described 256 MiB GPU.
    tiny_gpu = ("name=tiny,memory=256MiB,mem_bandwidth=100GB/s,host_bandwidth=8GB/s,"
                "compute_capability=8.0,bf16=true,context=0,workspace=0")
    result = CliRunner().invoke(
        app, ["plan", "--model", "gpt2", "-b", "1", "-l", "16", "--budget", "256MiB",
              "--device", tiny_gpu],
    )
    assert result.exit_code == 2, result.output
    assert "Nothing fits in 256.00 MiB" in result.output
    assert "Traceback" not in result.output
