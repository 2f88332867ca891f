"""A prediction shared with the forked worker is the one the planner makes alone."""

from __future__ import annotations

import time
import warnings

import pytest

import memfit
from memfit.estimate.compose import predict_peak
from memfit.planner.result import Candidate
from memfit.planner.worker import Stopped, predict_shared, start_worker
from memfit.targets import get_device


def _figures(p):
    return (p.method, p.peak_bytes, p.by_category, p.phase_peaks, p.host_bytes,
            p.device_total_bytes, p.extra.get("stopped_at_forward"))  # fmt: skip


@pytest.fixture(scope="module")
def workload():
    return memfit.load_workload("gpt2-tiny", 8, 32).with_depth(6)


def _candidates() -> list[Candidate]:
    plans = [
        memfit.Plan(micro_batch_size=2, optimizer="adafactor"),
        memfit.Plan(micro_batch_size=2, checkpointing="selective", optimizer="adafactor"),
    ]
    return [Candidate(plan=p, rank=(i,), step_time=1.0 + i) for i, p in enumerate(plans)]


@pytest.mark.slow
def test_a_prediction_shared_with_the_worker_is_the_one_made_alone(workload):
    # Over the budget, the worker's depth-3 run stops on the planner's depth-2 marks with
    # predict_peak's floor; under it, the two reports compose to predict_peak's peak; with
    # the worker busy elsewhere, the planner makes depth 3 itself, watched the same way.
    target = get_device("cpu")
    candidates = _candidates()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = predict_peak(workload, candidates[0].plan)
        budget = full.peak_bytes * 3 // 4
        alone = [predict_peak(workload, c.plan, budget_bytes=budget) for c in candidates]
        assert alone[0].method == "at-least" and alone[1].method == "composed"
        ahead = start_worker(workload, target, budget, candidates, frugal=set())
        if ahead is None:
            pytest.fail("no worker could be forked (this test needs Linux and two cores)")
        with ahead:
            shared = [predict_shared(ahead, c, workload, target, budget) for c in candidates]
            # Ask for the stop directly: the worker's result is plain data.
            ahead.run("depth3", candidates[0])
            ahead.tell("depth3", candidates[0], None)  # no marks: it is not stopped
            while ahead.peek("depth3", candidates[0]) is None:
                time.sleep(0.01)
            assert not isinstance(ahead.result("depth3", candidates[0]), Stopped)
            # The worker busy with another task: depth 3 is withdrawn and made here (or made
            # there, with the marks kept for it, if the worker is free in time).
            ahead.run("profile")
            busy = predict_shared(ahead, candidates[0], workload, target, budget)
    assert [_figures(p) for p in shared] == [_figures(p) for p in alone]
    assert _figures(busy) == _figures(alone[0])
