"""The planner's worker's share of a search (run by :mod:`memfit.planner.ahead`).

With a second core, the planner starts a worker before it costs the candidates: forked, or,
where a forked child could not run a backward (this process ran one on a CUDA build of torch:
:func:`~memfit.planner.ahead.fork_safe`), from a fork server, to which the workload travels as
the ``load_workload`` call that makes it again (:func:`workload_recipe`; a workload built
otherwise cannot travel, and the planner then says so and works alone). The worker
measures the deeper half of the workload's cost profile while the planner measures the other
half; then, for each prediction, it makes the depth-3 shallow run while the planner makes the
depth-2 one (:func:`predict_shared`). The planner's depth-2 run sends its trace at each
forward's end to the worker as it is made, and the worker's depth-3 run is watched against
the budget with those traces, as :func:`~memfit.estimate.compose.predict_peak` watches its
own (:class:`~memfit.estimate.compose.BudgetWatch`): it stops as soon as the full depth passes
the budget, and the planner's depth-2 run stops within a few operators once it knows (its
``should_stop``). The
two reports are then composed by ``predict_peak`` (its ``known_reports``), or the floor the
worker found is the prediction: the one the planner would make alone.

Everything about the two processes lives here and in :mod:`~memfit.planner.ahead`: the
estimator only runs and composes shallow runs (its public pieces: ``shallow_report``,
``budget_watch``, ``floor_prediction``, ``predict_peak``), and the worker hands back plain
data (a report, or a :class:`Stopped`).
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..estimate.compose import (
    block_pattern,
    budget_watch,
    floor_prediction,
    predict_peak,
    shallow_report,
)
from ..estimate.prediction import Prediction
from ..targets import DeviceProfile
from ..workload import Workload, load_workload
from .ahead import Ahead, Inbox, WorkerFailed, fork_safe, start
from .result import Candidate

__all__ = ["Stopped", "predict_shared", "start_worker", "workload_recipe"]


@dataclass(frozen=True)
class Stopped:
    """The worker's depth-3 run stopped: the full depth passes the budget.

    Attributes:
        floor: The bytes per category at the full depth's highest point up to the stop.
        forward: The forward (counted from 0) at whose end the run stopped.
    """

    floor: dict[str, int]
    forward: int


def start_worker(
    workload: Workload,
    target: DeviceProfile,
    budget_bytes: int,
    candidates: Sequence[Candidate],
    frugal: set[int],
) -> Ahead | None:
    """The worker of one search (``None`` where none can help, or none can be started: then
    a :class:`~memfit.planner.ahead.WorkerFailed` warning says why), able to run the deeper
    half of ``workload``'s cost profile (``"profile"``) and a candidate's depth-3 run
    (``"depth3"``; unwatched for the candidates whose ids are in ``frugal``, whose peak the
    answer may quote)."""
    if workload.scalable and (workload.depth or 0) > 3:
        block_pattern(workload)  # built once here, not again in each process
    positions = frozenset(i for i, c in enumerate(candidates) if id(c) in frugal)
    if fork_safe():
        method, sent = "fork", workload
    else:
        recipe = workload_recipe(workload)
        if recipe is None:
            warnings.warn(
                f"the planner works alone: this process ran a backward on a CUDA build of torch, "
                f"so its worker cannot be forked (autograd's threads do not cross a fork), and "
                f"workload {workload.name!r} was not made by load_workload, so it cannot be "
                "sent to a fresh one; the answer is the same, slower",
                WorkerFailed,
                stacklevel=2,
            )
            return None
        method, sent = "forkserver", recipe
    return start(
        candidates,
        {
            "profile": functools.partial(_profile_task, sent),
            "depth3": functools.partial(_depth3_task, sent, target, budget_bytes, positions),
        },
        method,
    )


@dataclass(frozen=True)
class _Recipe:
    """The ``load_workload`` call (and depth) that makes a workload again in another process."""

    spec: str
    batch_size: int
    seq_len: int
    depth: int | None


def workload_recipe(workload: Workload) -> _Recipe | None:
    """How another process makes ``workload`` again: its ``load_workload`` call and depth, or
    ``None`` where that does not give the same workload (one built in Python, or changed after
    loading: every field is compared, functions by their code and what they close over)."""
    try:
        recipe = _Recipe(workload.name, workload.batch_size, workload.seq_len, workload.depth)
        again = _made(recipe)
    except Exception:
        return None
    same = all(_same(getattr(workload, f.name), getattr(again, f.name)) for f in fields(workload))
    return recipe if same else None


_MADE: dict[_Recipe, Workload] = {}  # the worker's workload, made once


def _made(recipe: _Recipe) -> Workload:
    if recipe not in _MADE:
        workload = load_workload(recipe.spec, recipe.batch_size, recipe.seq_len)
        if recipe.depth != workload.depth and workload.with_depth is not None:
            workload = workload.with_depth(recipe.depth)
        _MADE[recipe] = workload
    return _MADE[recipe]


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Equal values, or functions of the same code closing over equal values."""
    if a is b:
        return True
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        if a.__code__ is not b.__code__ or depth > 4:  # (deeper nests are not followed)
            return False
        cells = zip(a.__closure__ or (), b.__closure__ or (), strict=True)
        return all(_same(x.cell_contents, y.cell_contents, depth + 1) for x, y in cells)
    try:
        return bool(a == b)
    except Exception:
        return False


