"""A missing optional package is one sentence naming the extra to install, and exit code 2,
found before any work: peft, torchao, datasets, accelerate, lightning, bitsandbytes.

"Missing" is simulated without uninstalling anything: ``sys.modules[name] = None`` makes
``import name`` fail and ``importlib.util.find_spec(name)`` answer ``None``, in this process
(the CLI through typer's runner) or, for the end-to-end test, in a child process whose
``PYTHONPATH`` starts with a folder holding a ``peft`` package that fails to import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import memfit
from memfit.cli import app
from memfit.extras import EXTRAS, MissingExtra, import_extra, installed, require

runner = CliRunner()


def _block(monkeypatch, *packages: str) -> None:
    """Make ``packages`` look not installed, and any work the command would start fail the
    test (the check must come first)."""
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)

    def no_work(*args, **kwargs):
        raise AssertionError("the command started its work before checking its packages")

    monkeypatch.setattr(memfit.workload, "load_workload", no_work)


def _one_sentence(result, extra: str, package: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert message.startswith("error:"), message
    assert f"needs {package}, which is not installed here: pip install 'memfit[{extra}]'" in message
    return message


def test_the_sentence_names_what_needs_it_and_the_extra():
    e = MissingExtra("peft", "--allow lora")
    assert str(e) == "--allow lora needs peft, which is not installed here: pip install 'memfit[peft]'"
    assert isinstance(e, ImportError) and isinstance(e, ValueError) and e.name == "peft"
    assert set(EXTRAS) == {"peft", "torchao", "datasets", "accelerate", "lightning", "bitsandbytes"}


def test_every_extra_named_is_one_pyproject_declares():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for package, extra in EXTRAS.items():
        assert any(spec.startswith(package) for spec in extras[extra]), (package, extra)


def test_require_and_import_extra(monkeypatch):
    assert installed("json") and not installed("no_such_package_memfit")
    monkeypatch.setitem(sys.modules, "peft", None)
    assert not installed("peft")
    with pytest.raises(MissingExtra, match=r"^LoRA needs peft, .*memfit\[peft\]'$"):
        require("peft", "LoRA")
    with pytest.raises(MissingExtra, match=r"memfit\[fp8\]"):
        import_extra("peft.tuners", "x", "fp8")
    assert import_extra("json", "x").dumps([]) == "[]"


@pytest.mark.parametrize(
    ("allow", "blocked", "extra", "package"),
    [("lora", "peft", "peft", "peft"), ("qlora", "torchao", "peft", "torchao"),
     ("fp8", "torchao", "fp8", "torchao")],
)
def test_plan_allow_needs_peft_or_torchao(monkeypatch, allow, blocked, extra, package):
    _block(monkeypatch, blocked)
    result = runner.invoke(app, ["plan", "-m", "tests.models:mlp_workload", "--budget", "1GiB",
                                 "--allow", allow])
    message = _one_sentence(result, extra, package)
    assert f"--allow {allow}" in message


@pytest.mark.parametrize(
    ("optimizer", "package", "extra"),
    [("bnb-adamw8bit", "bitsandbytes", "bitsandbytes"),
     ("torchao-adamw8bit", "torchao", "torchao")],
)
def test_a_plans_peer_optimizer_needs_its_package_to_train(tmp_path, monkeypatch, optimizer,
                                                          package, extra):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"optimizer": {"name": optimizer, "lr": 1e-3}}))
    _block(monkeypatch, package)
    result = runner.invoke(app, ["profile", "-m", "tests.models:mlp_workload", "--plan",
                                 str(plan)])
    message = _one_sentence(result, extra, package)
    assert f"optimizer '{optimizer}'" in message and "(or use memfit's 'adamw8bit'" in message


def test_a_dry_run_of_a_peer_optimizer_needs_no_package(tmp_path, monkeypatch):
    # Dry runs build memfit's stand-in with the same state layout: nothing to install.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"optimizer": {"name": "bnb-adamw8bit", "lr": 1e-3}}))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    result = runner.invoke(app, ["profile", "-m", "tests.models:mlp_workload", "-b", "2",
                                 "--plan", str(plan), "--dry-run", "--steps", "1"])
    assert result.exit_code == 0, result.output


def test_a_plan_with_lora_needs_peft_to_train(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"lora": {"rank": 4, "target_modules": "all-linear"}}))
    _block(monkeypatch, "peft")
    result = runner.invoke(app, ["train", "--plan", str(plan), "--max-steps", "1"])
    message = _one_sentence(result, "peft", "peft")
    assert f"--plan {plan}'s LoRA adapters" in message


def test_parquet_without_datasets_or_pyarrow(tmp_path, monkeypatch):
    data = tmp_path / "d.parquet"
    data.write_bytes(b"PAR1")
    for package in ("datasets", "pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, package, None)
    result = runner.invoke(app, ["profile", "-m", "gpt2-tiny", "--dry-run", "--data", str(data)])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "needs the datasets or pyarrow package" in message
    assert "pip install 'memfit[data]'" in message and "Traceback" not in result.output


def test_the_hf_integration_needs_accelerate(monkeypatch):
    from memfit.integrations import hf

    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(MissingExtra, match=r"needs accelerate, .*pip install 'memfit\[hf\]'$"):
        hf.apply(memfit.Plan(), None, None)


def test_the_lightning_integration_needs_lightning(monkeypatch):
    from memfit.integrations import lightning

    monkeypatch.setattr(lightning, "_CLASS", None)
    monkeypatch.setitem(sys.modules, "lightning", None)
    with pytest.raises(MissingExtra, match=r"needs lightning, .*'memfit\[lightning\]'$"):
        lightning.MemfitCallback  # noqa: B018 - building the class imports lightning


@pytest.mark.subprocess
def test_end_to_end_a_broken_peft_is_one_line_on_stderr(tmp_path):
    # A `peft` that fails to import, first on the path: what a missing install looks like to
    # the import system, past the check before the work (find_spec sees this package).
    fake = tmp_path / "peft"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'peft'\", name='peft')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run(
        # A budget the plain plan does not fit, so the search reaches QLoRA (and peft).
        [sys.executable, "-m", "memfit", "plan", "-m", "tests.models:mlp_workload", "-b", "2",
         "-l", "1", "--budget", "16KiB", "--allow", "qlora"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "pip install 'memfit[peft]'" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_a_missing_package_found_deep_in_a_command_is_still_one_sentence(monkeypatch):
    # Past the checks made before the work (a package imported by a library memfit calls, say):
    # the command's guard in memfit.cli turns it into the same sentence and exit 2.
    from memfit.commands import plan as plan_command

    def deep(*args, **kwargs):
        raise MissingExtra("lightning", "a callback the plan's technique builds")

    monkeypatch.setattr(plan_command, "_print_answer", deep)
    result = runner.invoke(app, ["plan", "-m", "tests.models:mlp_workload", "-b", "2", "-l", "1",
                                 "--budget", "1GiB"])
    _one_sentence(result, "lightning", "lightning")
