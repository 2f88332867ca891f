"""The dry run's timeline as PyTorch's memory snapshot: the structure its viewer reads, and
the same peaks as the allocator model."""

from __future__ import annotations

import pickle

import pytest
import torch.cuda._memory_viz as memory_viz

import memfit
from memfit.accounting.allocator import AllocatorConfig, replay_records
from memfit.accounting.snapshot import memory_snapshot, write_snapshot


@pytest.fixture(scope="module")
def trace():
    workload = memfit.load_workload("gpt2-tiny", 4, 32)
    report = memfit.measure(workload, memfit.Plan(), steps=2, dry=True, device="h100")
    assert report.trace is not None
    return report.trace


def _replayed_peaks(snapshot):
    """Peak allocated and reserved bytes read back from the snapshot's own events."""
    allocated = reserved = peak_allocated = peak_reserved = 0
    for event in snapshot["device_traces"][0]:
        action, size = event["action"], event["size"]
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        peak_allocated = max(peak_allocated, allocated)
        peak_reserved = max(peak_reserved, reserved)
    return peak_allocated, peak_reserved, allocated, reserved


@pytest.mark.parametrize("expandable", [False, True])
def test_the_snapshot_replays_the_allocator_models_peaks(trace, expandable):
    config = AllocatorConfig(expandable_segments=expandable)
    snapshot = memory_snapshot(trace, config)
    model = replay_records(trace.nbytes, trace.birth, trace.death, trace.tier, config=config)
    peak_allocated, peak_reserved, allocated, reserved = _replayed_peaks(snapshot)
    assert peak_allocated == model.peak_allocated_bytes
    assert peak_reserved == model.peak_reserved_bytes
    # The segments at the end hold what the events left reserved and allocated.
    segments = snapshot["segments"]
    assert sum(s["total_size"] for s in segments) == reserved
    assert sum(s["allocated_size"] for s in segments) == allocated
    assert len(segments) == model.num_segments
    for segment in segments:
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
        assert segment["is_expandable"] is expandable


def test_every_free_follows_its_alloc_at_the_same_address(trace):
    live = {}
    for event in memory_snapshot(trace)["device_traces"][0]:
        if event["action"] == "alloc":
            assert event["addr"] not in live
            live[event["addr"]] = event["size"]
        elif event["action"] == "free_completed":
            assert live.pop(event["addr"]) == event["size"]


def test_frames_name_the_module_phase_and_category(trace):
    frames = {
        (f["filename"], f["name"])
        for e in memory_snapshot(trace)["device_traces"][0]
        for f in e["frames"]
    }
    assert any(".h.0." in name and phase.startswith("forward: activations")
               for name, phase in frames), sorted(frames)[:10]
    assert any(phase == "optimizer: optimizer_state" for _, phase in frames)


def test_pytorchs_viewer_reads_it(trace, tmp_path):
    path = tmp_path / "run.pickle"
    write_snapshot(trace, path)
    snapshot = pickle.loads(path.read_bytes())
    assert set(snapshot) >= {"segments", "device_traces"}
    # PyTorch's own readers of the format: the text summaries and the HTML pages.
    assert "segment" in memory_viz.segsum(snapshot).lower()
    assert memory_viz.trace(snapshot)
    for html in (memory_viz.segment_plot(snapshot), memory_viz.trace_plot(snapshot)):
        assert "snapshot.pickle" in html
