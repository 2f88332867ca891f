"""The one predictor interface (memfit.estimate.predictor): each implementation answers with
the figures of the estimator it wraps, in one Prediction."""

from __future__ import annotations

import pytest

import memfit
from memfit.distributed.config import ParallelConfig
from memfit.estimate.compose import predict_peak
from memfit.estimate.distributed import predict_ranks
from memfit.estimate.layout import predict_layout
from memfit.estimate.layout_cost import estimate_layout, model_shape
from memfit.estimate.predictor import (
    Composed,
    DryRun,
    Layout,
    LayoutModel,
    Measured,
    Predictor,
    Ranks,
)
from memfit.plan import Plan
from memfit.targets import get_device
from memfit.workload import load_workload

GPT2 = load_workload("gpt2-tiny", 4, 32)
LLAMA = load_workload("llama-tiny", 4, 16)


@pytest.mark.parametrize("predictor", [DryRun(), Composed(), Ranks(), Layout(), LayoutModel(), Measured()])
def test_every_predictor_is_a_predictor(predictor):
    assert isinstance(predictor, Predictor)


def test_dry_run_and_composed_are_predict_peak():
    plan = Plan(micro_batch_size=2, grad_accum_steps=2)
    full = DryRun().predict(GPT2, plan, "cpu")
    assert full == predict_peak(GPT2, plan, compose=False, device="cpu")
    assert full.ranks == [full.peak_bytes] and full.method == "dry-run"
    deep = GPT2.with_depth(6)
    composed = Composed().predict(deep, plan, "cpu")
    want = predict_peak(deep, plan, device="cpu")
    assert (composed.peak_bytes, composed.by_category) == (want.peak_bytes, want.by_category)
    assert composed.method == "composed"


@pytest.mark.parametrize("device", ["cpu", "a100"])
def test_measured_is_measure_with_its_report(device):
    # The workload's own steps, its whole batch: the prediction's figures are the report's.
    plan = Plan(micro_batch_size=2)
    steps = []
    pred = Measured(steps=1, progress=lambda done, total: steps.append((done, total))).predict(
        GPT2, plan, device
    )
    want = memfit.dry_run(GPT2, plan, steps=1, device=device)
    report = pred.report
    assert report is not None and steps == [(1, 1)]
    assert report.peak_bytes == want.peak_bytes == pred.peak_bytes
    assert pred.by_category == want.peak_by_category and pred.peak_phase == want.peak_phase
    assert pred.reserved_bytes == (want.peak_reserved_bytes or want.peak_bytes)
    assert pred.device_total_bytes == want.device_total_bytes
    assert (pred.method, pred.target_device) == ("measured", want.meta["target_device"])


def test_ranks_are_predict_ranks():
    plan = Plan(parallel={"data": 2, "zero_stage": 2})
    pred = Ranks().predict(GPT2, plan, "cpu")
    want = predict_ranks(GPT2, plan, device="cpu")
    assert pred.ranks == want.peak_bytes and len(pred.ranks) == 2
    assert pred.peak_bytes == want.max_peak_bytes
    assert sum(pred.by_category.values()) == pred.peak_bytes


def test_layout_is_predict_layout_per_rank():
    par = ParallelConfig(tensor=2, pipeline=2, microbatches=2)
    pred = Layout().predict(LLAMA, Plan(parallel=par), "cpu")
    assert pred.ranks == list(predict_layout(LLAMA, par).peak_bytes) and len(pred.ranks) == 4
    assert sum(pred.by_category.values()) == pred.peak_bytes == max(pred.ranks)


def test_layout_model_is_estimate_layout():
    deep = LLAMA.with_depth(4)
    par = ParallelConfig(data=2, tensor=2, pipeline=2, microbatches=2)
    plan = Plan(parallel=par, precision="bf16-mixed")
    pred = LayoutModel(gpus_per_node=4).predict(deep, plan, "a100")
    cand = estimate_layout(model_shape(deep), par, batch_size=deep.batch_size,
                           seq_len=deep.seq_len, checkpointing=False,
                           device=get_device("a100"), precision="bf16-mixed",
                           optimizer=plan.optimizer, gpus_per_node=4)
    assert pred.ranks == cand.rank_peak_bytes and pred.by_category == cand.by_category
    # The caching allocator is taken to reserve 1/0.95 of the tensors' peak, and each rank
    # holds its NCCL communicators beside the context: the worst rank's sum is the total.
    from memfit.estimate.nccl import nccl_rank_bytes

    nccl = nccl_rank_bytes(par, get_device("a100"), gpus_per_node=4)
    worst = max(-(-p * 100 // 95) + n for p, n in zip(pred.ranks, nccl, strict=True))
    assert min(nccl) > 0
    assert pred.device_total_bytes == worst + get_device("a100").overhead_bytes
