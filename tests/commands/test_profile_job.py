"""``memfit profile --job``: each phase's peak and the phase that sets the run's peak."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memfit.cli import app
from memfit.train.job import JOB_PHASES

runner = CliRunner()
ARGS = ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16", "--job"]


def _job(args, path):
    result = runner.invoke(app, [*ARGS, *args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    return result.output, json.loads(path.read_text())


def test_a_dry_job_prints_its_phases_and_the_trainer_measures_the_same(tmp_path):
    output, dry = _job(["--dry-run", "--device", "cpu"], tmp_path / "dry.json")
    job = dry["job"]
    assert list(job["phases"]) == list(JOB_PHASES)
    peaks = {k: v["peak_allocated_bytes"] for k, v in job["phases"].items()}
    assert job["peak_phase"] == max(JOB_PHASES, key=lambda k: peaks[k])
    assert job["peak_allocated_bytes"] == peaks[job["peak_phase"]]
    assert f"the run's peak is set by {job['peak_phase']}" in output
    for phase in JOB_PHASES:
        assert phase in output
    assert dry["dry_run"] is True and dry["target_device"] == "cpu"
    # Without --dry-run the trainer runs the job on this machine (measure_job): on the CPU
    # every phase's measured peak is the predicted one, to the byte.
    output, real = _job([], tmp_path / "real.json")
    assert real["dry_run"] is False and "peak is set by" in output
    assert {k: v["peak_allocated_bytes"] for k, v in real["job"]["phases"].items()} == peaks
    assert real["job"]["peak_phase"] == job["peak_phase"]


def test_job_refuses_what_it_does_not_do_in_one_sentence():
    for extra in (["--dry-run", "--world-size", "2"], ["--cap", "1GiB"], ["--device", "h100"]):
        result = runner.invoke(app, [*ARGS, *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