def _workload(sent: Workload | _Recipe) -> Workload:
    return _made(sent) if isinstance(sent, _Recipe) else sent


def _profile_task(sent: Workload | _Recipe) -> Any:
    """The worker's deeper half of the workload's cost profile."""
    from ..estimate.cost import deeper_half

    return deeper_half(_workload(sent))


def _depth3_task(
    sent: Workload | _Recipe,
    target: DeviceProfile,
    budget_bytes: int,
    frugal: frozenset[int],
    c: Candidate,
    inbox: Inbox,
) -> Any:
    """The worker's depth-3 run of a candidate, watched against the budget with the depth-2
    run's traces its inbox receives: the report, or :class:`Stopped`."""
    workload = _workload(sent)
    budget = None if inbox.position in frugal else budget_bytes
    watch = budget_watch(workload, c.plan, target, budget)
    hook = None
    if watch is not None:

        def hook(tracker: Any) -> bool:
            if watch.checked >= len(watch.marks):
                mark = inbox(watch.checked)  # waits for the depth-2 run to get there
                if mark is not None:
                    watch.marks.append(mark)
            return watch.check(tracker)

    report = shallow_report(workload, c.plan, 3, device=target, at_forward_end=hook)
    if watch is not None and watch.floor is not None:
        return Stopped(watch.floor, watch.stopped_at)
    return report


def predict_shared(
    ahead: Ahead,
    c: Candidate,
    workload: Workload,
    target: DeviceProfile,
    budget_bytes: int | None,
) -> Prediction:
    """``c``'s prediction with its depth-3 run made by the worker meanwhile (what
    :func:`~memfit.estimate.compose.predict_peak` gives in one process with ``budget_bytes``:
    the composed peak, or a floor over the budget). Where the worker did not run it (busy,
    failed, gone), this process makes it, watched with its own depth-2 traces."""
    plan = c.plan
    watch = budget_watch(workload, plan, target, budget_bytes)
    ahead.run("depth3", c)

    def at_end(tracker: Any) -> bool:
        if watch is not None:
            watch.mark(tracker)
            ahead.tell("depth3", c, watch.marks[-1])
        return False

    def stopped_there() -> bool:  # once the depth-3 run stopped over the budget
        return isinstance(ahead.peek("depth3", c), Stopped)  # depth 2 is not needed

    try:
        try:
            r2 = shallow_report(
                workload, plan, 2, device=target, at_forward_end=at_end, should_stop=stopped_there
            )
        finally:
            if watch is not None:
                ahead.tell("depth3", c, None)  # no more traces
        r3 = ahead.result("depth3", c)
    finally:
        ahead.discard("depth3", c)
    if isinstance(r3, Stopped):
        return floor_prediction(r3.floor, target, r3.forward)
    if r3 is None:
        r3 = shallow_report(
            workload, plan, 3, device=target, at_forward_end=watch and watch.check
        )
        if watch is not None and watch.floor is not None:
            return floor_prediction(watch.floor, target, watch.stopped_at)
    return predict_peak(
        workload, plan, device=target, budget_bytes=budget_bytes, known_reports={2: r2, 3: r3}
    )
