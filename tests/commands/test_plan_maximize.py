"""``memfit plan --maximize seq-len|batch-size`` and ``--budgets``: bad values are one
sentence and exit 2 before any work; the JSON carries ``maximized``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.planner import FORBID

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--budget", "1GiB", "--maximize", "tokens"], "--maximize 'tokens' is not known"),
        (["--budgets", "1GiB,2GiB"], "add --maximize seq-len"),
        (["--maximize", "seq-len", "--budgets", "1GiB,lots"], "budget 'lots' is not understood"),
        (["--maximize", "seq-len", "--budgets", "1GiB,,2GiB"], "has an empty entry"),
        (["--maximize", "seq-len"], "--budget is required"),
        (["--maximize", "seq-len", "--budget", "1GiB", "--budgets", "2GiB"], "not both"),
        (["--maximize", "batch-size", "--budget", "1GiB", "--world-size", "2"], "one process"),
        (["--maximize", "seq-len", "--budgets", "1GiB,2GiB", "--save", "p.json"], "--save"),
        (["--maximize", "seq-len", "--budget", "1GiB", "--allow", "shorter-seq"], "shorter-seq"),
    ],
)
def test_bad_values_are_one_sentence_and_exit_2(args, match):
    res = runner.invoke(app, ["plan", "--model", "gpt2-tiny", "--device", "cpu", *args])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and match in res.output and "Traceback" not in res.output


# A GPT-2 of four blocks, 1024 positions: deep enough to compose, cheap to dry-run.
CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 2,
    "vocab_size": 512,
    "n_positions": 1024,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def _plan(tmp_path, *args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    # Every default technique forbidden: the plain plan alone, so that few predictions decide.
    cmd = [sys.executable, "-m", "memfit", "plan", "--model", str(path), "-b", "2", "-l", "16",
           "--device", "cpu", "--jobs", "1", "--forbid", ",".join(FORBID), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_json_has_maximized_seq_len_and_a_row_per_budget(tmp_path):
    res = _plan(tmp_path, "--budget", "12MiB", "--maximize", "seq-len", "--json", "one.json")
    assert res.returncode == 0, res.stderr
    one = json.loads((tmp_path / "one.json").read_text())
    n = one["maximized"]["seq_len"]
    assert isinstance(n, int) and 16 < n < 1024 and one["fits"] is True
    assert one["predicted_device_total_upper_bytes"] <= 12 * 2**20
    assert one["maximized_details"]["next_checked"] > n
    assert f"longest context: {n} tokens" in res.stdout

    res = _plan(tmp_path, "--budgets", "1KiB,12MiB", "--maximize", "seq-len", "--json", "t.json")
    assert res.returncode == 0, res.stderr
    rows = json.loads((tmp_path / "t.json").read_text())["maximized"]
    assert [r["budget"] for r in rows] == ["1KiB", "12MiB"]
    assert rows[0]["seq_len"] is None and rows[0]["fits"] is False
    assert rows[1]["seq_len"] == n  # the same question at the same budget: the same answer
    assert "nothing fits" in res.stdout and "longest context" in res.stdout
