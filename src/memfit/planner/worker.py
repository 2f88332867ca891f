"""The planner's forked worker's share of a search (run by :mod:`memfit.planner.ahead`).

With a second core, the planner forks a worker before it costs the candidates. The worker
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from ..workload import Workload
from .ahead import Ahead, Inbox, start
from .result import Candidate

__all__ = ["Stopped", "predict_shared", "start_worker"]


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
    """The forked worker of one search (``None`` where none can be forked), able to run the
    deeper half of ``workload``'s cost profile (``"profile"``) and a candidate's depth-3 run
    (``"depth3"``; unwatched for the candidates whose ids are in ``frugal``, whose peak the
    answer may quote)."""
    from ..estimate.cost import deeper_half

    if workload.scalable and (workload.depth or 0) > 3:
        block_pattern(workload)  # built once here, not again in each process
    return start(
        candidates,
        {
            "profile": lambda: deeper_half(workload),
            "depth3": _depth3_task(workload, target, budget_bytes, frugal),
        },
    )


def _depth3_task(
    workload: Workload, target: DeviceProfile, budget_bytes: int, frugal: set[int]
) -> Callable[[Candidate, Inbox], Any]:
    """The worker's depth-3 run of a candidate, watched against the budget with the depth-2
    run's traces its inbox receives: the report, or :class:`Stopped`."""

    def depth3(c: Candidate, inbox: Inbox) -> Any:
        budget = None if id(c) in frugal else budget_bytes
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

    return depth3


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
