"""``memfit train`` on several real processes: through its own launcher and through torchrun,
the global loss of one process, per-process peaks, and a killed process that stops the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit import Plan

pytestmark = pytest.mark.distributed

CONFIG = """\
data: [data.txt]
batch_size: 8
seq_len: 32
eval_fraction: 0
track_every: 1000
lr: 0.003
warmup_steps: 1
"""
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("launch")
    (d / "data.txt").write_text(TEXT)
    (d / "run.yaml").write_text(CONFIG)
    # A flat schedule: a run stopped at step 2 by --max-steps then resumed to 4 follows the
    # same learning rates as one run to 4 (a cosine decay would end at the first run's end).
    (d / "flat.yaml").write_text(CONFIG + "schedule: constant\n")
    return d


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _memfit(workdir: Path, *args: str, launcher: list[str] | None = None, timeout: float = 240,
            config: str = "run.yaml"):
    cmd = [*(launcher or [sys.executable, "-m", "memfit"]), "train", "--config", config, *args]
    return subprocess.run(
        cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=timeout
    )


#: The ZeRO stage of the two-process runs below (every stage's numerics: test_data.py,
#: in-process; ZeRO-1's per-rank files: train/test_sharded_checkpoint.py).
STAGE = 3
#: The flat schedule (see workdir), which a resumed run can follow.
FLAT = {"config": "flat.yaml"}


def _two_processes(workdir: Path) -> list[str]:
    Plan(parallel={"data": 2, "zero_stage": STAGE}).to_json(workdir / f"plan{STAGE}.json")
    return ["--nproc-per-node", "2", "--plan", f"plan{STAGE}.json", "--seed", "3"]


@pytest.fixture(scope="session")  # one launch for the two tests that compare with it
def whole(workdir: Path) -> dict:
    """Two processes, ZeRO-3, four steps on the flat schedule, never stopped."""
    run = _memfit(workdir, *_two_processes(workdir), "--max-steps", "4", "--json",
                  f"whole{STAGE}.json", **FLAT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((workdir / f"whole{STAGE}.json").read_text())


def test_two_processes_train_like_one_on_the_global_batch(workdir: Path, whole: dict):
    # The one-process reference runs in this process (typer's runner): the two-process run
    # is the real launch under test.
    from typer.testing import CliRunner

    from memfit.cli import app

    Plan().to_json(workdir / "plan1.json")
    one = CliRunner().invoke(app, [
        "train", "--config", str(workdir / FLAT["config"]), "--plan", str(workdir / "plan1.json"),
        "--max-steps", "4", "--seed", "3", "--json", str(workdir / "one.json")])
    assert one.exit_code == 0, one.output[-3000:]
    a = whole
    b = json.loads((workdir / "one.json").read_text())
    assert a["world_size"] == 2 and len(a["per_rank_peak_bytes"]) == 2
    _assert_peaks_are_the_dry_runs(workdir, STAGE, a["per_rank_peak_bytes"])
    assert a["plan"]["parallel"]["data"] == 2 and a["plan"]["parallel"]["zero_stage"] == STAGE
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-5)


def _assert_peaks_are_the_dry_runs(workdir: Path, stage: int, measured: list[int]) -> None:
    """Each process's measured peak is its own rank's dry-run prediction (FSDP2's shards
    differ by rank, and so do the peaks), not merely a positive number."""
    from memfit.commands.train import build_config
    from memfit.estimate.distributed import predict_ranks
    from memfit.train.run import text_workload
    from memfit.train.tokenizer import load_tokenizer

    cfg = build_config(workdir / "run.yaml", {})
    workload = text_workload(cfg.model, load_tokenizer(cfg.tokenizer), cfg.batch_size, cfg.seq_len)
    predicted = predict_ranks(workload, Plan(parallel={"data": 2, "zero_stage": stage})).peak_bytes
    # The trainer holds a little the dry run does not, and not the same from run to run
    # (seen at stage 3: 2 to 8 KiB of 15 MiB, one rank 2 KiB while the other had 8 KiB): each
    # rank at or above its own prediction, by at most 0.1%. (Not explained yet.)
    over = [m - p for m, p in zip(measured, predicted, strict=True)]
    assert all(0 <= o <= 1e-3 * p for o, p in zip(over, predicted, strict=True)), (
        measured,
        predicted,
    )


def test_torchrun_runs_the_same_command(workdir: Path):
    Plan(parallel={"data": 2}).to_json(workdir / "plan_tr.json")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "memfit"]
    run = _memfit(workdir, "--plan", "plan_tr.json", "--max-steps", "2", "--json", "tr.json",
                  launcher=launcher)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((workdir / "tr.json").read_text())
    assert len(data["per_rank_peak_bytes"]) == 2


def test_a_plan_for_another_degree_is_refused_before_launch(workdir: Path, monkeypatch):
    # In this process (typer's runner): refused before launch, nothing to start; the tests
    # above run the same command line as a real process.
    from typer.testing import CliRunner

    from memfit.cli import app

    Plan(parallel={"data": 4}).to_json(workdir / "plan4.json")
    monkeypatch.chdir(workdir)
    run = CliRunner().invoke(app, ["train", "--config", "run.yaml", "--nproc-per-node", "2",
                                   "--plan", "plan4.json"])
    assert run.exit_code == 2, run.output
    assert "--nproc-per-node 4" in run.output and "Traceback" not in run.output


def test_a_resumed_run_equals_the_run_that_never_stopped(workdir: Path, whole: dict):
    common = _two_processes(workdir)
    ck = f"ck{STAGE}"
    first = _memfit(workdir, *common, "--max-steps", "2", "--checkpoint-dir", ck, **FLAT)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (workdir / ck / "step-00000002" / "manifest.json").is_file()
    rest = _memfit(workdir, *common, "--max-steps", "4", "--checkpoint-dir", ck, "--resume",
                   "--json", f"resumed{STAGE}.json", **FLAT)
    assert rest.returncode == 0, rest.stderr[-3000:]
    b = json.loads((workdir / f"resumed{STAGE}.json").read_text())
    assert b["losses"] == whole["losses"]
    assert b["params_sha256"] == whole["params_sha256"]


def test_a_killed_process_stops_the_others_with_a_clear_message(workdir: Path):
    Plan(parallel={"data": 2}).to_json(workdir / "plan_kill.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", "train", "--config", "run.yaml", "--nproc-per-node",
         "2", "--max-steps", "100000", "--checkpoint-dir", "ck-kill", "--save-every", "2",
         "--plan", "plan_kill.json"],
        cwd=workdir, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        workers: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(1)
            workers = _workers(proc.pid)
        assert len(workers) == 2, "the launcher did not start two processes"
        while time.monotonic() < deadline and not list((workdir / "ck-kill").glob("step-*")):
            time.sleep(0.5)  # into training, past a checkpoint
        os.kill(workers[-1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "was killed by SIGKILL" in stderr and "stopped the other processes" in stderr
    # A restart resumes from the last sharded checkpoint.
    saved = sorted((workdir / "ck-kill").glob("step-*"))
    assert saved, "no checkpoint was written before the kill"
    step = int(saved[-1].name.split("-")[1])
    again = _memfit(workdir, "--nproc-per-node", "2", "--checkpoint-dir", "ck-kill", "--resume",
                    "--max-steps", str(step + 1), "--json", "after-kill.json",
                    "--plan", "plan_kill.json")
    assert again.returncode == 0, again.stderr[-3000:]
    data = json.loads((workdir / "after-kill.json").read_text())
    assert data["steps"] == step + 1 and len(data["losses"]) == step + 1


def _workers(launcher_pid: int) -> list[int]:
    """The launcher's worker processes (its children running memfit)."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=,args=", "-A"], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    return sorted(int(pid) for pid, ppid, args in rows
                  if int(ppid) == launcher_pid and "memfit" in args)


