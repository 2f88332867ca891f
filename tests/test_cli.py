"""`memfit profile` end to end, and one clear sentence with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args))


def test_profile_dry_run_writes_json_and_png(tmp_path):
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    res = _invoke(
        "profile",
        "--model",
        "gpt2-tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--dry-run",
        "--steps",
        "2",
        "--json",
        str(js),
        "--plot",
        str(png),
    )
    assert res.exit_code == 0, res.output
    assert "optimizer_state" in res.output and "Peak by phase" in res.output
    data = json.loads(js.read_text())
    for key in (
        "peak_bytes",
        "peak_by_category",
        "phase_peaks",
        "num_parameters",
        "dry_run",
        "by_module",
    ):
        assert key in data
    assert data["dry_run"] is True
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_profile_real_run_and_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"grad_accum_steps": 2}))
    js = tmp_path / "p.json"
    res = _invoke(
        "profile",
        "-m",
        "tests.models:mlp_workload",
        "-b",
        "4",
        "-l",
        "1",
        "--plan",
        str(plan),
        "--json",
        str(js),
    )
    assert res.exit_code == 0, res.output
    data = json.loads(js.read_text())
    assert data["dry_run"] is False and data["plan"]["grad_accum_steps"] == 2


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "nonsense-model"], "names nothing"),
        (["--model", "gpt2-tiny", "--batch-size", "0"], "--batch-size must be"),
        (["--model", "tests.models:returns_model_only"], "must return a (model, batch) tuple"),
        (["--model", "tests.models:no_loss_workload"], "has no loss"),
        (["--model", "gpt2-tiny", "--cap", "lots"], "--cap"),
        (["--model", "gpt2-tiny", "--expert-load", "0.5"], "expert_load must be a number >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(args, match):
    res = _invoke("profile", "--dry-run", *args)
    assert res.exit_code == 2, res.output
    assert match in res.output
    assert "Traceback" not in res.output


def test_bad_plan_file(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"grad_acum_steps": 2}))
    res = _invoke("profile", "--model", "gpt2-tiny", "--dry-run", "--plan", str(plan))
    assert res.exit_code == 2
    assert "unknown key 'grad_acum_steps'" in res.output and "grad_accum_steps" in res.output


def test_model_failure_shows_the_models_own_error():
    res = _invoke("profile", "--model", "tests.models:broken_forward_workload", "-b", "2")
    assert res.exit_code == 1
    assert "custom failure inside Broken.forward" in res.output
    assert "Traceback" not in res.output


def test_cap_turns_into_a_clear_oom():
    res = _invoke("profile", "--model", "gpt2-tiny", "--dry-run", "--cap", "1MiB")
    assert res.exit_code == 2
    assert "virtual cap" in res.output


@pytest.mark.subprocess
def test_python_dash_m_entry_point_has_no_traceback():
    res = subprocess.run(
        [sys.executable, "-m", "memfit", "profile", "--model", "nope", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "names nothing" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) <= 3


@pytest.mark.subprocess
@pytest.mark.slow
def test_plan_exits_at_once_with_its_output_written_and_its_exit_code(tmp_path):
    # `memfit plan` ends the process without the interpreter's teardown: what it printed and
    # wrote must be complete, and the exit code the command's (0; 2 when nothing fits).
    out = tmp_path / "plan.json"
    args = ["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16", "--jobs", "1"]
    res = subprocess.run(
        [sys.executable, "-m", "memfit", "plan", *args, "--budget", "1GiB", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # (rich wraps at 80 columns without a terminal, inside words of a long path too)
    assert "searched in" in res.stdout and f"wrote{out}" in "".join(res.stdout.split())
    assert json.loads(out.read_text())["fits"] is True
    res = subprocess.run(
        [sys.executable, "-m", "memfit", "plan", *args, "--budget", "1KiB", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2 and "Nothing fits" in res.stderr
    assert json.loads(out.read_text())["fits"] is False


def test_profile_names_the_dry_run_policies_it_applied(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }))  # fmt: skip
    res = _invoke("profile", "--model", str(config), "--dry-run", "-b", "2", "-l", "16",
                  "--expert-load", "2")  # fmt: skip
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "dry-run policy: routing in model.layers.0.mlp.gate: expert_load=2 expert choice" in text


def test_profile_dry_runs_every_rank_of_a_tensor_pipeline_plan(tmp_path):
    """``memfit profile --dry-run --world-size 4`` with a tensor 2 x pipeline 2 plan: each
    rank's peak is predict_layout's; a world size other than the plan's degrees is refused."""
    from memfit.distributed.config import ParallelConfig
    from memfit.estimate.layout import predict_layout
    from memfit.plan import Plan
    from memfit.workload import load_workload

    par = ParallelConfig(tensor=2, pipeline=2, microbatches=2)
    Plan(parallel=par).to_json(tmp_path / "plan.json")
    args = ["profile", "--model", "llama-tiny", "--batch-size", "4", "--seq-len", "16",
            "--dry-run", "--plan", str(tmp_path / "plan.json")]
    result = runner.invoke(app, [*args, "--world-size", "4", "--json", str(tmp_path / "o.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "o.json").read_text())
    expected = predict_layout(load_workload("llama-tiny", 4, 16), par).peak_bytes
    assert data["predicted_rank_peak_bytes"] == list(expected) and len(expected) == 4
    bad = runner.invoke(app, [*args, "--world-size", "2"])
    assert bad.exit_code == 2 and "is 4 processes but --world-size is 2" in bad.output
