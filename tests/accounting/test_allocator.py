"""The caching-allocator model, on hand-built traces whose reserved bytes are derived here."""

from __future__ import annotations

import random
import time

import pytest
import torch

from memfit.accounting.allocator import (
    AllocatorConfig,
    CachingAllocatorModel,
    replay,
    replay_records,
    round_size,
    segment_size,
)

KiB, MiB = 1024, 1024 * 1024
EXPANDABLE = AllocatorConfig(expandable_segments=True)


@pytest.mark.parametrize(
    ("request_bytes", "rounded", "segment"),
    [
        (1, 512, 2 * MiB),  # below kMinBlockSize: one 512-byte block, small pool
        (512, 512, 2 * MiB),
        (513, 1024, 2 * MiB),  # rounded up to the next 512
        (1 * MiB, 1 * MiB, 2 * MiB),  # exactly kSmallSize: still the small pool
        (1 * MiB + 1, 1 * MiB + 512, 20 * MiB),  # large pool, below 10 MiB: a 20 MiB segment
        (10 * MiB - 600, 10 * MiB - 512, 20 * MiB),
        (10 * MiB - 1, 10 * MiB, 10 * MiB),  # rounds to 10 MiB: no longer below kMinLargeAlloc
        (10 * MiB + 1, 10 * MiB + 512, 12 * MiB),  # rounded up to a multiple of 2 MiB
        (21 * MiB, 21 * MiB, 22 * MiB),
    ],
)
def test_rounding_and_pool_boundaries(request_bytes, rounded, segment):
    assert round_size(request_bytes) == rounded
    assert segment_size(rounded) == segment
    model = CachingAllocatorModel()
    model.malloc(0, request_bytes)
    assert model.reserved_bytes == segment
    assert model.num_segments == 1


def test_small_pool_blocks_share_a_segment_and_split_at_512_bytes():
    model = CachingAllocatorModel()
    for key in range(4):
        model.malloc(key, 300 * KiB)  # 4 x 300 KiB = 1200 KiB fit one 2 MiB segment
    assert model.reserved_bytes == 2 * MiB and model.num_segments == 1
    assert model.allocated_bytes == 4 * 300 * KiB
    model.malloc(4, 900 * KiB)  # 848 KiB are left: a second small segment
    assert model.reserved_bytes == 4 * MiB


def test_large_blocks_are_not_split_when_at_most_1_mib_remains():
    model = CachingAllocatorModel()
    model.malloc(0, 19 * MiB + 512)  # 20 MiB segment, 511.5 KiB left: not split
    assert model.allocated_bytes == 20 * MiB  # the whole block counts as allocated
    model.free(0)
    model.malloc(1, 18 * MiB)  # 2 MiB left (> 1 MiB): split
    assert model.allocated_bytes == 18 * MiB and model.reserved_bytes == 20 * MiB


def test_freed_blocks_are_cached_reused_and_merged():
    model = CachingAllocatorModel()
    model.malloc(0, 6 * MiB)  # segment of 20 MiB: [A 6][free 14]
    model.malloc(1, 6 * MiB)  # [A 6][B 6][free 8]
    model.free(0)  # [free 6][B 6][free 8]
    model.malloc(2, 5 * MiB)  # best fit: the 6 MiB hole (not split: 1 MiB remains)
    assert model.allocated_bytes == 12 * MiB and model.reserved_bytes == 20 * MiB
    model.free(2)
    model.free(1)  # all three merge back into one free 20 MiB block
    model.malloc(3, 19 * MiB)
    assert model.reserved_bytes == 20 * MiB and model.num_segments == 1


# Growing requests, each freed before the next (sequence lengths growing through a run): the
# cached blocks are each too small for the next request.
GROWING = [(0, 12 * MiB), (0, None), (1, 14 * MiB), (1, None), (2, 16 * MiB), (2, None),
           (3, 18 * MiB), (3, None)]  # fmt: skip


def test_fragmentation_makes_reserved_exceed_allocated():
    result = replay(GROWING)
    # Each request is >= 10 MiB, so it gets a segment of exactly its size, and no cached
    # segment is large enough for the next: 12 + 14 + 16 + 18 = 60 MiB reserved.
    assert result.peak_reserved_bytes == 60 * MiB
    assert result.peak_allocated_bytes == 18 * MiB
    assert result.peak_reserved_bytes > 1.2 * result.peak_allocated_bytes


