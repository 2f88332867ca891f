"""The GPU validation harness: refuses to run without a GPU, predicts with --dry-only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit import device

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_validate.py"


@pytest.mark.skipif(device.cuda_available(), reason="this machine has a GPU: the harness runs")
def test_without_a_gpu_it_exits_2_with_one_sentence(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_dry_only_writes_the_predictions(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-only", "--models", "bert-tiny", "--plans",
         "baseline,best", "--target", "h100", "--batch-size", "2", "--seq-len", "16",
         "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "gpu_h100_predictions.json").read_text())
    assert data["target"] == "h100" and [r["plan"] for r in data["rows"]] == ["baseline", "best"]
    for row in data["rows"]:
        pred = row["predicted"]
        assert pred["device_total_bytes"] == pred["reserved_bytes"] + pred["overhead_bytes"]
        assert pred["reserved_bytes"] >= pred["allocated_bytes"] >= pred["tensor_peak_bytes"]


def test_an_unknown_plan_is_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-only", "--plans", "magic", "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 2 and "unknown plan 'magic'" in done.stderr
