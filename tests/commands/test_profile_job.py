"""``memfit profile --job``: each phase's peak and the phase that sets the run's peak."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memfit.cli import app
from memfit.train.job import JOB_PHASES, predict_job

runner = CliRunner()
ARGS = ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16", "--job"]


def test_a_dry_job_prints_its_phases_and_writes_the_apis_figures(tmp_path):
    path = tmp_path / "job.json"
    result = runner.invoke(app, [*ARGS, "--dry-run", "--device", "cpu", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    job = data["job"]
    assert list(job["phases"]) == list(JOB_PHASES)
    peaks = {k: v["peak_allocated_bytes"] for k, v in job["phases"].items()}
    assert job["peak_phase"] == max(JOB_PHASES, key=lambda k: peaks[k])
    assert f"the run's peak is set by {job['peak_phase']}" in result.output
    for phase in JOB_PHASES:
        assert phase in result.output
    # The command is the API's prediction, figure for figure.
    api = predict_job("gpt2-tiny", device="cpu", batch_size=2, seq_len=16)
    assert job == json.loads(json.dumps(api.to_dict()))
    assert data["dry_run"] is True and data["target_device"] == "cpu"


def test_job_refuses_what_it_does_not_do_in_one_sentence():
    for extra in (["--dry-run", "--world-size", "2"], ["--cap", "1GiB"], ["--device", "h100"]):
        result = runner.invoke(app, [*ARGS, *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