def test_expandable_segments_remove_that_fragmentation():
    result = replay(GROWING, EXPANDABLE)
    # One segment mapped in 20 MiB pages: 12 MiB maps one page; freed, the 20 MiB free block
    # serves 14, 16 and 18 MiB in turn. Reserved stays at one page.
    assert result.peak_reserved_bytes == 20 * MiB
    assert result.peak_allocated_bytes == 18 * MiB
    assert result.expandable_segments


def test_expandable_segment_grows_its_free_tail():
    model = CachingAllocatorModel(EXPANDABLE)
    model.malloc(0, 15 * MiB)  # one 20 MiB page: [A 15][free 5]
    model.malloc(1, 12 * MiB)  # the 5 MiB tail grows by one page: [A 15][B 12][free 13]
    assert model.reserved_bytes == 40 * MiB and model.num_segments == 1
    model.malloc(2, 13 * MiB)  # exactly the tail
    assert model.reserved_bytes == 40 * MiB and model.allocated_bytes == 40 * MiB


def test_capacity_releases_cached_segments_then_fails():
    model = CachingAllocatorModel(AllocatorConfig(capacity_bytes=40 * MiB))
    model.malloc(0, 12 * MiB)
    model.free(0)  # cached: 12 MiB reserved, nothing allocated
    model.malloc(1, 28 * MiB)  # 12 + 28 = 40 MiB: fits without releasing
    assert model.reserved_bytes == 40 * MiB
    model.free(1)
    model.malloc(2, 30 * MiB)  # 40 + 30 > 40: both cached segments released, then 30 MiB
    assert model.reserved_bytes == 30 * MiB and model.num_segments == 1
    with pytest.raises(torch.OutOfMemoryError, match="capacity"):
        model.malloc(3, 12 * MiB)  # 30 MiB live + 12 MiB > 40 MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    config = AllocatorConfig(max_split_size=16 * MiB)
    model = CachingAllocatorModel(config)
    model.malloc(0, 30 * MiB)
    model.free(0)
    model.malloc(1, 4 * MiB)  # below max_split_size: not served from the 30 MiB block
    assert model.reserved_bytes == 50 * MiB
    unlimited = CachingAllocatorModel()
    unlimited.malloc(0, 30 * MiB)
    unlimited.free(0)
    unlimited.malloc(1, 4 * MiB)  # split from the cached block
    assert unlimited.reserved_bytes == 30 * MiB


def test_zero_byte_allocations_take_nothing():
    model = CachingAllocatorModel()
    model.malloc(0, 0)
    model.free(0)
    assert model.reserved_bytes == 0 and model.peak_allocated_bytes == 0


def test_replay_records_in_the_trackers_format():
    # Three records on one event counter: A (3 MiB) born at 1, dies at 4; B (5 MiB) born at
    # 2, dies at 3; C (4 MiB) born at 5, alive at the end; D on the host tier is ignored.
    nbytes = [3 * MiB, 5 * MiB, 4 * MiB, 64 * MiB]
    birth = [1, 2, 5, 6]
    death = [4, 3, -1, -1]
    tier = [0, 0, 0, 1]
    result = replay_records(nbytes, birth, death, tier)
    # A and B share one 20 MiB segment (8 MiB allocated at once); C reuses the freed space.
    assert result.peak_requested_bytes == 8 * MiB
    assert result.peak_allocated_bytes == 8 * MiB
    assert result.peak_reserved_bytes == 20 * MiB


def test_a_real_tracker_trace_replays():
    import memfit

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    with memfit.track(model) as tracker:
        model(torch.randn(64, 256)).sum().backward()
    trace = tracker.trace()
    result = replay_records(trace.nbytes, trace.birth, trace.death, trace.tier)
    report = tracker.report()
    # Rounding only adds: the allocator's peak is at least the tensors' peak and at most
    # 511 bytes more per live block.
    assert report.peak_bytes <= result.peak_allocated_bytes
    assert result.peak_allocated_bytes <= report.peak_bytes + 511 * len(trace.nbytes)
    assert result.peak_reserved_bytes >= result.peak_allocated_bytes


def test_replay_is_fast():
    rng = random.Random(0)
    events, live = [], []
    for key in range(100_000):
        events.append((key, rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1, 64 << 20)])))
        live.append(key)
        if len(live) > 200:
            events.append((live.pop(rng.randrange(len(live))), None))
    start = time.perf_counter()
    result = replay(events)
    elapsed = time.perf_counter() - start
    assert result.peak_reserved_bytes >= result.peak_allocated_bytes
    assert elapsed < 10  # about a second here for 200,000 events
