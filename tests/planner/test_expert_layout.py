"""The 3-D planner and expert parallelism: a mixture-of-experts model's layouts split its
experts, priced by the layout model (states divided, all-to-all time added)."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.distributed.config import ParallelConfig
from memfit.estimate.layout_cost import estimate_layout, layout_problems, model_shape
from memfit.planner.layout import plan_layout
from memfit.targets import get_device
from memfit.workload import load_workload

SPEC, WORLD, NODE, BATCH, SEQ = "mixtral-8x7b", 16, 8, 8, 128


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_workload(SPEC, BATCH, SEQ))


def _price(shape, parallel):
    return estimate_layout(shape, parallel, batch_size=BATCH, seq_len=SEQ, checkpointing=False,
                           device=get_device("h100"), precision="bf16-mixed",
                           optimizer="adamw", gpus_per_node=NODE)


def test_mixtral_shape_knows_its_experts(shape):
    assert (shape.experts, shape.top_k) == (8, 2)
    # 8 experts of three 4096 x 14336 matrices per block: 1.41e9 elements.
    assert shape.expert_block_params == 8 * 3 * 4096 * 14336


def test_expert_split_divides_the_experts_states_and_adds_all_to_alls(shape):
    """Splitting the experts over 8 ranks removes 7/8 of each block's expert parameters,
    gradients and AdamW state (4 + 4 + 8 bytes each) from a rank, and adds the all-to-all
    term to the step."""
    whole = ParallelConfig(data=8, pipeline=2, microbatches=1, schedule="gpipe")
    split = dataclasses.replace(whole, expert=8)
    a, b = _price(shape, whole), _price(shape, split)
    blocks = shape.layers // 2
    gone = blocks * shape.expert_block_params * 7 / 8
    for cat, per in (("parameters", 4), ("gradients", 4), ("optimizer_state", 8)):
        assert a.stages[0][cat] - b.stages[0][cat] == pytest.approx(per * gone, rel=1e-6), cat
    assert a.parts["expert"] == 0 < b.parts["expert"]


def test_layout_problems_name_what_expert_parallelism_cannot_do(shape):
    def first(**kw):
        return layout_problems(shape, ParallelConfig(**kw), BATCH, NODE)

    assert first(data=8, expert=8) == []
    assert "divide the 8 experts" in first(data=6, expert=3)[0]
    assert any("tensor" in p for p in first(data=4, tensor=2, expert=2))
    assert any("zero_stage 0 only" in p for p in first(data=4, pipeline=2, expert=2,
                                                        zero_stage=2))


def test_mixtral_8x7b_on_16_h100s_splits_its_experts():
    """`memfit plan --model mixtral-8x7b --world-size 16 --gpus-per-node 8 --budget h100`:
    the chosen plan splits the experts, and every rank fits the H100."""
    result = plan_layout(SPEC, "h100", WORLD, NODE, confirm=False)
    assert result.fits and result.plan.parallel.expert > 1
    assert result.plan.parallel.world_size == WORLD
    assert max(result.rank_peak_bytes) <= result.budget_bytes
    assert result.plan.to_dict()["parallel"]["expert"] == result.plan.parallel.expert
    assert "experts split over" in result.plan.summary()


def test_expert_load_raises_the_ranks_holding_expert_0(shape):
    """Under expert_load 4 the first rank of each expert group (it holds expert 0) receives
    3 x expert 0's share of every group member's tokens more and its peak grows; the other
    ranks keep the balanced figure."""
    par = ParallelConfig(data=8, pipeline=2, microbatches=1, schedule="gpipe", expert=4)
    even = _price(shape, par)
    kw = dict(batch_size=BATCH, seq_len=SEQ, checkpointing=False, device=get_device("h100"),
              precision="bf16-mixed", optimizer="adamw", gpus_per_node=NODE)
    loaded = estimate_layout(shape, par, expert_load=4, **kw)
    for rank, (a, b) in enumerate(zip(even.rank_peak_bytes, loaded.rank_peak_bytes,
                                      strict=True)):
        holds_expert_0 = par.coordinates(rank)["replica"] % par.expert == 0
        assert (b > a) if holds_expert_0 else (b == a), rank
    assert estimate_layout(shape, par, expert_load=1, **kw).rank_peak_bytes == \
        even.rank_peak_bytes


def test_expert_load_is_refused_without_the_layout_planner():
    from memfit.planner.entry import plan

    with pytest.raises(ValueError, match="--expert-load is priced by the layout planner"):
        plan(SPEC, "h100", world_size=8, expert_load=2, batch_size=8, seq_len=128)
    with pytest.raises(ValueError, match="--expert-load must be a number >= 1"):
        plan_layout(SPEC, "h100", WORLD, NODE, confirm=False, expert_load=0.5)
