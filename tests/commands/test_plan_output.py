"""What ``memfit plan`` prints where standard output is not a terminal (``| cat``, a CI log):
the table laid out for the width it gets, the chosen plan always shown, no third-party noise;
``--quiet`` for scripts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()

#: A search whose winner is not its fastest candidate (faster ones do not fit), its plan long.
ARGS = ["plan", "-m", "gpt2-tiny", "-b", "4", "-l", "32", "--budget", "3MiB",
        "--allow", "8bit,freeze", "--forbid", "checkpointing"]
#: Third-party lines that must not reach memfit's output by default.
NOISE = re.compile(r"Failed to load|_pytree|register_constant|Traceback")


def _no_cut_words(text: str) -> None:
    """No line is a single word cut by an ellipsis ('bf16-…', '(fore…'), none is wider than
    rich's width for a pipe."""
    for line in text.splitlines():
        words = line.strip("│┃ ").split()
        assert not (len(words) == 1 and words[0].endswith("…")), line


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("columns", ["80", "50"])
def test_piped_plan_shows_the_chosen_plan_in_the_width(columns):
    env = {**os.environ, "COLUMNS": columns}
    res = subprocess.run([sys.executable, "-m", "memfit", *ARGS], capture_output=True,
                         text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert not NOISE.search(out + res.stderr), out + res.stderr
    _no_cut_words(out)
    assert all(len(line) <= int(columns) for line in out.splitlines()), out
    chosen = re.search(r"^plan: (.+)$", out, flags=re.M).group(1)
    # The chosen plan is among the candidates listed (starred), not only in the verdict.
    flat = " ".join(out.split())
    assert f"★ {chosen}" in flat, out


def test_quiet_prints_the_answer_without_the_table():
    res = runner.invoke(app, ["plan", "-m", "tests.models:mlp_workload", "-b", "4", "-l", "1",
                              "--budget", "1GiB", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "Candidates weighed" not in res.output and "Winner:" not in res.output
    assert re.search(r"^plan: \S", res.stdout, flags=re.M)
    assert "predicted peak:" in res.stdout
    assert res.stderr == ""


def test_quiet_with_verbose_is_one_sentence():
    res = runner.invoke(app, ["plan", "-m", "tests.models:mlp_workload", "--budget", "1GiB",
                              "--quiet", "--verbose"])
    assert res.exit_code == 2
    assert "error: --quiet and --verbose ask for opposite things" in " ".join(res.output.split())


@pytest.mark.subprocess
@pytest.mark.slow
def test_no_third_party_noise_unless_verbose():
    # A dry run imports torchao (its float8 and NF4 support): where its optional kernels do
    # not load, torchao logs "Failed to load ... .so" and torch logs _pytree deprecations.
    args = [sys.executable, "-m", "memfit", "profile", "-m", "gpt2-tiny", "--dry-run", "-b",
            "2", "-l", "16", "--steps", "1"]
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0, quiet.stderr
    assert not NOISE.search(quiet.stdout + quiet.stderr), quiet.stdout + quiet.stderr
    loud = subprocess.run([*args, "--verbose"], capture_output=True, text=True, timeout=600)
    assert loud.returncode == 0, loud.stderr
    if not NOISE.search(loud.stdout + loud.stderr):
        pytest.skip("torchao loads all its kernels on this machine: no noise to silence")
