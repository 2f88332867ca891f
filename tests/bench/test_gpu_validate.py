"""benchmarks/gpu_validate.py: refuses to run without a GPU, predicts with --dry-only, and its
real-run path (exercised on the CPU here) follows memfit.measure's procedure exactly."""

from __future__ import annotations

import json
import subprocess
from types import ModuleType

import pytest

import memfit
from memfit import device
from memfit.units import GiB

from .scripts import load_script, run_here, run_script


@pytest.fixture(scope="module")
def gv() -> ModuleType:
    return load_script("gpu_validate")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("gpu_validate", *args)


@pytest.mark.subprocess
@pytest.mark.skipif(device.cuda_available(), reason="this machine has a GPU: the harness runs")
def test_without_a_gpu_it_exits_2_with_one_sentence_and_writes_nothing(tmp_path):
    done = _run("--out", str(tmp_path / "results"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device: ")
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--plans", "magic"), "unknown plan 'magic'"),
        (("--models", "nope"), "model 'nope' names nothing memfit knows"),
        (("--target", "zz"), "device 'zz' is not known"),
        (("--steps", "0"), "--steps must be at least 1"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, message, monkeypatch, capsys):
    # In this process (the real process's exit code: the test above and test_script_outputs).
    done = run_here("gpu_validate", "--dry-only", *args, "--out", str(tmp_path),
                    monkeypatch=monkeypatch, capsys=capsys)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert message in done.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.subprocess  # the script asks git for the commit it records
@pytest.mark.slow
def test_dry_only_writes_the_predictions(tmp_path, monkeypatch, capsys):
    # In this process, saving an interpreter's imports (the real process: the tests above).
    done = run_here(
        "gpu_validate", "--dry-only", "--models", "bert-base", "--plans", "baseline",
        "--target", "h100", "--batch-size", "2", "--seq-len", "32", "--out", str(tmp_path),
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_h100_predictions.json"]
    data = json.loads((tmp_path / "gpu_h100_predictions.json").read_text())
    assert data["target"] == data["device_name"] == "h100" and data["gpu"] is None
    assert {"torch", "python", "PYTORCH_CUDA_ALLOC_CONF"} <= set(data["env"])
    (row,) = data["rows"]
    assert (row["model"], row["plan"], row["batch_size"], row["seq_len"]) == (
        "bert-base", "baseline", 2, 32,
    )  # fmt: skip
    assert "real" not in row and "rel_error" not in row
    pred = row["predicted"]
    assert pred["target_device"] == "h100"
    # The prediction is the dry run's, figure for figure.
    report = memfit.measure("bert-base", memfit.Plan(), steps=2, dry=True, device="h100",
                            batch_size=2, seq_len=32)  # fmt: skip
    assert pred["tensor_peak_bytes"] == report.peak_bytes
    assert pred["reserved_bytes"] == report.peak_reserved_bytes
    assert pred["device_total_bytes"] == report.peak_reserved_bytes + report.overhead_bytes
    assert pred["reserved_bytes"] >= pred["allocated_bytes"] >= pred["tensor_peak_bytes"]


def test_the_best_plan_is_the_ladders(gv):
    from memfit.bench.ladder import ladder_plans

    plans = gv.plans()
    assert list(plans) == ["baseline", "bf16-selective", "best", "accum-8bit"]
    assert plans["best"] == dict(ladder_plans())["best full fine-tune"]
    assert plans["best"].optimizer_in_backward and plans["best"].optimizer.name == "adafactor"
    assert plans["accum-8bit"].optimizer.name == "adamw8bit"
    assert plans["accum-8bit"].grad_accum_steps == 4


@pytest.mark.parametrize(
    ("name", "capability", "total", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), 85_520_809_984, ("h100", "h100")),
        # Same memory as an H100: only the name tells them apart.
        ("NVIDIA A100-SXM4-80GB", (8, 0), 85_520_809_984, ("a100", "a100")),
        ("NVIDIA A100-SXM4-40GB", (8, 0), 42_298_834_944, ("a100-40gb", "a100-40gb")),
        ("NVIDIA GeForce RTX 4090", (8, 9), 25_393_692_672, ("rtx4090", "rtx4090")),
        ("Tesla T4", (7, 5), 15_828_320_256, ("t4", "t4")),
        ("NVIDIA H200", (9, 0), 150_754_820_096, ("h200", "h200")),
        # Unknown cards: the profile of their compute capability closest in memory, files
        # named after them.
        ("NVIDIA GH200 480GB", (9, 0), 102_005_473_280, ("h100", "gh200-480gb")),
        ("NVIDIA L4", (8, 9), 23_580_639_232, ("rtx4090", "l4")),
    ],
)
def test_the_target_follows_the_gpu(gv, name, capability, total, expected):
    assert gv.target_for_gpu(name, capability, total) == expected


def test_relative_errors_and_the_table(gv):
    pred = {"tensor_peak_bytes": 90, "allocated_bytes": 100, "reserved_bytes": 150,
            "device_total_bytes": 250}  # fmt: skip
    real = {"max_allocated_bytes": 100, "max_reserved_bytes": 120, "process_used_bytes": 200,
            "steps": [{"seconds": 0.5}],
            "tracked": {"tensor_peak_bytes": 90, "replayed_reserved_bytes": 108}}  # fmt: skip
    err = gv.compare(pred, real)
    assert err == {
        "tensor_peak_vs_max_allocated": pytest.approx(-0.1),
        "allocated_vs_max_allocated": 0.0,
        "reserved_vs_max_reserved": 0.25,
        "device_total_vs_process_used": 0.25,
        "dry_vs_tracked_tensor_peak": 0.0,
        "replayed_reserved_vs_max_reserved": pytest.approx(-0.1),
    }
    assert gv.compare(pred, {"oom": True}) == {}
    assert gv.rel_err(None, 100) is None and gv.rel_err(5, 0) is None
    row = {"model": "m", "plan": "p", "batch_size": 2, "seq_len": 8, "predicted": pred,
           "real": real, "rel_error": err}  # fmt: skip
    oom = {**row, "real": {"oom": True, "error": "CUDA out of memory | tried"}}
    table = gv.markdown([row, oom], "title").splitlines()
    header, rule, ok, failed = table[2:6]
    cells = header.count("|")
    assert rule.count("|") == ok.count("|") == failed.count("|") == cells
    assert "| -10.0% | +0.0% |" in ok and "| +25.0% |" in ok and ok.endswith("| 0.500 |")
    assert "| OOM: CUDA out of memory / tried |" in failed


@pytest.mark.parametrize("plan", ["baseline", "best"])
def test_the_real_run_follows_measure(gv, plan):
    """On the CPU (CUDA figures None), the harness's real run, tracked, has memfit.measure's
    peak to the byte: it builds, applies the plan and steps as measure does."""
    out = gv.run_real({"model": "bert-tiny", "plan": plan, "batch_size": 2, "seq_len": 8,
                       "steps": 2, "track": True, "target": "h100", "device": "cpu"})  # fmt: skip
    report = memfit.measure("bert-tiny", gv.plans()[plan], steps=2, batch_size=2, seq_len=8,
                            device="cpu")  # fmt: skip
    tracked = out["tracked"]
    assert tracked["tensor_peak_bytes"] == report.peak_bytes
    assert tracked["peak_by_category"] == report.peak_by_category
    assert [s["loss"] for s in out["steps"]] == pytest.approx(report.meta["losses"])
    assert tracked["replayed_reserved_bytes"] >= tracked["replayed_allocated_bytes"]
    assert tracked["replayed_allocated_bytes"] >= tracked["tensor_peak_bytes"]
    assert tracked["replayed_reserved_bytes"] < 1 * GiB
    assert out["oom"] is False and out["max_allocated_bytes"] is None  # no CUDA here
