"""The tracker emits a frozen trace; the report is built from it alone."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn

import memfit
from memfit.accounting.report import build_report


def test_report_is_built_from_the_trace_alone():
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    with memfit.track(model) as tracker:
        model(torch.randn(8, 16)).sum().backward()
    expected = tracker.report()
    trace = tracker.trace()
    del tracker
    gc.collect()  # the tracker is gone: nothing but the trace is read
    report = build_report(trace)
    assert report.peak_bytes == expected.peak_bytes == trace.peak_bytes
    assert report.peak_by_category == expected.peak_by_category
    assert report.by_module == expected.by_module
    assert report.timeline == expected.timeline
    with pytest.raises(dataclasses.FrozenInstanceError):
        trace.peak_bytes = 0  # type: ignore[misc]
    # Module intervals and phases travel with the trace.
    assert {name for name, *_ in trace.module_intervals} >= {"", "0", "1", "2"}
    assert len(trace.op_end_event) == len(trace.op_phase) == report.num_ops + 1
