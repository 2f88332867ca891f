"""Exact resume with real processes: ``memfit train`` killed (SIGKILL) at random steps and
during a save, or stopped by SIGTERM, then resumed, ends with the same parameters
(``params_sha256``) and the same loss curve, bit for bit, as the run that never stopped."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SRC = str(Path(__file__).resolve().parents[2] / "src")
STEPS = 16
CONFIG = """\
data: [data.txt]
batch_size: 4
seq_len: 32
plan: {}
eval_fraction: 0
track_every: 1000
lr: 0.003
warmup_steps: 2
"""
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))

# Run in the child instead of ``python -m memfit``: the same CLI, but the save of step
# MEMFIT_TEST_HANG_AT writes its files, then signals the test (a marker file) and hangs before
# its manifest and rename, so that the test can kill the process in the middle of a save.
HANGING_CLI = """\
import os, sys, time
from memfit.train import checkpoint
real = checkpoint.write_manifest
def write_manifest(folder, step, extra=None):
    if step == int(os.environ["MEMFIT_TEST_HANG_AT"]):
        open(os.environ["MEMFIT_TEST_MARKER"], "w").close()
        time.sleep(120)
    return real(folder, step, extra)
checkpoint.write_manifest = write_manifest
from memfit.cli import main
sys.argv = ["memfit", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("crash")
    (d / "data.txt").write_text(TEXT)
    (d / "run.yaml").write_text(CONFIG)
    return d


def _argv(workdir: Path, run: str, *extra: str, cli: str | None = None) -> list[str]:
    head = [sys.executable, "-c", cli] if cli else [sys.executable, "-m", "memfit"]
    return [
        *head,
        "train",
        "--config", str(workdir / "run.yaml"),
        "--max-steps", str(STEPS),
        "--seed", "5",
        "--checkpoint-dir", str(workdir / run),
        "--save-every", "1",
        "--keep", "2",
        "--json", str(workdir / f"{run}.json"),
        *extra,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "200", **extra}


def _train(workdir: Path, run: str, *extra: str) -> dict:
    done = subprocess.run(
        _argv(workdir, run, *extra), cwd=workdir, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((workdir / f"{run}.json").read_text())


def _steps(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in folder.iterdir() if p.name.startswith("step-"))


def _kill_at(workdir: Path, run: str, step: int, sig: int = signal.SIGKILL) -> subprocess.Popen:
    """Start the run (resuming if it has checkpoints) and send ``sig`` once step ``step`` is
    saved."""
    extra = ("--resume",) if _steps(workdir / run) else ()
    proc = subprocess.Popen(
        _argv(workdir, run, *extra), cwd=workdir, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not any(s >= step for s in _steps(workdir / run)):
        assert proc.poll() is None, f"the run ended before step {step}: {proc.stdout.read()[-2000:]}"
        assert time.monotonic() < deadline, "the run never reached the step"
        time.sleep(0.005)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def reference(workdir) -> dict:
    return _train(workdir, "reference")


@pytest.mark.subprocess
def test_sigkill_at_random_steps_then_resume_is_bit_exact(workdir, reference):
    rng = random.Random(20261122)
    first, second = sorted(rng.sample(range(2, STEPS - 2), 2))
    proc = _kill_at(workdir, "killed", first)
    assert proc.returncode == -signal.SIGKILL
    proc = _kill_at(workdir, "killed", max(second, max(_steps(workdir / "killed")) + 1))
    assert proc.returncode == -signal.SIGKILL
    assert max(_steps(workdir / "killed")) < STEPS  # killed before the end, really
    resumed = _train(workdir, "killed", "--resume")
    assert resumed["steps"] == STEPS
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["losses"] == reference["losses"]
    assert resumed["final_loss"] == reference["final_loss"]


@pytest.mark.subprocess
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(workdir, reference):
    hang_at = random.Random(7).randrange(3, STEPS - 3)
    marker = workdir / "saving"
    run = workdir / "mid-save"
    proc = subprocess.Popen(
        _argv(workdir, "mid-save", cli=HANGING_CLI), cwd=workdir, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=_env(MEMFIT_TEST_HANG_AT=str(hang_at), MEMFIT_TEST_MARKER=str(marker)),
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.kill()
    proc.wait(timeout=60)
    # The half-written save is a temporary folder; the previous checkpoint is complete.
    assert [p.name for p in run.iterdir() if p.name.startswith(".tmp-")]
    assert max(_steps(run)) == hang_at - 1
    resumed = _train(workdir, "mid-save", "--resume")
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp-")]  # cleaned up
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["losses"] == reference["losses"]


@pytest.mark.subprocess
def test_sigterm_saves_and_exits_143_then_resumes_exactly(workdir, reference):
    proc = _kill_at(workdir, "terminated", 4, signal.SIGTERM)
    output = proc.stdout.read()
    assert proc.returncode == 143, output[-2000:]  # 128 + SIGTERM, after the results
    assert "stopped by SIGTERM" in output
    stopped = json.loads((workdir / "terminated.json").read_text())
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] < STEPS
    assert max(_steps(workdir / "terminated")) == stopped["steps"]  # saved where it stopped
    resumed = _train(workdir, "terminated", "--resume")
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["losses"] == reference["losses"]
