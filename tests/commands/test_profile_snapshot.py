"""``memfit profile --snapshot``: a dry or real run's timeline for PyTorch's memory viewer."""

from __future__ import annotations

import pickle

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()


def _events(path):
    snapshot = pickle.loads(path.read_bytes())
    return [(e["action"], e["size"]) for e in snapshot["device_traces"][0]], snapshot


def test_a_dry_runs_snapshot_is_the_real_runs(tmp_path):
    args = ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16", "--steps", "2"]
    dry, real = tmp_path / "dry.pickle", tmp_path / "real.pickle"
    first = runner.invoke(app, [*args, "--dry-run", "--snapshot", str(dry)])
    second = runner.invoke(app, [*args, "--snapshot", str(real)])
    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    assert "memory_viz" in first.output
    dry_events, dry_snapshot = _events(dry)
    real_events, _ = _events(real)
    # On the CPU a dry run's forward and backward allocate what the real run's do, in the same
    # order (the optimizer's step may order its state and temporaries otherwise), and its
    # modelled peaks are the real run's.
    first_step = next(i for i, e in enumerate(dry_snapshot["device_traces"][0])
                      if e["frames"] and e["frames"][0]["name"].startswith("optimizer"))
    assert first_step > 100 and dry_events[:first_step] == real_events[:first_step]
    assert _peaks(dry_events) == _peaks(real_events)


def _peaks(events):
    allocated = reserved = peak_allocated = peak_reserved = 0
    for action, size in events:
        allocated += size if action == "alloc" else -size if action == "free_completed" else 0
        reserved += size if action == "segment_alloc" else -size if action == "segment_free" else 0
        peak_allocated, peak_reserved = max(peak_allocated, allocated), max(peak_reserved, reserved)
    return peak_allocated, peak_reserved


def test_snapshot_takes_one_process(tmp_path):
    result = runner.invoke(app, ["profile", "--model", "gpt2-tiny", "--dry-run",
                                 "--world-size", "2", "--snapshot", str(tmp_path / "s.pickle")])
    assert result.exit_code == 2
    assert "--snapshot writes one process's timeline" in result.output
    assert not (tmp_path / "s.pickle").exists()
