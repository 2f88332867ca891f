"""``memfit profile --snapshot`` and ``--html``: a dry or real run's timeline for PyTorch's memory
viewer, as its pickle or as the viewer's page."""

from __future__ import annotations

import pickle

import pytest
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


def _embedded_snapshot(html: str):
    """The snapshot the page carries: its download link's base64 pickle."""
    import base64
    import re

    link = re.search(r'<a download="snapshot.pickle" href="data:application/octet-stream;base64,'
                     r'([A-Za-z0-9+/=]+)">', html)
    return pickle.loads(base64.b64decode(link.group(1)))


@pytest.mark.parametrize("dry", [True, False])
def test_html_is_a_self_contained_page_of_the_timeline(tmp_path, dry):
    page, pickled = tmp_path / "timeline.html", tmp_path / "run.pickle"
    args = ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16", "--steps", "2",
            "--html", str(page), "--snapshot", str(pickled), *(["--dry-run"] if dry else [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wrote the memory timeline to" in result.output
    html = page.read_text()
    # memfit's page: the timeline as inline SVG, nothing loaded from anywhere (no script, no
    # URL a browser would fetch), and the run's snapshot carried whole (the one --snapshot
    # pickles) for PyTorch's viewer.
    assert html.lstrip().startswith("<!DOCTYPE html>") and '<svg id="timeline"' in html
    assert "<script" not in html and "src=" not in html and "@import" not in html
    assert "<polygon" in html  # the categories' areas
    embedded = _embedded_snapshot(html)
    assert embedded == pickle.loads(pickled.read_bytes())
    assert len(embedded["device_traces"][0]) > 100
    # The figures it states are the run's: the peak the command printed, and the reserve the
    # snapshot's segment events reach.
    import re

    from memfit.units import format_bytes

    printed = re.search(r"peak: (\S+ \S+) of tensors", result.output).group(1)
    assert f"Peak: <b>{printed}</b> of tensors" in html
    reserved = _peaks([(e["action"], e["size"]) for e in embedded["device_traces"][0]])[1]
    assert f"reserves up to <b>{format_bytes(reserved)}</b>" in html


def test_html_to_a_path_that_cannot_be_written_is_one_sentence(tmp_path):
    args = ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16", "--dry-run"]
    missing = tmp_path / "no" / "such" / "t.html"
    result = runner.invoke(app, [*args, "--html", str(missing)])
    assert result.exit_code == 2
    assert f"--html {missing}: the folder {missing.parent} does not exist" in result.output
    assert "Traceback" not in result.output
    folder = runner.invoke(app, [*args, "--html", str(tmp_path)])
    assert folder.exit_code == 2 and "it is a folder; give a file name" in folder.output
    ranks = runner.invoke(app, [*args, "--world-size", "2", "--html", str(tmp_path / "t.html")])
    assert ranks.exit_code == 2 and "--html writes one process's timeline" in ranks.output
    assert not (tmp_path / "t.html").exists()
