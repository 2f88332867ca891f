"""The report's exports: dict/JSON keys, the terminal table and the PNG plot."""

from __future__ import annotations

import json

import torch
from rich.console import Console

import memfit
from memfit.accounting import CATEGORIES
from tests.models import mlp


def _report():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16)
    with memfit.track(model, opt) as tr:
        tr.add_inputs(x)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tr.report()


def test_to_dict_and_json(tmp_path):
    rep = _report()
    rep.meta["num_parameters"] = 3
    path = tmp_path / "r.json"
    rep.to_json(path)
    data = json.loads(path.read_text())
    assert data["peak_bytes"] == rep.peak_bytes
    assert list(data["peak_by_category"]) == list(CATEGORIES)
    assert sum(data["peak_by_category"].values()) == data["peak_bytes"]
    assert set(data["phase_peaks"]) == {"forward", "backward", "optimizer"}
    assert data["num_parameters"] == 3
    assert data["by_module"]["0"]["peak"] > 0
    assert set(data["timeline"]) == {"op_index", "phase", *CATEGORIES}


def test_timeline_downsampling_keeps_the_peak():
    rep = _report()
    small = rep.to_dict(max_points=10)["timeline"]
    assert len(small["op_index"]) <= 10
    totals = [sum(small[c][i] for c in CATEGORIES) for i in range(len(small["op_index"]))]
    assert max(totals) == rep.peak_bytes


def test_table_renders():
    rep = _report()
    console = Console(record=True, width=120)
    console.print(rep.table())
    text = console.export_text()
    for name in CATEGORIES:
        assert name in text
    assert ("optimizer" in text and "MiB" in text) or "KiB" in text


def test_plot_writes_png(tmp_path):
    rep = _report()
    path = tmp_path / "m.png"
    rep.plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def _spike_report(ops: int, spike_at: int):
    """A report of ``ops`` operations holding 1 GiB of activations, with 3 GiB more during the
    one operation ``spike_at`` (the loss's logits of a large dry run)."""
    from memfit.accounting.report import MemoryReport

    gib = 1 << 30
    acts = [gib] * ops
    acts[spike_at] = 4 * gib
    timeline = {"op_index": list(range(ops)), "phase": ["forward"] * ops}
    for c in CATEGORIES:
        timeline[c] = acts if c == "activations" else [0] * ops
    at_peak = {c: 4 * gib if c == "activations" else 0 for c in CATEGORIES}
    return MemoryReport(
        peak_bytes=4 * gib, peak_by_category=at_peak, phase_peaks={}, by_module={},
        timeline=timeline, peak_op="aten.spike", peak_op_index=spike_at, peak_module=None,
        peak_phase="forward",
    )


def test_window_max_keeps_each_windows_highest_point():
    from memfit.accounting.report import window_max

    rep = _spike_report(100_000, 54_321)
    small = window_max(rep.timeline, 600)
    assert len(small["op_index"]) <= 601
    assert max(small["activations"]) == rep.peak_bytes
    # The windows tile the operations: equal widths, the last point at the last operation.
    widths = {b - a for a, b in zip(small["op_index"][:-2], small["op_index"][1:-1], strict=True)}
    assert max(widths) - min(widths) <= 1
    assert small["op_index"][-1] == 99_999


def test_plot_reaches_its_peak_line(tmp_path):
    # A spike one operation wide among 100k: the drawn area must reach the dashed peak line
    # (it used to stop 3 GiB below it, the spike thinner than a pixel).
    import matplotlib.image

    path = tmp_path / "spike.png"
    _spike_report(100_000, 54_321).plot(path)
    img = matplotlib.image.imread(str(path))[..., :3]
    dark = (img < 0.25).all(axis=2).sum(axis=1)
    # The axes' top and bottom edges are the two most solid dark rows; the peak line lies at
    # 1/1.15 of the height between them (the y axis ends 15% above the peak).
    top, bottom = sorted(int(i) for i in dark.argsort()[-2:])
    line_row = bottom - (bottom - top) / 1.15
    assert dark[round(line_row) - 1 : round(line_row) + 2].max() > 0.2 * dark[bottom]  # dashed
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    green = (g > r + 0.1) & (g > b + 0.1)  # the activations' colour, not the pale shading
    top_green = int(green.any(axis=1).argmax())
    assert abs(top_green - line_row) <= 3, (top_green, line_row)