def test_profile_under_torchrun_writes_one_report_per_rank_and_a_merged_one(tmp_path: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "memfit", "profile", "-m", "gpt2-tiny", "-b", "4", "-l", "16", "--json",
           "prof.json"]
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    merged = json.loads((tmp_path / "prof.json").read_text())
    assert [r["rank"] for r in merged["ranks"]] == [0, 1]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"prof.rank{rank}.json").read_text())
        assert report["peak_bytes"] == merged["per_rank_peak_bytes"][rank] > 0


def test_sigterm_to_one_process_stops_all_at_the_same_step_with_a_checkpoint(workdir: Path):
    Plan(parallel={"data": 2}).to_json(workdir / "plan_term.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", "train", "--config", "run.yaml", "--nproc-per-node",
         "2", "--max-steps", "100000", "--checkpoint-dir", "ck-term", "--save-every", "5",
         "--plan", "plan_term.json", "--json", "term.json"],
        cwd=workdir, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # Into training, where the trainer stops on a signal (before, a process still
        # importing or building dies of it): wait for the first periodic checkpoint, however
        # long a loaded machine takes to get there.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any((workdir / "ck-term").glob("step-*")):
            assert proc.poll() is None, "the run ended before its first checkpoint"
            time.sleep(0.5)
        workers = _workers(proc.pid)
        assert len(workers) == 2, "the launcher did not start two processes"
        os.kill(workers[-1], signal.SIGTERM)  # one process only
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-3000:]  # 128 + SIGTERM: stopped, not failed
    assert "error:" not in stderr, stderr[-3000:]  # memfit names no failure
    data = json.loads((workdir / "term.json").read_text())
    assert data["stopped_by"] is not None
    saved = sorted((workdir / "ck-term").glob("step-*"))
    assert saved and int(saved[-1].name.split("-")[1]) == data["steps"]
