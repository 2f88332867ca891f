"""``memfit.track()`` with no arguments works on modules (it used to crash at the first
module forward: AttributeError '_forward_start_seq')."""

from __future__ import annotations

import torch
from torch import nn

import memfit


def test_track_without_arguments_on_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with memfit.track() as tracker:
        model(x).sum().backward()
    report = tracker.report()
    # Without a model the tracker knows no parameters (they are met as pre-existing tensors,
    # "other"); the input of the outermost module is an input, and what backward needs is
    # activations.
    assert report.peak_by_category["parameters"] == 0
    assert report.peak_by_category["inputs"] == x.numel() * 4
    assert report.peak_by_category["activations"] > 0
    assert report.phase_peaks["forward"] > 0 and report.phase_peaks["backward"] > 0
    assert "Sequential" in report.by_module
    assert sum(report.peak_by_category.values()) == report.peak_bytes


def test_track_with_a_model_names_its_modules():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with memfit.track(model) as tracker:
        model(torch.randn(8, 16)).sum().backward()
    report = tracker.report()
    assert report.peak_by_category["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert {"0", "1", "2"} <= set(report.by_module)
