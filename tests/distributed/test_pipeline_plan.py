"""Pipeline settings, their checks and their theory: no process, no model."""

from __future__ import annotations

import itertools
import random

import pytest

from memfit.distributed.pipeline_plan import (
    BlockCost,
    PipelineConfig,
    PipelineError,
    check_pipeline,
    choose_cuts,
    even_cuts,
    microbatches_in_flight,
    predict_stage_activations,
)


def test_defaults_and_derived_settings():
    c = PipelineConfig(4)
    assert (c.schedule, c.num_microbatches, c.local_stages, c.num_stages) == ("1f1b", 8, 1, 4)
    assert c.bubble_fraction == pytest.approx(3 / 11)
    i = PipelineConfig(4, "interleaved-1f1b", 8)
    assert (i.local_stages, i.num_stages) == (2, 8)
    assert i.bubble_fraction == pytest.approx(3 / 19)  # v = 2 halves the fill and drain
    assert PipelineConfig(2, cuts=[3]).cuts == (3,)  # lists from JSON become tuples


def test_stage_placement_loop_and_v():
    loop = PipelineConfig(3, "interleaved-1f1b", 6)
    assert [loop.stage_indices(r) for r in range(3)] == [(0, 3), (1, 4), (2, 5)]
    v = PipelineConfig(3, "zero-bubble", 6)
    assert [v.stage_indices(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    for config in (loop, v, PipelineConfig(3)):
        for r in range(3):
            assert all(config.rank_of_stage(s) == r for s in config.stage_indices(r))


def test_stage_blocks_follow_cuts():
    c = PipelineConfig(2, cuts=(3,))
    assert list(c.stage_blocks(5, 0)) == [0, 1, 2]
    assert list(c.stage_blocks(5, 1)) == [3, 4]
    assert PipelineConfig(2).resolved_cuts(5) == (3,)  # a tie for the middle: the earlier


@pytest.mark.parametrize(
    ("config", "blocks", "says"),
    [
        (PipelineConfig(1), 4, "degree must be a whole number >= 2"),
        (PipelineConfig(2, "chimera"), 4, "use one of gpipe, 1f1b, interleaved-1f1b"),
        (PipelineConfig(4, "1f1b", 2), 8, "needs at least as many micro-batches as the pipeline "
                                          "degree (4), got 2; use microbatches >= 4 or the gpipe"),
        (PipelineConfig(4, "interleaved-1f1b", 6), 8, "a multiple of the pipeline degree (4), got 6; "
                                                      "use microbatches 4 or 8"),
        (PipelineConfig(4, "interleaved-1f1b", 2), 8, "use microbatches 4"),
        (PipelineConfig(2, "zero-bubble", 1), 4, "use microbatches >= 2"),
        (PipelineConfig(2, "zero-bubble", 4, stages_per_rank=3), 8, "exactly 2 stages per rank"),
        (PipelineConfig(2, "gpipe", 4, stages_per_rank=2), 8, "use interleaved-1f1b for several"),
        (PipelineConfig(2, microbatches=0), 4, "microbatches must be a whole number >= 1"),
        (PipelineConfig(4), 3, "3 blocks cannot fill 4 pipeline stages (4 ranks x 1 stages each) "
                               "without an empty stage; use degree <= 3"),
        (PipelineConfig(2, "interleaved-1f1b", 4), 3, "3 blocks cannot fill 4 pipeline stages"),
        (PipelineConfig(2, cuts=(0,)), 4, "pipeline cuts (0,) must be 1 strictly increasing block "
                                          "indices between 1 and 3"),
        (PipelineConfig(3, cuts=(3, 2)), 6, "e.g. (2, 4)"),
        (PipelineConfig(2, cuts=(1, 2)), 4, "must be 1 strictly increasing"),
        (PipelineConfig(2, cuts=(4,)), 4, "no stage empty"),
    ],
)
def test_bad_settings_say_what_would_work(config, blocks, says):
    with pytest.raises(PipelineError) as err:
        check_pipeline(blocks, config)
    assert says in str(err.value)


def test_good_settings_pass():
    for config in (PipelineConfig(2, "gpipe", 1), PipelineConfig(2, cuts=(1,)),
                   PipelineConfig(4, "interleaved-1f1b", 8), PipelineConfig(2, "zero-bubble", 2)):
        check_pipeline(8, config)
        assert config.problems(8) == []


def test_even_cuts_spread_the_remainder_over_the_middle():
    assert even_cuts(8, 4) == (2, 4, 6)
    assert even_cuts(10, 4) == (2, 5, 8)  # 2 + 3 + 3 + 2
    assert even_cuts(7, 3) == (2, 5)


@pytest.mark.parametrize("p", [2, 4])
def test_in_flight_closed_forms(p):
    for r in range(p):
        assert microbatches_in_flight("gpipe", p, 3 * p, r) == 3 * p
        assert microbatches_in_flight("1f1b", p, 3 * p, r) == p - r
    # Rank 0 of interleaved 1F1B: (v - 1) p warm-up chunks plus 2 (p - 1) to fill, plus one.
    assert microbatches_in_flight("interleaved-1f1b", p, 2 * p, 0, 2) == 2 * (p - 1) + p + 1
    assert microbatches_in_flight("zero-bubble", p, 2 * p, 0) == 2 * p


def test_gpipe_over_1f1b_is_m_over_p_on_the_first_stage():
    a = 1000
    gpipe = predict_stage_activations(a, 2, 8, "gpipe", 0)
    one_f = predict_stage_activations(a, 2, 8, "1f1b", 0)
    assert (gpipe, one_f) == (8000, 2000)
    assert predict_stage_activations(a, 2, 8, "zero-bubble", 0) == 2000  # p micro-batches


def _objective(costs, cuts, degree, schedule, m, first, last, factor=4.0):
    """The documented objective, written out: the bottleneck stage's memory or compute,
    whichever is larger, each relative to an even share."""
    s_count = len(cuts) + 1
    bounds = (0, *cuts, len(costs))
    w = [microbatches_in_flight(schedule, degree, m, s) for s in range(s_count)]
    mem, work = [], []
    for s in range(s_count):
        part = costs[bounds[s]:bounds[s + 1]]
        ms = sum(factor * c.state_bytes + w[s] * c.activation_bytes for c in part)
        cs = sum(c.compute for c in part)
        if s == 0:
            ms += factor * first.state_bytes + w[s] * first.activation_bytes
            cs += first.compute
        if s == s_count - 1:
            ms += factor * last.state_bytes + w[s] * last.activation_bytes
            cs += last.compute
        mem.append(ms)
        work.append(cs)
    total_mem = (sum(factor * c.state_bytes for c in costs) + factor * (first.state_bytes
                 + last.state_bytes) + sum(w) / s_count * sum(c.activation_bytes for c in costs)
                 + w[0] * first.activation_bytes + w[-1] * last.activation_bytes)
    return max(max(mem[s] / (total_mem / s_count), work[s] / (sum(work) / s_count))
               for s in range(s_count))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_choose_cuts_is_optimal_against_brute_force(schedule):
    rng = random.Random(0)
    for _ in range(20):
        n, degree = rng.randint(3, 8), rng.choice([2, 3])
        if n < degree:
            continue
        costs = [BlockCost(rng.randint(0, 100), rng.randint(0, 100), rng.uniform(0, 10))
                 for _ in range(n)]
        first, last = BlockCost(rng.randint(0, 200), 5, 1.0), BlockCost(rng.randint(0, 200), 50, 3.0)
        got = choose_cuts(costs, degree, schedule=schedule, microbatches=4, first=first, last=last)
        best = min(_objective(costs, cuts, degree, schedule, 4, first, last)
                   for cuts in itertools.combinations(range(1, n), degree - 1))
        assert _objective(costs, got, degree, schedule, 4, first, last) == pytest.approx(best)


def test_choose_cuts_balances_what_dominates():
    uniform = [BlockCost(10, 10, 1.0)] * 8
    assert choose_cuts(uniform, 4) == (2, 4, 6)
    # Activations only: 1F1B keeps 2 micro-batches on stage 0 and 1 on stage 1, so stage 0
    # takes a third of the blocks; GPipe keeps 4 on both and splits evenly.
    acts = [BlockCost(0, 100, 0.0)] * 9
    assert choose_cuts(acts, 2, schedule="1f1b", microbatches=4) == (3,)
    assert choose_cuts(acts, 2, schedule="gpipe", microbatches=4) in ((4,), (5,))
    # A heavy head (a large vocabulary) pulls blocks off the last stage.
    head = BlockCost(300, 0, 30.0)
    assert choose_cuts(uniform, 2, last=head)[0] > 4
    # Without any measured cost: an even split by count.
    assert choose_cuts([BlockCost()] * 6, 3) == (2, 4)


def test_choose_cuts_refuses_too_few_blocks():
    with pytest.raises(PipelineError, match="2 blocks cannot fill 4 pipeline stages"):
        choose_cuts([BlockCost(1, 1, 1.0)] * 2, 4)
