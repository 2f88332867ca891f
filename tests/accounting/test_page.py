"""``memfit profile --html``'s page: self-contained, and a browser with no network draws the
timeline (a headless Chromium's screenshot, read pixel by pixel)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from memfit.accounting.page import timeline_page
from memfit.accounting.report import _COLORS
from memfit.accounting.snapshot import memory_snapshot
from memfit.cli import app

runner = CliRunner()


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


def _screenshot(page, shot, profile) -> np.ndarray:
    """The page as headless Chromium draws it with no network at all: every host name fails
    to resolve, as on a machine offline."""
    import matplotlib.image

    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); .ci/run "
                    "installs it")
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1200,800",
         page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )
    return matplotlib.image.imread(str(shot))[..., :3]


def _share_of(img: np.ndarray, hex_color: str) -> float:
    """The share of the screenshot's pixels within a few levels of ``hex_color`` (drawn at
    90% opacity over a pale phase band: allow for the blend)."""
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return float((np.abs(img - rgb).max(axis=2) < 0.08).mean())


@pytest.mark.subprocess
def test_an_offline_browser_draws_the_timeline(tmp_path):
    page = tmp_path / "r.html"
    result = runner.invoke(app, ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16",
                                 "--steps", "2", "--dry-run", "--html", str(page)])
    assert result.exit_code == 0, result.output
    img = _screenshot(page, tmp_path / "shot.png", tmp_path / "profile")
    assert (img < 0.98).any(), "the page is blank: every pixel is white"
    # The timeline itself, not only text: the parameters' band and the optimizer state's
    # band each cover a visible share of the window.
    assert _share_of(img, _COLORS["parameters"]) > 0.01
    assert _share_of(img, _COLORS["optimizer_state"]) > 0.005


def test_the_page_loads_nothing_and_states_the_runs_figures():
    import memfit

    workload = memfit.load_workload("gpt2-tiny", 2, 16)
    report = memfit.measure(workload, memfit.Plan(), steps=2, dry=True, device="h100")
    trace = report.trace
    snapshot = memory_snapshot(trace)
    html = timeline_page(trace, snapshot, title="a <run>")
    assert "<script" not in html and not re.search(r"\b(src|href)=\"(https?:)?//", html)
    assert "<title>a &lt;run&gt;</title>" in html
    from memfit.units import format_bytes

    assert f"Peak: <b>{format_bytes(report.peak_bytes)}</b>" in html
    for category, nbytes in report.peak_by_category.items():
        if nbytes:
            assert f"<td>{category}</td><td>{format_bytes(nbytes)}</td>" in html
