"""Plans with ZeRO-R's partitioned activation checkpoints at the command line: a combination
that cannot work is one sentence and exit code 2 (``memfit plan`` and ``memfit profile`` with
``--plan``), and a valid one is dry-run rank by rank (``memfit profile --world-size``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()
BAD = [
    ({"parallel": {"tensor": 2, "partition_activations": True}},
     "needs checkpointing 'full' or 'selective'"),
    ({"parallel": {"data": 2, "partition_activations": True}, "checkpointing": "full"},
     "needs tensor > 1"),
    ({"parallel": {"tensor": 2, "sequence": True, "partition_activations": True},
      "checkpointing": "full"},
     "has nothing to split with sequence true"),
    ({"parallel": {"tensor": 2, "partition_offload": True}, "checkpointing": "full"},
     "needs partition_activations true"),
]
COMMANDS = {
    "plan": ["plan", "--model", "llama-tiny", "--budget", "1GiB"],
    "profile": ["profile", "--model", "llama-tiny", "--dry-run"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("plan", "sentence"), BAD)
def test_a_bad_partition_plan_is_one_sentence_and_exit_2(tmp_path, command, plan, sentence):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    res = runner.invoke(app, [*COMMANDS[command], "--plan", str(path)],
                        env={"COLUMNS": "1000"})
    assert res.exit_code == 2, res.output
    assert sentence in res.output and "Traceback" not in res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.output


def test_a_partitioned_plan_is_dry_run_rank_by_rank(tmp_path):
    """``memfit profile --world-size 2`` with a partitioned plan predicts each rank below the
    same plan with whole checkpoints (and offload lower still)."""
    peaks = {}
    for name, extra in {"whole": {}, "partitioned": {"partition_activations": True},
                        "offload": {"partition_activations": True,
                                    "partition_offload": True}}.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"parallel": {"tensor": 2, **extra},
                                    "checkpointing": "full"}))
        out = tmp_path / f"{name}-out.json"
        res = runner.invoke(app, [*COMMANDS["profile"], "--plan", str(path), "--world-size",
                                  "2", "--json", str(out)], env={"COLUMNS": "1000"})
        assert res.exit_code == 0, res.output
        peaks[name] = json.loads(out.read_text())["predicted_peak_bytes"]
    assert len(peaks["whole"]) == 2
    for r in range(2):
        assert peaks["offload"][r] < peaks["partitioned"][r] < peaks["whole"][r]
