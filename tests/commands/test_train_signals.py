"""``memfit train`` stopped by a signal, as real processes: SIGTERM during evaluation stops it
within one batch, saves and exits 143; SIGINT exits 130; a second signal interrupts at once;
SIGTERM while the data is tokenised stops before training (issue 37). And the
``--eval-max-batches`` option."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from memfit.commands.train import train

SRC = str(Path(__file__).resolve().parents[2] / "src")
# A held-out split far larger than any test waits for: 26,000 samples, 6,500 batches of 4.
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(40_000))
CONFIG = """\
data: [data.txt]
batch_size: 4
seq_len: 32
plan: {}
eval_fraction: 0.5
eval_every: 1
eval_max_batches: 0
track_every: 1000
warmup_steps: 1
"""

# Run in the child instead of ``python -m memfit``: the same CLI, but each evaluation batch
# (made by the evaluation's ``to_device``) and each tokenised document (``data._encode``) is
# logged, one line each, to MEMFIT_TEST_LOG, and takes MEMFIT_TEST_SLEEP seconds more: the
# test sees where the run is, and can count what it did after the signal.
LOGGING_CLI = """\
import os, sys, time
from memfit.train import data
from memfit.train.callbacks import evaluation
what = os.environ["MEMFIT_TEST_WHAT"]
module, name = (evaluation, "to_device") if what == "eval" else (data, "_encode")
real = getattr(module, name)
def logged(*args, **kwargs):
    with open(os.environ["MEMFIT_TEST_LOG"], "a") as f:
        f.write("x\\n")
    time.sleep(float(os.environ["MEMFIT_TEST_SLEEP"]))
    return real(*args, **kwargs)
setattr(module, name, logged)
from memfit.cli import main
sys.argv = ["memfit", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("signals")
    (d / "data.txt").write_text(TEXT)
    (d / "run.yaml").write_text(CONFIG)
    return d


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "200", **extra}


def _argv(run: str, *, logging: bool) -> list[str]:
    head = [sys.executable, "-c", LOGGING_CLI] if logging else [sys.executable, "-m", "memfit"]
    return [*head, "train", "--config", "run.yaml", "--max-steps", "5", "--checkpoint-dir",
            f"ck-{run}", "--json", f"{run}.json"]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for_lines(proc: subprocess.Popen, log: Path, count: int) -> None:
    """Wait (at most 240 s) until the run has logged ``count`` lines; fail if it ends first."""
    deadline = time.monotonic() + 240
    while _lines(log) < count:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.01)


def _signal_after_logged(workdir: Path, run: str, what: str, count: int, sig: int):
    """Start the logging run; once ``count`` lines are logged, send ``sig``. Returns the
    finished process, its output, and the lines logged when the signal was sent."""
    log = workdir / f"{run}.log"
    proc = subprocess.Popen(
        _argv(run, logging=True), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=_env(MEMFIT_TEST_WHAT=what, MEMFIT_TEST_LOG=str(log),
                            MEMFIT_TEST_SLEEP="0.2"),
    )  # fmt: skip
    try:
        _wait_for_lines(proc, log, count)
        at_signal = _lines(log)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, output, at_signal, _lines(log)


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_during_evaluation_stops_within_one_batch_saves_and_exits_143(workdir):
    proc, output, at_signal, logged = _signal_after_logged(
        workdir, "term", "eval", 3, signal.SIGTERM
    )
    assert proc.returncode == 143, output[-3000:]
    # At most the batch being asked for as the signal came; 6,500 were left.
    assert logged - at_signal <= 1, (at_signal, logged)
    data = json.loads((workdir / "term.json").read_text())  # written before the exit
    assert data["stopped_by"] == "SIGTERM" and data["steps"] == 1
    assert data["eval_batches"] == [[1, logged]]
    assert data["eval_losses"] == []  # the cut evaluation is not reported as a loss
    assert [p.name for p in (workdir / "ck-term").iterdir()] == ["step-00000001"]
    assert data["checkpoint"].endswith("step-00000001")
    assert "stopped by SIGTERM after step 1" in output
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_signal_interrupts_at_once_with_its_code(workdir):
    log = workdir / "twice.log"
    proc = subprocess.Popen(
        _argv("twice", logging=True), cwd=workdir, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=_env(MEMFIT_TEST_WHAT="eval", MEMFIT_TEST_LOG=str(log), MEMFIT_TEST_SLEEP="1"),
    )  # fmt: skip
    try:
        _wait_for_lines(proc, log, 2)
        proc.send_signal(signal.SIGTERM)  # the batch being made takes a second: both land in it
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output[-3000:]
    assert "interrupted by a second SIGTERM" in output
    assert not (workdir / "twice.json").exists()  # no clean stop, no results
    assert not list(workdir.glob("ck-twice/step-*"))
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigint_during_evaluation_exits_130_with_its_results(workdir):
    # The plain command, watched through its own output: it says when an evaluation starts.
    proc = subprocess.Popen(
        _argv("int", logging=False), cwd=workdir, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=_env(),
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("step 1: evaluating" in line for line in lines):
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "the run never evaluated"
            time.sleep(0.01)
        time.sleep(0.5)  # a few batches in
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert proc.returncode == 130, output[-3000:]
    data = json.loads((workdir / "int.json").read_text())
    assert data["stopped_by"] == "SIGINT" and data["steps"] == 1
    # The plan line says the bound (none: eval_max_batches 0) and how many batches there are.
    total = re.search(r"eval: ([\d,]+) of \1 batches \(", output)
    assert total, output[-3000:]
    (step, batches), = data["eval_batches"]
    assert step == 1 and 0 < batches < int(total[1].replace(",", ""))  # stopped, not finished
    assert (workdir / "ck-int" / "step-00000001").is_dir()
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_during_data_preparation_stops_before_training(workdir):
    records = workdir / "records.jsonl"
    records.write_text("".join(json.dumps({"text": f"record {i} " * 20}) + "\n"
                               for i in range(2_000)))
    (workdir / "prep.yaml").write_text(CONFIG.replace("data.txt", "records.jsonl"))
    argv = _argv("prep", logging=True)
    argv[argv.index("run.yaml")] = "prep.yaml"
    log = workdir / "prep.log"
    proc = subprocess.Popen(
        argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(MEMFIT_TEST_WHAT="data", MEMFIT_TEST_LOG=str(log), MEMFIT_TEST_SLEEP="0.05"),
    )  # fmt: skip
    try:
        _wait_for_lines(proc, log, 5)
        at_signal = _lines(log)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output[-3000:]
    assert _lines(log) - at_signal <= 1  # of 2,000 records
    assert "stopped by SIGTERM; nothing was trained" in output
    assert not (workdir / "prep.json").exists()
    assert not list((workdir / "ck-prep").glob("step-*"))
    assert "Traceback" not in output


# ---------------------------------------------------------------------------------- option
app = typer.Typer()
app.command("train")(train)


@app.command("version")
def _version() -> None:  # a second command, so "train" stays a subcommand as in memfit's CLI
    pass


def test_eval_max_batches_option_is_checked_and_named():
    res = CliRunner().invoke(app, ["train", "--eval-max-batches", "-1"])
    assert res.exit_code == 2, res.output
    message = " ".join(res.output.split())
    assert message.startswith("error: --eval-max-batches must be a whole number >= 0, got -1")


def test_help_documents_the_exit_codes():
    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.output.split())
    assert "143 after SIGTERM" in text and "130 after SIGINT" in text
    assert "--eval-max-batches" in text
