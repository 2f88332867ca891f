"""A prediction shared with the forked worker is the one the planner makes alone."""

from __future__ import annotations

import pickle
import time
import warnings

import pytest
import torch

import memfit
from memfit.estimate.compose import predict_peak
from memfit.planner.ahead import WorkerFailed
from memfit.planner.result import Candidate
from memfit.planner.worker import Stopped, predict_shared, start_worker, workload_recipe
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
@pytest.mark.subprocess  # on a CUDA build the worker comes from the fork server
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
            pytest.fail("no worker could be started (this test needs Linux and two cores)")
        with ahead:
            # predict_peak ran backwards here: on a CUDA build a forked worker could not run
            # one, and the fork server starts it instead.
            assert ahead.method == ("fork" if torch.version.cuda is None else "forkserver")
            assert ahead.wait_started(300), ahead.failure
            shared = [predict_shared(ahead, c, workload, target, budget) for c in candidates]
            # Ask for the stop directly: the worker's result is plain data.
            ahead.run("depth3", candidates[0])
            ahead.tell("depth3", candidates[0], None)  # no marks: it is not stopped
            deadline = time.monotonic() + 300
            while ahead.peek("depth3", candidates[0]) is None:
                assert ahead.failure is None, ahead.failure
                assert time.monotonic() < deadline, "the worker gave no depth-3 run"
                time.sleep(0.01)
            assert not isinstance(ahead.result("depth3", candidates[0]), Stopped)
            # The worker busy with another task: depth 3 is withdrawn and made here (or made
            # there, with the marks kept for it, if the worker is free in time).
            ahead.run("profile")
            busy = predict_shared(ahead, candidates[0], workload, target, budget)
    assert ahead.failure is None, ahead.failure
    assert [_figures(p) for p in shared] == [_figures(p) for p in alone]
    assert _figures(busy) == _figures(alone[0])


def test_the_worker_gets_the_workload_as_its_load_workload_call(workload):
    recipe = workload_recipe(workload)
    assert recipe is not None
    assert (recipe.spec, recipe.batch_size, recipe.seq_len, recipe.depth) == ("gpt2-tiny", 8, 32, 6)
    assert pickle.loads(pickle.dumps(recipe)) == recipe
    # Changed after loading, or built in Python: load_workload would not make it again.
    assert workload_recipe(workload.replace(loss_fn=lambda out, batch: out.logits.sum())) is None
    assert workload_recipe(workload.replace(seq_len=16)) is None
    assert workload_recipe(workload.replace(name="not-a-preset")) is None


def test_a_worker_that_cannot_be_started_is_said(workload, monkeypatch):
    # Where a fork is not safe, a workload built in Python cannot travel: the planner says so.
    from memfit.planner import worker

    monkeypatch.setattr(worker, "fork_safe", lambda: False)
    odd = workload.replace(loss_fn=lambda out, batch: out.logits.sum())
    with pytest.warns(WorkerFailed, match=r"works alone: this process ran a backward on a CUDA "
                      r"build .* 'gpt2-tiny' was not made by load_workload"):
        ahead = start_worker(odd, get_device("cpu"), 1 << 30, _candidates(), frugal=set())
    assert ahead is None
