"""Dominance pruning ranks options by what they keep, not by their place in a list.

The unit tests read the rank vectors; the search tests run :func:`memfit.planner.search.search`
on hand-made candidates with a known memory; two planner runs show a fitting plan that list
positions pruned (the 8-bit AdamW ranked leaner than an Adafactor base; bf16 autocast ranked
leaner than fp32 on a workload where its weight copies make it the heavier).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.estimate.compose import predict_peak
from memfit.optim.config import OptimizerConfig
from memfit.plan import Plan
from memfit.planner.candidates import (
    RANK_DIMENSIONS,
    dominated,
    maximal,
    ordinal,
    space_pairs,
    state_bytes_per_parameter,
    trainable_fractions,
)
from memfit.planner.result import Candidate
from memfit.planner.search import plan, search
from memfit.targets import DEVICES
from memfit.workload import load_workload

WORKLOAD = load_workload("gpt2-tiny", 4, 16)
# mixed-precision last: FORBID[:-1] allows it.
FORBID = ("accumulation", "checkpointing", "fused-step", "foreach-off", "fused-loss",
          "mixed-precision")
DIM = {name: i for i, name in enumerate(RANK_DIMENSIONS)}
# The A100's speed (bf16 matmuls 16x faster than fp32) with the CPU's memory: budgets here
# are in tensor bytes.
A100_SPEED = dataclasses.replace(
    DEVICES["a100"], name="a100-speed", kind="cpu", context_bytes=0, workspace_bytes=0
)


def _ranks(base, allow, forbid=FORBID):
    return {
        (p.precision.mode, p.optimizer.name): rank
        for p, rank in space_pairs(WORKLOAD, base, allow, forbid, DEVICES["h100"])
    }


def test_optimizer_state_is_measured_per_parameter():
    def per_param(name, **kwargs):
        return state_bytes_per_parameter(OptimizerConfig(name=name, kwargs=kwargs))

    # Two fp32 moments, plus one 4-byte step counter per tensor (2 tensors, 65,792 elements).
    assert per_param("adamw") == pytest.approx(8 + 2 * 4 / 65_792, rel=1e-9)
    assert per_param("sgd") == 0.0  # no momentum, no state
    assert per_param("sgd", momentum=0.9) == 4.0
    assert 2.0 < per_param("adamw8bit") < 2.1  # int8 moments, block scales, fp32 bias state
    assert per_param("adafactor") < 0.1  # row and column statistics
    with pytest.raises(ValueError, match="cannot be built with the plan's arguments"):
        per_param("adamw", bogus=1)


def test_ordinal_ranks_follow_what_options_keep():
    assert ordinal({"a": 8.0, "b": 2.05, "c": 0.05, "d": 8.0}) == {"a": 0, "b": 1, "c": 2, "d": 0}


def test_adafactor_ranks_leaner_than_8bit_adamw_whichever_is_the_base():
    # With Adafactor as the base and --allow 8bit, the 8-bit AdamW came second in the list and
    # ranked as the leaner one: a plan with Adafactor could be pruned as dominated by a
    # misfitting 8-bit plan.
    for base in (Plan(optimizer="adafactor"), Plan(optimizer="adamw8bit")):
        ranks = _ranks(base, ["8bit", "factored"])
        factored, eight_bit = ranks[("fp32", "adafactor")], ranks[("fp32", "adamw8bit")]
        assert factored[DIM["optimizer_state"]] == 1 and eight_bit[DIM["optimizer_state"]] == 0
        assert not dominated(factored, [eight_bit])  # a misfitting 8-bit plan prunes nothing leaner
        assert dominated(eight_bit, [factored])
    ranks = _ranks(Plan(), ["8bit", "factored"])
    assert [ranks[("fp32", o)][DIM["optimizer_state"]] for o in ("adamw", "adamw8bit", "adafactor")
            ] == [0, 1, 2]


def test_bf16_pure_ranks_leaner_than_mixed_and_fp32_when_it_is_the_base():
    ranks = _ranks(Plan(precision="bf16-pure"), (), FORBID[:-1])
    pure, mixed = ranks[("bf16-pure", "adamw")], ranks[("bf16-mixed", "adamw")]
    assert dominated(mixed, [pure]) and not dominated(pure, [mixed])
    fp32 = _ranks(Plan(), ["bf16-pure"], FORBID[:-1])[("fp32", "adamw")]
    assert dominated(fp32, [pure])


def test_fp32_and_autocast_are_incomparable():
    # Autocast halves the activations but keeps half-precision copies of the weights: which
    # keeps more depends on the workload, so neither prunes the other.
    ranks = _ranks(Plan(), (), FORBID[:-1])
    fp32, mixed = ranks[("fp32", "adamw")], ranks[("bf16-mixed", "adamw")]
    assert not dominated(fp32, [mixed]) and not dominated(mixed, [fp32])


def test_freezing_ranks_by_the_measured_trainable_share():
    # GPT-2 ties its head to the token embeddings: freezing the body keeps them training and
    # freezing the embeddings freezes the head; the measured shares decide, not the names.
    pairs = space_pairs(WORKLOAD, Plan(), ["freeze"], FORBID, DEVICES["h100"])
    ranks = {p.freeze: r[DIM["freezing"]] for p, r in pairs}
    share = trainable_fractions(WORKLOAD, list(ranks))
    assert share[()] == 1.0
    by_share = sorted(ranks, key=lambda f: -share[f])
    assert [ranks[f] for f in by_share] == sorted(ranks.values())
    assert ranks[()] == 0


def test_maximal_keeps_the_candidates_nothing_dominates():
    ranks = [(0, 0), (1, 0), (0, 1), (1, 0), (0, 0)]
    assert maximal(ranks) == [1, 2]  # (1, 0) once, (0, 1); the rest are dominated


def _made(memory):
    """Hand-made candidates, ``(rank, step time, memory)`` each, fastest first, and their
    memory by ``grad_accum_steps`` (``i + 1`` tells candidate ``i`` apart)."""
    candidates = [
        Candidate(plan=Plan(grad_accum_steps=i + 1), rank=r, step_time=t)
        for i, (r, t, _) in enumerate(memory)
    ]
    return candidates, {i + 1: m for i, (_, _, m) in enumerate(memory)}


def _run(memory, budget, max_predictions=60):
    """Search :func:`_made` candidates; returns the winner and the predictions made."""
    candidates, mem = _made(memory)
    calls = []

    def predict(c):
        calls.append(c.plan.grad_accum_steps)
        c.device_total_bytes = mem[c.plan.grad_accum_steps]
        c.fits = c.device_total_bytes <= budget
        return c.fits

    def confirm(c):
        return bool(c.fits)

    winner, _ = search(candidates, predict, confirm, max_predictions=max_predictions)
    return winner, calls


def test_search_prunes_dominated_candidates_and_returns_the_fastest_that_fits():
    memory = [  # (rank, step time, memory), fastest first
        ((0, 0), 1.0, 100),
        ((1, 0), 1.1, 80),
        ((0, 1), 1.2, 60),
        ((1, 1), 1.3, 40),
    ]
    winner, calls = _run(memory, budget=70)
    assert winner is not None and winner.plan.grad_accum_steps == 3
    # (0, 0) misfits; (1, 0) is predicted (it is not below (0, 0)) and misfits; after two
    # misfits in line the seed (1, 1) is predicted, and fits; then (0, 1), which fits.
    assert calls == [1, 2, 4, 3]
    winner, calls = _run(memory, budget=30)
    assert winner is None and calls == [1, 2, 4]  # the only seed misfits too: nothing fits
    # A budget the first in line fits: no seed is predicted.
    winner, calls = _run(memory, budget=100)
    assert winner is not None and winner.plan.grad_accum_steps == 1 and calls == [1]


def _run_with_floors(memory, budget):
    """As :func:`_run`, with a probe whose floor is half the memory; returns the calls made."""
    candidates, mem = _made(memory)
    calls = []

    def predict(c):
        calls.append(("predict", c.plan.grad_accum_steps))
        c.device_total_bytes = mem[c.plan.grad_accum_steps]
        c.fits = c.device_total_bytes <= budget
        return c.fits

    def probe(c):
        calls.append(("probe", c.plan.grad_accum_steps))
        floor = mem[c.plan.grad_accum_steps] // 2
        if floor <= budget:
            return False
        c.device_total_bytes, c.fits, c.at_least, c.probed = floor, False, True, True
        return True

    winner, predicted = search(candidates, predict, lambda c: bool(c.fits), probe=probe)
    return winner, predicted, calls


def test_the_seeds_wait_for_four_floors_or_two_misfits_in_line():
    memory = [((0, 0), 1.0, 100), ((1, 0), 1.1, 90), ((0, 1), 1.2, 90), ((2, 0), 1.3, 80),
              ((0, 2), 1.4, 80), ((1, 1), 1.5, 70), ((2, 2), 1.6, 60)]
    # Every floor (half the memory) is over the budget: after four in line, the seed's floor
    # settles the search.
    winner, predicted, calls = _run_with_floors(memory, budget=20)
    assert winner is None and predicted[-1].at_least
    assert calls == [("probe", 1), ("probe", 2), ("probe", 3), ("probe", 4), ("probe", 7)]
    # Two misfits in line, the seed's floor, then its prediction: it misfits, nothing fits.
    winner, _, calls = _run_with_floors(memory, budget=45)
    assert winner is None
    assert calls == [("probe", 1), ("probe", 2), ("predict", 2), ("probe", 3), ("predict", 3),
                     ("probe", 7), ("predict", 7)]
    # The seed fits: the line goes on to the fastest that fits.
    winner, _, calls = _run_with_floors(memory, budget=85)
    assert winner is not None and winner.plan.grad_accum_steps == 4 and ("predict", 7) in calls
    # The second in line fits: the seed is never looked at.
    winner, _, calls = _run_with_floors(memory, budget=95)
    assert winner is not None and winner.plan.grad_accum_steps == 2
    assert calls == [("probe", 1), ("predict", 1), ("probe", 2), ("predict", 2)]


def test_the_seeds_are_predicted_once_and_only_until_one_fits():
    memory = [((0, 0), 1.0, 100), ((1, 0), 1.1, 90), ((0, 1), 1.2, 95), ((2, 0), 1.3, 50),
              ((0, 2), 1.4, 50)]
    winner, calls = _run(memory, budget=60)
    # After two misfits in line the first seed, (2, 0), fits: the other seed is left alone.
    assert calls == [1, 2, 4, 3] and winner is not None and winner.plan.grad_accum_steps == 4


def test_search_tries_every_maximal_candidate_before_nothing_fits():
    # Two incomparable frugal candidates (fp32 vs autocast): the first misfits, the second fits.
    memory = [((0, 1), 1.0, 90), ((1, 0), 2.0, 50), ((0, 0), 3.0, 95)]
    winner, calls = _run(memory, budget=60)
    assert winner is not None and winner.plan.grad_accum_steps == 2
    assert 3 not in calls  # dominated by the misfit (0, 1)


def test_search_out_of_predictions_returns_the_fastest_predicted_fit():
    memory = [((0,), 1.0, 100), ((1,), 2.0, 90), ((2,), 3.0, 80), ((3,), 4.0, 10)]
    winner, calls = _run(memory, budget=50, max_predictions=2)
    # The last prediction left goes to the seed, so that a plan that fits is found.
    assert calls == [1, 4] and winner is not None and winner.plan.grad_accum_steps == 4


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=9),
    budget=st.integers(70, 105),
    floors=st.booleans(),
)
def test_the_answer_is_the_brute_force_one(ranks, budget, floors):
    # Memory falls as the rank rises in any dimension (as the planner's ranks promise), so
    # dominance never rules out a plan that fits; a floor of half the memory rules out only
    # the plans far over the budget.
    def memory(c):
        return 100 - 7 * sum(c.rank)

    def predict(c):
        c.device_total_bytes = c.peak_bytes = memory(c)
        c.fits = c.device_total_bytes <= budget
        return c.fits

    def probe(c):
        if memory(c) // 2 <= budget:
            return False
        c.device_total_bytes = c.peak_bytes = memory(c) // 2
        c.fits, c.at_least = False, True
        return True

    candidates = [
        Candidate(plan=Plan(grad_accum_steps=i + 1), rank=r, step_time=1.0 + i)
        for i, r in enumerate(ranks)
    ]
    fitting = [c for c in candidates if memory(c) <= budget]
    want = min(fitting, key=lambda c: c.step_time) if fitting else None
    winner, predicted = search(
        candidates, predict, lambda c: bool(c.fits), probe=probe if floors else None
    )
    assert winner is want
    assert len({id(c) for c in predicted}) == len(predicted)  # each predicted once


def test_seeds_that_only_miss_the_host_budget_do_not_end_the_search():
    # Such a seed proves nothing (offloading less needs less host memory): every candidate is
    # still tried, and with none left to try, nothing fits.
    candidates = [
        Candidate(plan=Plan(grad_accum_steps=i + 1), rank=r, step_time=1.0 + i)
        for i, r in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)])
    ]

    def predict(c):
        c.device_total_bytes, c.fits, c.host_misfit = 10, False, True
        return False

    winner, predicted = search(candidates, predict, lambda c: False)
    assert winner is None
    assert {c.plan.grad_accum_steps for c in predicted} == {1, 2, 3, 4}


@pytest.mark.slow
def test_an_adafactor_base_is_not_pruned_by_a_misfitting_8bit_plan():
    # Adafactor's state is tiny, 8-bit AdamW's about 2 bytes per parameter: a budget between
    # the two peaks fits only the base. Ranked by list position, the 8-bit plan was the most
    # frugal candidate; it misfit, and the planner answered that nothing fits.
    base = Plan(optimizer="adafactor")
    factored = predict_peak(WORKLOAD, base, device=A100_SPEED).device_total_bytes
    eight_bit = predict_peak(WORKLOAD, Plan(optimizer="adamw8bit"), device=A100_SPEED)
    assert factored < eight_bit.device_total_bytes
    budget = (factored + eight_bit.device_total_bytes) // 2
    result = plan(
        WORKLOAD, budget, base=base, allow=["8bit"], forbid=FORBID, device=A100_SPEED
    )
    assert result.plan.optimizer.name == "adafactor"
    assert result.predicted_device_total_bytes <= budget


@pytest.mark.slow
def test_fp32_is_not_pruned_by_a_misfitting_autocast_plan():
    # With the step fused into backward and small activations, autocast's bf16 weight copies
    # outweigh what it saves on activations: only the fp32 plan fits between the two peaks.
    # Ranked as leaner, the autocast plan was the only seed; it misfit, and nothing "fit".
    workload = load_workload("gpt2-tiny", 2, 16)
    forbid = ("accumulation", "checkpointing", "foreach-off", "fused-loss")
    fused = Plan(optimizer={"name": "adamw", "foreach": True}, optimizer_in_backward=True)
    fp32 = predict_peak(workload, fused, device=A100_SPEED).device_total_bytes
    mixed = predict_peak(workload, fused.replace(precision="bf16-mixed"), device=A100_SPEED)
    plain = predict_peak(workload, fused.replace(optimizer_in_backward=False), device=A100_SPEED)
    assert fp32 < mixed.device_total_bytes < plain.device_total_bytes
    budget = (fp32 + mixed.device_total_bytes) // 2
    result = plan(workload, budget, forbid=forbid, device=A100_SPEED)
    assert result.plan.precision.mode == "fp32" and result.plan.optimizer_in_backward
    # The autocast plan (faster) was predicted too, and found over the budget.
    autocast = [c for c in result.candidates if c.plan.precision.mode == "bf16-mixed"]
    assert autocast and all(c.fits is False for c in autocast)
    winner = next(c for c in result.candidates if c.plan == result.plan)
    assert min(c.step_time for c in autocast) < winner.step_time
