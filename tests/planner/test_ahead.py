"""The worker runs tasks in a second process, and the planner gives the answer it gives alone."""

from __future__ import annotations

import os
import time
import warnings

import pytest

from memfit.plan import Plan
from memfit.planner.ahead import Ahead, WorkerFailed, fork_safe, start
from memfit.planner.result import Candidate


def _candidates(n: int) -> list[Candidate]:
    return [Candidate(plan=Plan(grad_accum_steps=i + 1), rank=(i,), step_time=1.0 + i) for i in range(n)]


def _slow_rank(c, inbox):
    time.sleep(0.3)
    return c.rank


def test_a_task_runs_in_the_worker_ahead_of_those_asked_for_before():
    candidates = _candidates(2)

    def fails():
        raise RuntimeError("task failure")

    tasks = {"pid": os.getpid, "fails": fails, "rank": _slow_rank}
    with Ahead(candidates, tasks) as ahead:
        ahead.run("pid")
        assert ahead.result("pid") not in (None, os.getpid())  # it ran in the worker
        ahead.run("fails")
        with pytest.warns(WorkerFailed, match="its task 'fails' raised RuntimeError: task failure"):
            assert ahead.result("fails") is None  # failed: the caller does it (and is told)
        ahead.run("rank", candidates[0])  # under way
        ahead.run("rank", candidates[1])  # queued
        ahead.run("pid")  # ahead of the queued one
        assert ahead.result("rank", candidates[0]) == (0,)  # the candidate's, in the worker
        assert ahead.result("pid") not in (None, os.getpid())
        assert ahead.result("rank", candidates[1]) == (1,)
        ahead.run("rank", candidates[0])  # under way...
        ahead.run("pid")  # ...and this one queued behind it
        assert ahead.result("pid") is None  # not started: withdrawn, the caller does it
        assert ahead.result("rank", candidates[0]) == (0,)


def test_a_task_discarded_or_waited_for_with_a_poll():
    candidates = _candidates(3)
    with Ahead(candidates, {"rank": _slow_rank}) as ahead:
        # Discarded while under way: the result is dropped when it comes.
        ahead.run("rank", candidates[2])
        ahead.discard("rank", candidates[2])
        ahead.run("rank", candidates[0])  # queued behind it
        assert ahead.result("rank", candidates[0]) is None  # (withdrawn: not started)
        ahead.run("rank", candidates[1])
        deadline = time.monotonic() + 30
        while ahead.peek("rank", candidates[1]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ahead.result("rank", candidates[1]) == (1,)
        assert ahead.result("rank", candidates[2]) is None  # dropped
        # A poll that raises stops the wait (the task goes on in the worker, unwanted).
        ahead.run("rank", candidates[0])

        def stop():
            raise TimeoutError

        with pytest.raises(TimeoutError):
            ahead.result("rank", candidates[0], poll=stop)
        ahead.discard("rank", candidates[0])


def test_a_killed_worker_leaves_the_work_to_the_caller_and_is_said_once():
    candidates = _candidates(1)
    with Ahead(candidates, {"pid": os.getpid}) as ahead:
        ahead._proc.kill()
        ahead._proc.join()
        deadline = time.monotonic() + 30
        while ahead.failure is None:  # (the reader thread sees the pipe close)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.warns(WorkerFailed, match=r"worker process failed \(it stopped with exit "
                          r"code -9\); the planner does its share itself"):
            ahead.run("pid")
        assert ahead.result("pid") is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            ahead.run("pid")
            assert ahead.result("pid") is None


def _raises_like_a_cuda_build():
    raise RuntimeError("Unable to handle autograd's threading in combination with fork-based "
                       "multiprocessing.")


def test_a_task_that_raises_is_said_with_its_error():
    # What a forked worker met on a CUDA build: the planner used to work alone in silence.
    with Ahead(_candidates(1), {"fails": _raises_like_a_cuda_build, "pid": os.getpid}) as ahead:
        ahead.run("fails")
        with pytest.warns(WorkerFailed, match=r"its task 'fails' raised RuntimeError: Unable "
                          r"to handle autograd's threading"):
            assert ahead.result("fails") is None
        ahead.run("pid")  # the worker goes on with the tasks that work
        assert ahead.result("pid") not in (None, os.getpid())


