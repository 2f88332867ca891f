"""What ``memfit train`` prints into a log (``memfit train > log.txt``, a CI job): plain
progress lines with step, loss, tokens/s and memory, no third-party noise; ``--quiet``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from memfit.commands.train import _argv, train

app = typer.Typer()
app.command("train")(train)


@app.command("version")
def _version() -> None:  # a second command, so "train" stays a subcommand as in memfit's CLI
    pass


runner = CliRunner()
QUICK = ["--max-steps", "3", "--batch-size", "4", "--seq-len", "32"]
LINE = re.compile(r"^step (\d+)/3  loss \d+\.\d{4}  [\d,]+ tokens/s  mem \S+ \S+ \(peak \S+ \S+\)"
                  r"  elapsed \d+:\d\d:\d\d$", flags=re.M)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_log_file_gets_progress_lines_and_no_noise(tmp_path):
    log = tmp_path / "log.txt"
    with log.open("w") as stdout:
        res = subprocess.run([sys.executable, "-m", "memfit", "train", *QUICK], stdout=stdout,
                             stderr=subprocess.PIPE, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    text = log.read_text()
    # One line per step here (3 steps: every max(3 // 20, 1) steps), the last one included.
    assert [int(m.group(1)) for m in LINE.finditer(text)] == [1, 2, 3], text
    assert "plan (" in text and "measured peak" in text
    assert not re.search(r"Failed to load|_pytree|Traceback", text + res.stderr)


def test_quiet_prints_the_plan_and_result_only():
    res = runner.invoke(app, ["train", *QUICK, "--quiet"])
    assert res.exit_code == 0, res.output
    assert not LINE.search(res.output)
    assert "Peak device memory" not in res.output  # the table after the run
    assert "plan (" in res.stdout and re.search(r"^loss \S+ -> \S+ in 3 steps", res.stdout,
                                                  flags=re.M)


def test_launched_processes_get_quiet_and_verbose():
    argv = _argv({"max_steps": 3, "quiet": True, "verbose": False, "data": None})
    assert argv == ["train", "--max-steps", "3", "--quiet"]
