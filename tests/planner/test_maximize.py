"""``memfit.maximize``: the longest context (or largest batch) that fits, and its plan.

The search itself is checked on memory curves given as formulas (any curve, exact answers by
brute force, in milliseconds); the planner binding on a tiny GPT-2, whose answer a dry run
confirms: its plan fits at the answer and not one step (or 5%) longer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

import memfit
from memfit.estimate.predictor import DryRun
from memfit.planner import FORBID
from memfit.planner.maximize import (
    SEQ_GRANULARITY,
    Maximized,
    NothingAtAll,
    PlannerGaveUp,
    Search,
    maximize,
    parse_what,
    position_limit,
)
from memfit.planner.predict import fits
from memfit.targets import DEVICES


# ------------------------------------------------------------------- the search on formulas
class Curves:
    """Plans as memory formulas, fastest first; the planner picks the fastest that fits."""

    def __init__(self, curves, budget, floors=False):
        self.curves, self.budget, self.floors = curves, budget, floors
        self.predicted = []

    def memory(self, plan, n):
        return self.curves[plan](n)

    def plan_at(self, n):
        for plan in self.curves:
            if self.memory(plan, n) <= self.budget:
                return True, plan, (plan, n)
        closest = min(self.curves, key=lambda p: self.memory(p, n))
        return False, closest, (closest, n)

    def fits_at(self, plan, n):
        self.predicted.append((plan, n))
        m = self.memory(plan, n)
        if m > self.budget and self.floors:  # a run stopped early: a floor, not the peak
            return False, self.budget + 1, False
        return m <= self.budget, m, True

    def longest(self, limit):
        """Brute force: the longest value any plan fits at."""
        best = 0
        for n in range(1, limit + 1):
            if any(self.memory(p, n) <= self.budget for p in self.curves):
                best = n
        return best


def _search(curves, *, start=128, limit=4096, planner_first=True, step=None, scout=None):
    return Search(curves.plan_at, curves.fits_at, curves.budget, start, limit,
                  planner_first=planner_first, fixed_step=step, scout=scout)


def _check_answer(curves, found, limit):
    best = curves.longest(limit)
    n, g = found.value, found.granularity
    plan, at = found.answer
    assert at == n and curves.memory(plan, n) <= curves.budget
    assert n <= best < n + g  # nothing fits one step longer...
    assert found.next_checked == n + g
    if n >= 20:  # ...nor 5% longer
        assert not any(curves.memory(p, math.ceil(1.05 * n)) <= curves.budget for p in curves.curves)
    assert 1 <= g <= max(1, n // 32)
    # The fastest plan at the answer is the planner's.
    assert plan == curves.plan_at(n)[1]


def test_the_longest_length_over_two_plans_is_the_frugal_ones():
    # "fast" holds 3 bytes a token, "frugal" one: frugal reaches 800, fast 300.
    curves = Curves({"fast": lambda n: 100 + 3 * n, "frugal": lambda n: 200 + n}, 1000)
    search = _search(curves)
    found = search.run()
    _check_answer(curves, found, 4096)
    assert found.answer[0] == "frugal" and found.value == 800
    # A linear curve is found in a few predictions and three planner calls.
    assert search.plan_calls == 3
    assert search.predictions <= 8


@pytest.mark.parametrize("floors", [False, True], ids=["peaks", "floors"])
def test_random_curves_match_brute_force(floors):
    rng = random.Random(0)
    for _ in range(25):
        curves = {}
        for k in range(rng.randint(1, 4)):
            a, b, c = rng.uniform(0, 500), rng.uniform(0.1, 5), rng.choice([0, rng.uniform(0, 0.01)])
            curves[f"p{k}"] = lambda n, a=a, b=b, c=c: a + b * n + c * n * n
        budget = rng.uniform(600, 5000)
        limit = rng.choice([256, 4096, 20000])
        curve = Curves(curves, budget, floors=floors)
        best = curve.longest(limit)
        # A scout (a planner held to a few predictions) may say nothing fits where a plan
        # does, and name any plan: the answer stays the same.
        names = list(curves)
        scout = rng.choice([None, lambda n, p=rng.choice(names): (False, p, (p, n))])
        search = _search(curve, start=rng.choice([1, 16, 128, 5000]), limit=limit,
                         planner_first=rng.random() < 0.5, scout=scout)
        if best == 0:
            with pytest.raises(NothingAtAll):
                search.run()
            continue
        found = search.run()
        if best == limit:
            assert found.value == limit and found.next_checked is None
            continue
        _check_answer(curve, found, limit)
        assert search.predictions <= 6 * math.log2(limit) + 4


def test_only_the_answer_is_confirmed_and_a_refusal_narrows_below_it():
    # Predictions say 1 byte a token; the full-depth confirmation (the planner's verdict
    # too) 10% more than predicted.
    curves = Curves({"a": lambda n: 100 + n}, 1000)
    full = Curves({"a": lambda n: 1.1 * (100 + n)}, 1000)
    confirmed = []

    def confirm_at(plan, n):
        confirmed.append(n)
        return full.memory(plan, n) <= full.budget, full.memory(plan, n)

    search = Search(full.plan_at, curves.fits_at, 1000, 16, 4096, fixed_step=1,
                    confirm_at=confirm_at)
    found = search.run()
    truth = max(n for n in range(1, 4097) if 1.1 * (100 + n) <= 1000)
    assert found.value == truth and confirm_at("a", truth)[0] and not confirm_at("a", truth + 1)[0]
    assert confirmed[0] == 900  # the predictions' answer, refused, then the search went on
    # Aimed below the refused value by its full-depth figure: a few confirmations, not one per
    # value between the two answers (91 of them).
    assert len(confirmed) <= 8 and search.predictions <= 20


def test_exact_granularity_finds_the_exact_batch():
    curves = Curves({"a": lambda n: 50 + 7 * n, "b": lambda n: 90 + 2 * n * n}, 1000)
    found = _search(curves, start=8, limit=1 << 24, planner_first=False, step=1).run()
    assert found.value == curves.longest(200) == 135 and found.granularity == 1


def test_the_cap_is_the_answer_when_everything_fits_there():
    curves = Curves({"a": lambda n: n}, 10**9)
    search = _search(curves, limit=256)
    found = search.run()
    assert (found.value, found.next_checked, search.plan_calls, search.predictions) == (256, None, 1, 0)


def test_a_scout_that_fits_at_the_cap_is_asked_again_in_full():
    curves = Curves({"fast": lambda n: 2 * n, "frugal": lambda n: n}, 10**9)
    search = _search(curves, limit=256, scout=lambda n: (True, "frugal", ("frugal", n)))
    found = search.run()
    assert found.value == 256 and found.answer == ("fast", 256) and search.plan_calls == 2


def test_nothing_fits_even_at_the_smallest_length():
    curves = Curves({"a": lambda n: 100 + n}, 50)
    with pytest.raises(NothingAtAll) as info:
        _search(curves).run()
    assert info.value.value == 1


def test_a_planner_that_gives_up_before_the_plan_predicted_to_fit_is_said():
    class Blind(Curves):  # its planner never reaches "frugal" (as at its prediction limit)
        def plan_at(self, n):
            ok, plan, answer = super().plan_at(n)
            return (False, plan, answer) if plan == "frugal" else (ok, plan, answer)

    curves = Blind({"fast": lambda n: 100 + 3 * n, "frugal": lambda n: 200 + n}, 1000)
    with pytest.raises(PlannerGaveUp) as info:
        _search(curves).run()
    assert info.value.plan == "frugal"


def test_the_planner_is_asked_once_per_value():
    # The start is the answer: the planner's answer there is not asked for again.
    curves = Curves({"a": lambda n: 10 * n}, 1000)
    search = _search(curves, start=100, limit=1 << 24, planner_first=False, step=1)
    assert search.run().value == 100 and search.plan_calls == 2


def test_granularity_is_a_power_of_two_under_a_32nd_of_the_length():
    search = _search(Curves({"a": lambda n: n}, 1))
    assert [search.step(n) for n in (1, 31, 64, 100, 2048, 4095, 131072)] == [1, 1, 2, 2, 64, 64, 64]
    assert SEQ_GRANULARITY == 64


def test_what_words():
    assert parse_what("seq-len") == "seq_len" and parse_what("batch_size") == "batch_size"
    with pytest.raises(ValueError, match="--maximize 'tokens' is not known; use seq-len"):
        parse_what("tokens")


def test_bad_arguments_fail_before_any_work():
    for kwargs, match in (
        (dict(what="width"), "not known"),
        (dict(granularity=0), "granularity must be"),
        (dict(allow=["shorter-seq"]), "shorter-seq"),
        (dict(budget="lots"), "not understood"),
    ):
        budget = kwargs.pop("budget", "1GiB")
        with pytest.raises(ValueError, match=match):
            maximize("gpt2-tiny", budget, device="cpu", **kwargs)


def test_the_position_limit_of_presets_and_configs(tmp_path):
    assert position_limit("llama-3.1-8b") == 131072
    assert position_limit("gpt2-tiny") == 256
    assert position_limit("bert-base") == 512  # transformers' default, left out of the preset
    assert position_limit("tests.models:mlp_workload") is None
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    assert position_limit(str(path)) == position_limit(str(tmp_path)) == 4096


# ------------------------------------------------------------------ the planner, for real
# The A100's speed for the cost model with the CPU's memory (no allocator, no CUDA context):
# budgets are in tensor bytes, which dry runs give exactly.
A100_SPEED = dataclasses.replace(
    DEVICES["a100"], name="a100-speed", kind="cpu", context_bytes=0, workspace_bytes=0
)
CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 2,
    "vocab_size": 512,
    "n_positions": 1024,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def _fits(spec, plan, batch_size, seq_len, budget):
    prediction = DryRun().predict(memfit.load_workload(spec, batch_size, seq_len), plan, A100_SPEED)
    return fits(prediction, budget)


@pytest.mark.slow
@pytest.mark.parametrize(("what", "batch_size", "seq_len"), [("seq_len", 2, 100), ("batch_size", 6, 64)])
def test_the_answer_fits_and_one_step_or_5_percent_more_does_not(config, what, batch_size, seq_len):
    # The budget is what the plain plan holds at one size; the planner may use no technique
    # (all forbidden), so the plain plan is the only one, and the answer is that size.
    sizes = {"batch_size": batch_size, "seq_len": seq_len}
    budget = DryRun().predict(
        memfit.load_workload(config, batch_size, seq_len), memfit.Plan(), A100_SPEED
    ).upper_device_total_bytes
    found = memfit.maximize(
        config, budget, what=what, batch_size=2 if what == "seq_len" else 1, seq_len=seq_len if what == "batch_size" else 16,
        device=A100_SPEED, forbid=list(FORBID), jobs=1,
    )
    assert isinstance(found, Maximized) and found.what == what and found.limited_by == "memory"
    n, g = found.value, found.granularity
    assert found.to_dict()["maximized"] == {what: n}
    assert found.result.fits and found.result.plan.summary() == "adamw"
    at = lambda v: {**sizes, what: v}  # noqa: E731
    assert _fits(config, found.result.plan, **at(n), budget=budget)
    assert not _fits(config, found.result.plan, **at(n + g), budget=budget)
    assert not _fits(config, found.result.plan, **at(math.ceil(1.05 * n)), budget=budget)
    assert n == sizes[what]  # the plain plan holds exactly the budget there
    assert found.plan_calls <= 4


def test_the_sentence_says_what_stopped_the_search():
    m = Maximized("seq_len", 4096, None, "24GiB", 64, "memory", 131072, 4160)
    assert m.sentence() == (
        "longest context: 4096 tokens per sample (granularity 64): no allowed plan fits 4160 tokens"
    )
    m.limited_by, m.next_checked = "max_positions", None
    assert "maximum positions, not memory" in m.sentence()
    m = Maximized("batch_size", 7, None, "1GiB", 1, "memory", 1 << 24, 8)
    assert m.sentence().endswith("no allowed plan fits 8 samples")
