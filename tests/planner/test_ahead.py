"""A search with a worker predicting ahead gives the answer the search gives alone."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.plan import Plan
from memfit.planner import ahead as ahead_module
from memfit.planner.ahead import Ahead, start
from memfit.planner.result import Candidate
from memfit.planner.search import search


def _candidates(ranks: list[tuple[int, ...]]) -> list[Candidate]:
    # Fastest first; memory falls as the rank rises in any dimension (as the planner's ranks
    # promise), so dominance never rules out a plan that fits.
    return [
        Candidate(plan=Plan(grad_accum_steps=i + 1), rank=r, step_time=1.0 + i)
        for i, r in enumerate(ranks)
    ]


def _memory(c: Candidate) -> int:
    return 100 - 7 * sum(c.rank)


def _searcher(budget: int, delay: float = 0.0):
    def predict(c: Candidate) -> bool:
        time.sleep(delay)
        c.device_total_bytes = c.peak_bytes = _memory(c)
        c.fits = c.device_total_bytes <= budget
        return c.fits

    def probe(c: Candidate) -> bool:
        # A floor of half the memory: rules out only the plans far over the budget.
        if _memory(c) // 2 <= budget:
            return False
        c.device_total_bytes = c.peak_bytes = _memory(c) // 2
        c.fits, c.at_least = False, True
        return True

    def work(c: Candidate, first_probe: bool) -> None:
        if not (first_probe and probe(c)):
            predict(c)

    return predict, probe, work


def _search(ranks, budget, jobs: int, delay: float = 0.0):
    candidates = _candidates(ranks)
    predict, probe, work = _searcher(budget, delay)
    ahead = Ahead(candidates, work) if jobs > 1 else None
    try:
        winner, predicted = search(
            candidates, predict, lambda c: bool(c.fits), probe=probe, ahead=ahead
        )
    finally:
        if ahead is not None:
            ahead.close()
    return (None if winner is None else winner.plan.grad_accum_steps), predicted


def _brute_force(ranks, budget):
    fits = [c for c in _candidates(ranks) if _memory(c) <= budget]
    return min(fits, key=lambda c: c.step_time).plan.grad_accum_steps if fits else None


@settings(max_examples=25, deadline=None)
@given(
    ranks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=9),
    budget=st.integers(70, 105),
)
def test_the_answer_is_the_search_alone_and_the_brute_force_one(ranks, budget):
    alone, _ = _search(ranks, budget, jobs=1)
    together, _ = _search(ranks, budget, jobs=2, delay=0.002)
    assert together == alone == _brute_force(ranks, budget)


def test_the_worker_takes_what_the_search_has_not_reached():
    ranks = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    winner, predicted = _search(ranks, budget=75, jobs=2, delay=0.05)
    assert winner == _brute_force(ranks, budget=75)
    # Every prediction was made exactly once, wherever it was made.
    seen = [c.plan.grad_accum_steps for c in predicted]
    assert len(seen) == len(set(seen))


def test_nothing_fits_with_a_worker():
    ranks = [(0, 0), (1, 0), (0, 1)]
    assert _search(ranks, budget=10, jobs=2, delay=0.01)[0] is None


def test_a_failing_worker_leaves_the_work_to_the_search():
    candidates = _candidates([(0, 0), (1, 1), (2, 2)])
    predict, probe, _ = _searcher(budget=90)

    def broken(c, first_probe):
        raise RuntimeError("worker failure")

    with Ahead(candidates, broken) as ahead:
        winner, _ = search(candidates, predict, lambda c: bool(c.fits), probe=probe, ahead=ahead)
    assert winner is not None and winner.plan.grad_accum_steps == _brute_force(
        [(0, 0), (1, 1), (2, 2)], 90
    )


def test_a_killed_worker_leaves_the_work_to_the_search():
    ranks = [(0, 0), (0, 1), (1, 1), (2, 2)]
    candidates = _candidates(ranks)
    predict, probe, work = _searcher(budget=80, delay=0.02)
    with Ahead(candidates, work) as ahead:
        ahead._proc.kill()
        ahead._proc.join()
        winner, _ = search(candidates, predict, lambda c: bool(c.fits), probe=probe, ahead=ahead)
    assert winner is not None and winner.plan.grad_accum_steps == _brute_force(ranks, 80)


def test_withdrawn_before_it_starts():
    candidates = _candidates([(0, 0), (1, 1), (2, 2)])
    _, _, work = _searcher(budget=90, delay=0.3)
    with Ahead(candidates, work) as ahead:
        ahead.offer(candidates[0])
        ahead.offer(candidates[1])  # queued behind the first
        assert ahead.has(candidates[1])
        assert not ahead.take(candidates[1])  # withdrawn: the caller does it
        assert not ahead.has(candidates[1])
        assert ahead.take(candidates[0])  # waits for the one under way
        assert candidates[0].fits is not None


def test_no_worker_on_one_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert start(_candidates([(0,)]), lambda c, p: None) is None


def test_fields_cover_what_a_prediction_fills():
    # Whatever predict and probe write into a candidate must travel back from the worker.
    fields = {f for f in Candidate.__dataclass_fields__ if f not in ("plan", "rank", "step_time")}
    assert fields - {"ratio", "cost_terms"} <= set(ahead_module.FIELDS)


@pytest.mark.parametrize("jobs", [0, -1, 1.5])
def test_jobs_is_checked(jobs):
    from memfit.planner import plan

    with pytest.raises(ValueError, match="--jobs must be"):
        plan("gpt2-tiny", "1GiB", jobs=jobs)


def test_lookahead_skips_what_a_misfit_would_rule_out():
    from memfit.planner.search import _offer_next

    offered = []

    class Recorder:
        def offer(self, c, probe=True):
            offered.append(c.rank)

    candidates = _candidates([(0, 0), (0, 0), (1, 0), (0, 1), (1, 1)])
    _offer_next(Recorder(), candidates, 0, [])
    # (0, 0) again is needed only if (0, 0) fits, which ends the search: skipped.
    assert offered == [(1, 0), (0, 1)]


@pytest.mark.parametrize("jobs", [1, 2])
def test_seeds_that_only_miss_the_host_budget_do_not_end_the_search(jobs):
    # Such a seed proves nothing (offloading less needs less host memory): every candidate is
    # still tried, with or without the worker, and with none left to try, nothing fits.
    candidates = _candidates([(0, 0), (1, 0), (0, 1), (1, 1)])

    def predict(c):
        c.device_total_bytes, c.fits, c.host_misfit = 10, False, True
        return False

    def work(c, first_probe):
        predict(c)

    ahead = Ahead(candidates, work) if jobs > 1 else None
    try:
        winner, predicted = search(candidates, predict, lambda c: False, ahead=ahead)
    finally:
        if ahead is not None:
            ahead.close()
    assert winner is None
    assert {c.plan.grad_accum_steps for c in predicted} == {1, 2, 3, 4}


def test_the_seeds_are_shared_with_the_worker_when_their_turn_comes():
    # Three incomparable seeds, nothing fits: when the seeds are due (two misfits in line),
    # the worker is asked for the second and third at the front of its queue, without a
    # probe, while the search takes the first, then the others from the back.
    class Idle:  # a worker that never starts anything: the search does all the work
        def __init__(self):
            self.queue, self.front = [], []

        def offer(self, c, probe=True, *, first=False):
            if first:
                self.front.append((c.rank, probe))
            self.queue.insert(0, c) if first else self.queue.append(c)

        def has(self, c):
            return any(q is c for q in self.queue)

        def take(self, c):
            self.withdraw(c)
            return False

        def withdraw(self, c):
            self.queue = [q for q in self.queue if q is not c]

        def ready(self, c):
            return False

        def running(self, c):
            return False

    ranks = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)]
    candidates = _candidates(ranks)
    predict, _, _ = _searcher(budget=10)
    idle = Idle()
    winner, predicted = search(candidates, predict, lambda c: bool(c.fits), ahead=idle)
    assert winner is None
    assert idle.front == [((0, 2), False), ((1, 1), False)]
    assert [c.rank for c in predicted][-3:] == [(2, 0), (0, 2), (1, 1)]


def test_first_jumps_the_queue_and_withdraw_takes_back():
    candidates = _candidates([(0, 0), (1, 1), (2, 2), (3, 3)])
    _, _, work = _searcher(budget=90, delay=0.2)

    def noting(c, first_probe):
        work(c, first_probe)
        c.note = str(time.monotonic())  # when the worker finished it

    with Ahead(candidates, noting) as ahead:
        ahead.offer(candidates[0])  # starts at once
        ahead.offer(candidates[1])
        ahead.offer(candidates[3])
        ahead.offer(candidates[2], first=True)  # ahead of the other two
        ahead.withdraw(candidates[3])
        assert not ahead.has(candidates[3]) and ahead.has(candidates[1])
        assert all(ahead.take(candidates[i]) for i in (0, 2, 1))  # each waited for
    finished = [float(c.note) for c in candidates[:3]]
    assert finished[0] < finished[2] < finished[1]
    assert candidates[3].fits is None


def test_a_task_runs_in_the_worker_ahead_of_the_candidates():
    candidates = _candidates([(0, 0), (1, 1)])
    _, _, work = _searcher(budget=90, delay=0.2)

    def fails():
        raise RuntimeError("task failure")

    tasks = {"pid": os.getpid, "fails": fails}
    with Ahead(candidates, work, tasks) as ahead:
        ahead.run("pid")
        assert ahead.result("pid") not in (None, os.getpid())  # it ran in the worker
        ahead.run("fails")
        assert ahead.result("fails") is None  # failed: the caller does it
        ahead.offer(candidates[0])  # under way
        ahead.offer(candidates[1])  # queued
        ahead.run("pid")  # ahead of the queued candidate
        assert ahead.take(candidates[0])
        assert ahead.result("pid") not in (None, os.getpid()) and ahead.running(candidates[1])
        ahead.run("pid")  # queued behind the candidate under way
        assert ahead.result("pid") is None  # not started: withdrawn, the caller does it


def test_a_task_on_a_candidate_discard_and_poll():
    candidates = _candidates([(0, 0), (1, 1), (2, 2)])
    _, _, work = _searcher(budget=90)

    def slow_rank(c, inbox):
        time.sleep(0.3)
        return c.rank

    with Ahead(candidates, work, {"rank": slow_rank}) as ahead:
        ahead.run("rank", candidates[1])
        assert ahead.result("rank", candidates[1]) == (1, 1)  # the candidate's, in the worker
        # Discarded while under way: the result is dropped when it comes.
        ahead.run("rank", candidates[2])
        ahead.discard("rank", candidates[2])
        ahead.offer(candidates[0])  # queued behind it
        deadline = time.monotonic() + 30
        while not (ahead.running(candidates[0]) or ahead.ready(candidates[0])):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ahead.take(candidates[0])
        assert ahead.result("rank", candidates[2]) is None  # dropped
        # A poll that raises stops the wait (the task goes on in the worker, unwanted).
        ahead.run("rank", candidates[0])

        def stop():
            raise TimeoutError

        with pytest.raises(TimeoutError):
            ahead.result("rank", candidates[0], poll=stop)
        ahead.discard("rank", candidates[0])


def _read_all(c, inbox):
    # A task that reads its items until the sender says there are no more.
    items, k = [], 0
    while (item := inbox(k)) is not None:
        items.append(item)
        k += 1
    assert inbox(k + 5) is None  # (and every later one)
    return c.rank, items


def test_a_task_reads_what_it_is_told_in_order():
    candidates = _candidates([(0, 0), (1, 1), (2, 2)])
    _, _, work = _searcher(budget=90, delay=0.3)
    with Ahead(candidates, work, {"read": _read_all}) as ahead:
        # Under way: items go to it as they are told.
        ahead.run("read", candidates[1])
        for item in ("a", "b", None):
            ahead.tell("read", candidates[1], item)
        assert ahead.result("read", candidates[1]) == ((1, 1), ["a", "b"])
        ahead.tell("read", candidates[1], "late")  # done: dropped
        # Not yet started (the worker is busy): kept for it until it starts.
        ahead.offer(candidates[0])
        ahead.run("read", candidates[2])
        assert ahead.running(candidates[0])
        ahead.tell("read", candidates[2], "c")
        ahead.tell("read", candidates[2], None)
        assert ahead.take(candidates[0])
        assert ahead.result("read", candidates[2]) == ((2, 2), ["c"])
        # Discarded while it waits for an item: it stops, and the worker goes on.
        ahead.run("read", candidates[0])
        ahead.tell("read", candidates[0], "d")
        time.sleep(0.2)  # (it has its first item and waits for the next)
        assert ahead.peek("read", candidates[0]) is None
        ahead.discard("read", candidates[0])
        ahead.tell("read", candidates[0], "e")  # discarded: not sent
        ahead.offer(candidates[2])
        deadline = time.monotonic() + 30
        while not (ahead.running(candidates[2]) or ahead.ready(candidates[2])):
            assert time.monotonic() < deadline  # the stopped task freed the worker
            time.sleep(0.01)
        assert ahead.take(candidates[2]) and candidates[2].fits is not None
        assert ahead.result("read", candidates[0]) is None


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.45, 0.35])
def test_the_planner_with_its_worker_answers_as_it_does_alone(fraction):
    # For real: the worker forked before costing measures half the cost profile, predicts
    # ahead, takes seeds and runs the depth-3 runs of what the planner predicts itself.
    import memfit
    from memfit.estimate import cost
    from memfit.estimate.compose import predict_peak
    from memfit.planner import plan

    workload = memfit.load_workload("gpt2-tiny", 8, 32).with_depth(6)
    budget = int(predict_peak(workload, memfit.Plan()).peak_bytes * fraction)
    answers = []
    for jobs in (1, 2):
        cost._PROFILES.clear()
        result = plan(workload, budget, allow=["8bit", "factored"], jobs=jobs)
        answers.append((result.plan, result.predicted_peak_bytes, result.predicted_peak_by_category))
    assert answers[0] == answers[1]
