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
