"""Dominance pruning ranks options by what they keep, not by their place in a list."""

from __future__ import annotations

from memfit.plan import Plan
from memfit.planner.search import _dominated, _space
from memfit.targets import DEVICES
from memfit.workload import load_workload

WORKLOAD = load_workload("gpt2-tiny", 4, 16)
FORBID = ("accumulation", "checkpointing", "fused-step", "foreach-off", "mixed-precision")


def _ranks(base, allow):
    return {
        (p.precision.mode, p.optimizer.name): rank
        for p, rank in _space(WORKLOAD, base, allow, FORBID, DEVICES["h100"])
    }


def test_adafactor_ranks_leaner_than_8bit_adamw_whichever_is_the_base():
    # With Adafactor as the base and --allow 8bit, the 8-bit AdamW came second in the list and
    # ranked as the leaner one: a plan with Adafactor could be pruned as dominated by a
    # misfitting 8-bit plan.
    ranks = _ranks(Plan(optimizer="adafactor"), ["8bit"])
    factored, eight_bit = ranks[("fp32", "adafactor")], ranks[("fp32", "adamw8bit")]
    assert factored[3] > eight_bit[3]
    assert not _dominated(factored, [eight_bit])  # a misfitting 8-bit plan prunes nothing leaner
    assert _dominated(eight_bit, [factored])


def test_bf16_pure_ranks_leaner_than_mixed_precision_when_it_is_the_base():
    base = Plan(precision="bf16-pure")
    ranks = {
        p.precision.mode: rank
        for p, rank in _space(WORKLOAD, base, (), FORBID[:-1], DEVICES["h100"])
        if p.optimizer.name == "adamw"
    }
    assert ranks["bf16-pure"][2] > ranks["bf16-mixed"][2]
    assert not _dominated(ranks["bf16-pure"], [ranks["bf16-mixed"]])
