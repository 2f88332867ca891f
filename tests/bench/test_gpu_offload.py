"""benchmarks/gpu_offload.py: refuses to measure without a GPU, compares parameters as its
docstring says, and its whole procedure runs on the CPU at a small size (where every offload
variant trains like the plain plan)."""

from __future__ import annotations

import json
import math
import subprocess
from types import ModuleType

import pytest
import torch

from memfit import device

from .scripts import load_script, run_here, run_script

TINY = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32,
        "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 32}  # fmt: skip


@pytest.fixture(scope="module")
def go() -> ModuleType:
    return load_script("gpu_offload")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("gpu_offload", *args)


@pytest.mark.subprocess
@pytest.mark.skipif(device.cuda_available(), reason="this machine has a GPU: the harness runs")
def test_without_a_gpu_it_exits_2_with_one_sentence_and_writes_nothing(tmp_path):
    done = _run("--out", str(tmp_path / "results"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device: ")
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_unknown_variant_is_refused(tmp_path, monkeypatch, capsys):
    # In this process (the real process's exit code: the test above and test_script_outputs).
    done = run_here("gpu_offload", "--variants", "none,teleport", "--device", "cpu", "--out",
                    str(tmp_path), monkeypatch=monkeypatch, capsys=capsys)
    assert done.returncode == 2 and "variants must include none" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_parameter_comparison(go, tmp_path):
    init = {"a": torch.zeros(3), "b": torch.zeros(2)}
    ref = {"a": torch.tensor([3.0, 0.0, 0.0]), "b": torch.tensor([0.0, 4.0])}  # update norm 5
    got = {"a": torch.tensor([3.0, 0.1, 0.0]), "b": torch.tensor([0.0, 4.0])}
    paths = []
    for name, params in (("got", got), ("ref", ref), ("init", init)):
        paths.append(str(tmp_path / f"{name}.pt"))
        torch.save(params, paths[-1])
    c = go.compare_params(*paths)
    assert c["max_abs"] == pytest.approx(0.1) and c["rel"] == pytest.approx(0.1 / 5)
    assert c["finite"]
    assert go.compare_params(paths[1], paths[1], paths[2])["rel"] == 0
    got["b"][0] = math.nan
    torch.save(got, paths[0])
    assert not go.compare_params(*paths)["finite"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_procedure_on_the_cpu(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    variants = "none,none-repeat,optimizer-in-backward,optimizer+parameters,activations"
    done = _run("--device", "cpu", "--model", str(config), "--batch-size", "2", "--seq-len", "16",
                "--steps", "2", "--precisions", "fp32", "--variants", variants,
                "--out", str(tmp_path), "--name", "t")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "t.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == variants.split(",") and not result["partial"]
    for name, row in rows.items():
        assert "error" not in row["real"], row["real"]
        assert row["predicted"]["allocated_bytes"] > 0 and row["predicted"]["step_seconds"] > 0
        assert len(row["real"]["steps"]) == 2
        if name == "none":
            continue
        # Identical computations: the repeat and activation offload to the bit; the host
        # optimizer (torch's fused CPU AdamW) to rounding.
        exact = name in ("none-repeat", "activations")
        assert (row["params"]["rel"] == 0) if exact else (0 < row["params"]["rel"] <= 1e-3)
        assert row["comparison"]["params_pass"]
        assert row["comparison"]["loss_max_abs_diff"] <= 1e-5
    table = (tmp_path / "t.md").read_text()
    assert "| optimizer+parameters | " in table and "**no**" not in table
