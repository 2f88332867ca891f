"""Dry runs for a target device: what its kernels keep, its optimizer defaults, its dtypes."""

from __future__ import annotations

import json

import pytest

from memfit.estimate.dryrun import measure, plan_for_target
from memfit.plan import Plan, PlanError
from memfit.targets import DEVICES, get_device
from memfit.workload import load_workload


@pytest.mark.parametrize("spec", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_dry_equals_real_under_a_gpu_target(spec, precision):
    plan = Plan(precision=precision)
    real = measure(spec, plan, batch_size=2, seq_len=32, device="h100")
    dry = measure(spec, plan, batch_size=2, seq_len=32, device="h100", dry=True)
    assert dry.peak_bytes == real.peak_bytes
    assert dry.peak_by_category == real.peak_by_category
    assert dry.meta["target_device"] == real.meta["target_device"] == "h100"
    assert sum(dry.meta["attention_backends"].values()) == 2 * 2  # steps x layers


def test_default_target_is_this_machine():
    report = measure("gpt2-tiny", batch_size=2, seq_len=16, dry=True)
    assert report.meta["target_device"] == "cpu"
    assert report.meta["attention_backends"] == {}


def test_gpu_target_keeps_less_attention_memory_than_the_cpu():
    # GPT-2 has attention dropout: the CPU takes the math path and keeps L x L probabilities.
    kw = dict(batch_size=2, seq_len=128, dry=True)
    cpu = measure("gpt2-tiny", Plan(precision="bf16-mixed"), device="cpu", **kw)
    gpu = measure("gpt2-tiny", Plan(precision="bf16-mixed"), device="h100", **kw)
    assert gpu.meta["attention_backends"]["flash"] > 0
    assert gpu.peak_by_category["activations"] < cpu.peak_by_category["activations"]


def _activations(device: str, seq_len: int) -> int:
    workload = load_workload("gpt2-medium", 4, seq_len).with_depth(2)
    report = measure(workload, Plan(precision="bf16-mixed"), device=device, dry=True)
    return report.peak_by_category["activations"]


def test_attention_memory_is_linear_on_h100_and_quadratic_on_cpu():
    # gpt2-medium (two of its blocks), batch 4, bf16-mixed, lengths 1024 and 2048.
    h100 = _activations("h100", 2048) / _activations("h100", 1024)
    cpu = _activations("cpu", 2048) / _activations("cpu", 1024)
    assert 1.8 <= h100 <= 2.2, h100  # fused attention: linear in the length
    assert cpu >= 2.8, cpu  # the CPU's math path keeps L x L probabilities: quadratic


def test_optimizer_defaults_follow_the_target():
    plan = Plan()
    assert plan_for_target(plan, DEVICES["h100"]).optimizer.foreach is True
    assert plan_for_target(plan, get_device("cpu")).optimizer.foreach is None
    explicit = Plan(optimizer={"name": "adamw", "foreach": False})
    assert plan_for_target(explicit, DEVICES["h100"]).optimizer.foreach is False
    fused = Plan(optimizer={"name": "adamw", "kwargs": {"fused": True}})
    assert plan_for_target(fused, DEVICES["h100"]).optimizer.foreach is None
    assert plan_for_target(Plan(optimizer="adafactor"), DEVICES["h100"]).optimizer.foreach is None


def test_foreach_on_a_gpu_target_costs_a_parameter_copy_at_the_step():
    kw = dict(batch_size=2, seq_len=16, dry=True)
    cpu = measure("gpt2-tiny", device="cpu", **kw)
    gpu = measure("gpt2-tiny", device="h100", **kw)
    assert gpu.phase_peaks["optimizer"] > cpu.phase_peaks["optimizer"]


def test_bf16_on_a_t4_is_refused_with_a_sentence():
    with pytest.raises(PlanError, match=r"t4 has no bf16 support.*fp16-mixed"):
        measure("gpt2-tiny", Plan(precision="bf16-mixed"), batch_size=2, seq_len=16,
                dry=True, device="t4")
    report = measure("gpt2-tiny", Plan(precision="fp16-mixed"), batch_size=2, seq_len=16,
                     dry=True, device="t4")
    assert report.meta["target_device"] == "t4"


@pytest.mark.parametrize(
    "plan",
    [
        Plan(precision="bf16-mixed", checkpointing="full"),
        Plan(precision="bf16-mixed", checkpointing="selective"),
        Plan(precision="bf16-pure", optimizer="adafactor", optimizer_in_backward=True,
             checkpointing="full"),
        Plan(grad_accum_steps=2, optimizer="adafactor"),
    ],
    ids=["full", "selective", "best", "accum-adafactor"],
)
def test_recomputation_takes_the_targets_kernels(plan):
    # Checkpointing recomputes the forward inside backward: it must take the same (emulated)
    # kernels, or torch.utils.checkpoint finds different saved tensors and raises.
    real = measure("gpt2-tiny", plan, batch_size=2, seq_len=32, device="h100")
    dry = measure("gpt2-tiny", plan, batch_size=2, seq_len=32, device="h100", dry=True)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.meta["attention_backends"]["flash"] > 0 or plan.precision.mode == "fp32"


def test_reports_carry_reserved_and_device_totals():
    kw = dict(batch_size=2, seq_len=32, dry=True)
    gpu = measure("gpt2-tiny", Plan(precision="bf16-mixed"), device="h100", **kw)
    h100 = DEVICES["h100"]
    # Every segment is at least 2 MiB: the allocator model reserves more than tensors take.
    assert gpu.peak_reserved_bytes >= gpu.meta["peak_allocated_bytes"] >= gpu.peak_bytes
    assert gpu.peak_reserved_bytes >= 2 * 1024 * 1024
    assert gpu.overhead_bytes == h100.context_bytes + h100.workspaces_bytes
    assert gpu.device_total_bytes == gpu.peak_reserved_bytes + gpu.overhead_bytes
    data = gpu.to_dict()
    assert data["target_device"] == "h100"
    assert data["predicted_device_total_bytes"] == gpu.device_total_bytes
    assert data["peak_reserved_bytes"] == gpu.peak_reserved_bytes
    cpu = measure("gpt2-tiny", device="cpu", **kw)
    # The CPU has no caching allocator and no context to count.
    assert cpu.peak_reserved_bytes == cpu.peak_bytes and cpu.overhead_bytes == 0


def test_the_error_band_is_zero_on_the_cpu_and_measured_on_a_gpu():
    from memfit.estimate.target import OVER, UNDER, error_band
    from memfit.targets import get_device
    from memfit.units import GiB, MiB

    figures = {"peak_allocated_bytes": 4 * GiB, "peak_reserved_bytes": 4 * GiB,
               "predicted_device_total_bytes": 5 * GiB}  # fmt: skip
    cpu = error_band(figures, get_device("cpu"))
    assert all(b == {"low": 0.0, "high": 0.0} for b in cpu.values())
    h100 = error_band(figures, get_device("h100"))
    for key, (relative, absolute) in UNDER.items():
        assert h100[key]["low"] == -OVER
        assert h100[key]["high"] == pytest.approx(relative + absolute / figures[key], abs=1e-4)
    # The absolute part weighs more on a small prediction.
    small = error_band({k: 512 * MiB for k in figures}, get_device("h100"))
    assert small["peak_reserved_bytes"]["high"] > h100["peak_reserved_bytes"]["high"]


def test_profile_json_carries_the_three_figures_and_their_band(tmp_path):
    from typer.testing import CliRunner

    from memfit.cli import app

    path = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16",
                                      "--dry-run", "--device", "h100", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    band = data["error_band"]
    assert set(band) == {"peak_allocated_bytes", "peak_reserved_bytes",
                         "predicted_device_total_bytes"}
    assert data["predicted_device_total_bytes"] > data["peak_reserved_bytes"] > 0
    assert band["predicted_device_total_bytes"]["high"] > 0
    assert "as measured on GPUs" in result.output
