"""The planners fit each rank's device total with its NCCL communicators
(:mod:`memfit.estimate.nccl`) beside the CUDA context."""

from __future__ import annotations

import pytest

from memfit.distributed.config import ParallelConfig
from memfit.estimate.layout_cost import estimate_layout, model_shape
from memfit.estimate.nccl import NcclSettings, nccl_bytes, nccl_rank_bytes
from memfit.estimate.predictor import ALLOCATED_SHARE, layout_prediction
from memfit.plan import Plan
from memfit.planner.layout import plan_layout
from memfit.planner.parallel import _stage_results
from memfit.planner.result import NothingFits
from memfit.targets import get_device
from memfit.units import MiB
from memfit.workload import load_workload

H100 = get_device("h100")
DEEP = load_workload("llama-tiny", 8, 32).with_depth(4)


@pytest.fixture(autouse=True)
def _nccl_defaults(monkeypatch):
    for name in ("NCCL_BUFFSIZE", "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_MAX_NCHANNELS",
                 "NCCL_MIN_NCHANNELS"):
        monkeypatch.delenv(name, raising=False)


def test_a_layouts_device_total_is_its_worst_ranks_reserve_and_communicators():
    par = ParallelConfig(data=2, tensor=2, pipeline=2, microbatches=4)
    cand = estimate_layout(model_shape(DEEP), par, batch_size=8, seq_len=32, checkpointing=False,
                           device=H100, precision="bf16-mixed", optimizer="adamw",
                           gpus_per_node=8)
    pred = layout_prediction(cand, H100, 8)
    nccl = nccl_rank_bytes(par, H100)
    assert pred.extra["nccl_bytes"] == nccl and min(nccl) > 0
    share = round(ALLOCATED_SHARE * 100)
    worst = max(-(-p * 100 // share) + n for p, n in zip(cand.rank_peak_bytes, nccl, strict=True))
    assert pred.device_total_bytes == worst + H100.overhead_bytes
    # The CPU holds no communicators.
    assert layout_prediction(cand, "cpu").device_total_bytes == max(cand.rank_peak_bytes)


def test_the_3d_planner_refuses_a_budget_only_the_communicators_pass(monkeypatch):
    budget = H100.overhead_bytes + 100 * MiB
    with pytest.raises(NothingFits) as caught:
        plan_layout(DEEP, budget, 4, 4, device="h100", confirm=False)
    # The tensors and their allocator reserve alone would fit with room to spare: NCCL's
    # buffers (hundreds of MiB on every rank) are what does not.
    closest = caught.value.result.layout_candidate
    assert max(closest.rank_peak_bytes) / ALLOCATED_SHARE < 50 * MiB
    assert min(nccl_rank_bytes(closest.parallel, H100, gpus_per_node=4)) > 100 * MiB
    # With a budget that holds them, every rank's share is in the answer.
    result = plan_layout(DEEP, H100.overhead_bytes + 4096 * MiB, 4, 4, device="h100",
                         confirm=False)
    assert result.fits
    assert result.layout["nccl_bytes"] == nccl_rank_bytes(result.plan.parallel, H100,
                                                          gpus_per_node=4)


def test_the_data_parallel_search_plans_for_a_rank_with_its_communicators():
    seen = []

    def search(local, budget, *, base, device):
        seen.append((base.parallel.zero_stage, device))
        raise AssertionError("stop")  # only the device the stage is searched on matters

    with pytest.raises(AssertionError, match="stop"):
        _stage_results(DEEP, "h100", Plan(), 4, (0,), search, lambda msg: None, H100)
    (stage, device), = seen
    expected = nccl_bytes(ParallelConfig(data=4), 0, H100, settings=NcclSettings())
    assert stage == 0 and device.nccl_bytes == expected > 0
    assert device.budget_bytes == H100.budget_bytes - expected
