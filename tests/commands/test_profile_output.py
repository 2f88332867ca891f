"""``memfit profile --quiet``: the figures only, for scripts."""

from __future__ import annotations

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()


def test_quiet_profile_prints_the_peak_without_tables():
    args = ["profile", "-m", "tests.models:mlp_workload", "-b", "2", "--dry-run", "--steps", "1"]
    loud = runner.invoke(app, args)
    quiet = runner.invoke(app, [*args, "--quiet"])
    assert loud.exit_code == 0 and quiet.exit_code == 0, loud.output + quiet.output
    assert "Peak by phase" in loud.stdout and "Peak by phase" not in quiet.output
    peak = next(line for line in loud.stdout.splitlines() if line.startswith("peak: "))
    assert peak in quiet.stdout.splitlines()
    assert quiet.stderr == ""
