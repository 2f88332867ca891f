"""The candidate table always lists the chosen plan, however far down the search ranked it."""

from __future__ import annotations

import io

from rich.console import Console

from memfit import Plan
from memfit.planner.explain import explain_table
from memfit.planner.result import Candidate, PlanResult


def _result(winner_at: int, count: int = 30) -> PlanResult:
    candidates = [
        Candidate(plan=Plan(grad_accum_steps=i + 1), rank=(i,), step_time=1.0 + i / 100,
                  ratio=1.0 + i / 100, peak_bytes=(100 - i) << 20, by_category={},
                  fits=i >= winner_at)
        for i in range(count)
    ]
    winner = candidates[winner_at]
    return PlanResult(
        fits=True, plan=winner.plan, budget_bytes=64 << 20, predicted_peak_bytes=winner.peak_bytes,
        predicted_peak_by_category={}, predicted_step_time_ratio=winner.ratio,
        candidates=candidates, frontier=[], explanation="the fastest that fits.", device="cpu",
    )


def _rows(result: PlanResult, limit: int) -> list[str]:
    buf = io.StringIO()
    Console(file=buf, width=200).print(explain_table(result, limit=limit))
    return [line for line in buf.getvalue().splitlines() if line.startswith("│")]


def test_a_winner_ranked_past_the_limit_takes_the_last_row():
    result = _result(winner_at=24)
    rows = _rows(result, limit=15)
    assert len(rows) == 15
    assert "★ " + result.plan.summary() in rows[-1]
    assert sum("★" in row for row in rows) == 1
    # The rows before it are the fastest ones, in order.
    assert Plan(grad_accum_steps=1).summary() in rows[0]


def test_a_winner_within_the_limit_stays_in_its_place():
    result = _result(winner_at=3)
    rows = _rows(result, limit=15)
    assert len(rows) == 15 and "★ " + result.plan.summary() in rows[3]