@pytest.mark.slow
@pytest.mark.subprocess  # the fork server is a fresh interpreter
def test_a_worker_from_the_fork_server_runs_pickled_tasks():
    candidates = _candidates(2)
    ahead = start(candidates, {"pid": os.getpid, "rank": _slow_rank}, "forkserver")
    if ahead is None:
        pytest.fail("no worker could be started (this test needs Linux and two cores)")
    with ahead:
        assert ahead.method == "forkserver"
        assert ahead.wait_started(120)
        ahead.run("pid")
        assert ahead.result("pid") not in (None, os.getpid())
        ahead.run("rank", candidates[1])
        assert ahead.result("rank", candidates[1]) == (1,)
    assert ahead.failure is None


def test_a_worker_that_cannot_start_is_said(recwarn):
    # A task that does not pickle cannot travel to the fork server: said, and no hang.
    unpicklable = lambda: 1  # noqa: E731
    ahead = Ahead(_candidates(1), {"local": unpicklable}, "forkserver")
    with ahead:
        assert not ahead.wait_started(120)
        with pytest.warns(WorkerFailed, match="it could not start: .*pickle"):
            ahead.run("local")
        assert ahead.result("local") is None


def test_a_fork_is_safe_here_until_a_cuda_build_ran_a_fake_backward():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda_build = torch.version.cuda is not None
    with FakeTensorMode():  # a backward as the planner's dry runs make them
        torch.ones(2, requires_grad=True).sum().backward()
    # A CPU build forks safely after it; a CUDA build does not (the worker is then started by
    # the fork server).
    assert fork_safe() is not cuda_build


def test_no_worker_on_one_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert start(_candidates(1), {}) is None


@pytest.mark.parametrize("jobs", [0, -1, 1.5])
def test_jobs_is_checked(jobs):
    from memfit.planner import plan

    with pytest.raises(ValueError, match="--jobs must be"):
        plan("gpt2-tiny", "1GiB", jobs=jobs)


def _read_all(c, inbox):
    # A task that reads its items until the sender says there are no more.
    items, k = [], 0
    while (item := inbox(k)) is not None:
        items.append(item)
        k += 1
    assert inbox(k + 5) is None  # (and every later one)
    return c.rank, items


def test_a_task_reads_what_it_is_told_in_order():
    candidates = _candidates(3)
    with Ahead(candidates, {"read": _read_all, "rank": _slow_rank}) as ahead:
        # Under way: items go to it as they are told.
        ahead.run("read", candidates[1])
        for item in ("a", "b", None):
            ahead.tell("read", candidates[1], item)
        assert ahead.result("read", candidates[1]) == ((1,), ["a", "b"])
        ahead.tell("read", candidates[1], "late")  # done: dropped
        # Not yet started (the worker is busy): kept for it until it starts.
        ahead.run("rank", candidates[0])
        ahead.run("read", candidates[2])
        ahead.tell("read", candidates[2], "c")
        ahead.tell("read", candidates[2], None)
        while ahead.peek("read", candidates[2]) is None:
            time.sleep(0.01)
        assert ahead.result("read", candidates[2]) == ((2,), ["c"])
        # Discarded while it waits for an item: it stops, and the worker goes on.
        ahead.run("read", candidates[0])
        ahead.tell("read", candidates[0], "d")
        time.sleep(0.2)  # (it has its first item and waits for the next)
        assert ahead.peek("read", candidates[0]) is None
        ahead.discard("read", candidates[0])
        ahead.tell("read", candidates[0], "e")  # discarded: not sent
        ahead.run("rank", candidates[2])
        deadline = time.monotonic() + 30
        while ahead.peek("rank", candidates[2]) is None:
            assert time.monotonic() < deadline  # the stopped task freed the worker
            time.sleep(0.01)
        assert ahead.result("rank", candidates[2]) == (2,)
        assert ahead.result("read", candidates[0]) is None


@pytest.mark.slow
@pytest.mark.subprocess  # on a CUDA build the worker comes from the fork server
@pytest.mark.parametrize("fraction", [0.45, 0.35])
def test_the_planner_with_its_worker_answers_as_it_does_alone(fraction):
    # For real: the worker forked before costing measures half the cost profile, then runs
    # the depth-3 run of every prediction, watched with the planner's depth-2 marks.
    import memfit
    from memfit.estimate import cost
    from memfit.estimate.compose import predict_peak
    from memfit.planner import plan

    workload = memfit.load_workload("gpt2-tiny", 8, 32).with_depth(6)
    budget = int(predict_peak(workload, memfit.Plan()).peak_bytes * fraction)
    answers = []
    for jobs in (1, 2):
        cost._PROFILES.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", WorkerFailed)  # the worker did its share
            result = plan(workload, budget, allow=["8bit", "factored"], jobs=jobs)
        answers.append((result.plan, result.predicted_peak_bytes, result.predicted_peak_by_category))
    assert answers[0] == answers[1]
