"""Memory tiers: device, host (pinned apart) and disk, each with its peak and categories."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.accounting.report import build_report
from memfit.accounting.tiers import DEVICE, HOST, HOST_PINNED, host_tier, in_host_tier
from memfit.accounting.trace import CATEGORIES, AllocationTrace


def test_host_tier_storages_are_not_device_memory():
    model = torch.nn.Linear(16, 16, bias=False)  # 1 KiB of parameters
    with memfit.track(model) as tracker:
        with host_tier():
            assert in_host_tier()
            pool = torch.empty(1000)  # 4000 bytes of host memory
        tracker.label(pool, "optimizer_state")
        device = torch.empty(256)  # 1 KiB on the device
        del pool, device
    assert not in_host_tier()
    report = tracker.report()
    assert report.peak_by_tier == {"device": 1024 + 1024, "host": 4000, "disk": 0}
    assert report.peak_bytes == report.peak_by_tier["device"]
    assert report.peak_by_tier_category["host"]["optimizer_state"] == 4000
    assert report.peak_by_category["optimizer_state"] == 0
    assert report.host_pinned_peak_bytes == 0
    data = report.to_dict()
    assert data["peak_by_tier"] == report.peak_by_tier


def test_disk_bytes_are_accounted_by_the_technique_that_writes_them():
    with memfit.track() as tracker:
        tracker.account_disk(8192, "optimizer_state")
        tracker.account_disk(4096, "parameters")
        tracker.account_disk(-8192, "optimizer_state")
    report = tracker.report()
    assert report.peak_by_tier["disk"] == 12288
    assert report.peak_by_tier_category["disk"]["optimizer_state"] == 8192
    assert report.peak_by_tier_category["disk"]["parameters"] == 4096
    with pytest.raises(ValueError, match="category 'weights' is not known"):
        tracker.account_disk(1, "weights")


def test_pinned_host_memory_is_reported_apart():
    other = CATEGORIES.index("other")
    # Three storages: device 100 bytes, pageable host 50, pinned host 30 (alive together).
    trace = AllocationTrace(
        nbytes=(100, 50, 30),
        birth=(1, 2, 3),
        death=(-1, 5, 4),
        tier=(DEVICE, HOST, HOST_PINNED),
        category=(other, other, other),
        num_events=5,
        op_end_event=(0, 5),
        op_phase=(3, 3),
        peak_bytes=100,
        peak_event=1,
    )
    report = build_report(trace)
    assert report.peak_by_tier == {"device": 100, "host": 80, "disk": 0}
    assert report.host_pinned_peak_bytes == 30


def test_the_table_shows_the_host_tier():
    from rich.console import Console

    with memfit.track() as tracker, host_tier():
        kept = torch.empty(512)
    del kept
    console = Console(width=120, record=True)
    console.print(tracker.report().table())
    text = console.export_text()
    assert "host (its peak)" in text and "2.00 KiB" in text
