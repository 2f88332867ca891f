"""The planner over several processes: the ZeRO stage chosen for a per-process budget, every
rank predicted, without launching anything."""

from __future__ import annotations

import pytest

from memfit import Plan
from memfit.estimate.distributed import predict_ranks
from memfit.planner import NothingFits, plan

SPEC = "tests.models:stack_workload"
FORBID = ["accumulation", "checkpointing", "mixed-precision", "fused-step", "foreach-off", "fused-loss"]


def _peak(stage: int) -> int:
    pred = predict_ranks(SPEC, Plan(parallel={"data": 2, "zero_stage": stage}), batch_size=8, seq_len=256)
    return pred.max_peak_bytes


def test_the_lowest_stage_that_fits_is_chosen_and_every_rank_predicted():
    peaks = {s: _peak(s) for s in range(4)}
    assert peaks[3] < peaks[2] < peaks[1] < peaks[0]  # each stage shards more
    for stage in range(4):
        budget = peaks[stage] + 1024
        result = plan(SPEC, budget, world_size=2, batch_size=8, seq_len=256, forbid=FORBID)
        assert result.fits and result.plan.parallel.data == 2
        assert result.plan.parallel.zero_stage == stage
        data = result.to_dict()
        assert len(data["predicted_peak_bytes"]) == 2 == len(data["predicted_rank_peak_bytes"])
        assert max(data["predicted_peak_bytes"]) <= budget
        assert data["ranks"][1]["predicted_peak_bytes"] == data["predicted_peak_bytes"][1]


def test_nothing_fits_names_the_world_size():
    with pytest.raises(NothingFits, match="on 2 processes at any ZeRO stage"):
        plan(SPEC, 100_000, world_size=2, batch_size=8, seq_len=256, forbid=FORBID)


def test_a_world_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="multiple of 3"):
        plan(SPEC, "1GiB", world_size=3, batch_size=8, seq_len=256)
