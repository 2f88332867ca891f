"""Costing: a predicted step time for every candidate, and the order the search tries them in.

Costing is cheap (arithmetic on one workload profile measured on fake tensors), so every
candidate is costed; memory, the expensive part, is then predicted in this order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from ..estimate.cost import StepCost, WorkloadProfile, step_cost
from ..plan import Plan
from ..targets import DeviceProfile
from .result import Candidate

__all__ = ["TIE_BAND", "TIE_RULE", "cost_into", "order", "tied"]

#: Step times within this factor of each other are a tie for the cost model. Its terms are
#: peak-rate estimates (vendor peak FLOP/s and bandwidth, a fitted small-batch derating):
#: differences under 2% are below what the model resolves.
TIE_BAND = 1.02

#: How tied candidates are ordered, as the planner's explanation states it.
TIE_RULE = (
    "plans predicted within 2% of each other's step time count as equally fast; among them "
    "the plan with fewer techniques comes first, then the one that keeps less memory"
)


def cost_into(
    candidates: Sequence[Candidate],
    profile: WorkloadProfile,
    device: DeviceProfile,
    *,
    batch_size: int,
    baseline: Plan,
    trainable: Mapping[tuple[str, ...], float] | None = None,
) -> list[Candidate]:
    """Cost every candidate (its ``step_time``, ``ratio`` and ``cost_terms`` are set) and
    return them in search order.

    Args:
        candidates: The candidates, with their plans and memory ranks.
        profile: The workload's measured sizes.
        device: The device the step time is predicted for.
        batch_size: Samples per optimizer step.
        baseline: The unoptimised plan that ``ratio`` is relative to.
        trainable: Share of parameters that train under each freezing choice.
    """
    trainable = trainable or {}

    def cost(p: Plan) -> StepCost:
        return step_cost(
            profile,
            p,
            device,
            batch_size=batch_size,
            trainable_fraction=trainable.get(tuple(p.freeze), 1.0),
        )

    base_time = cost(baseline).total
    for candidate in candidates:
        c = cost(candidate.plan)
        candidate.step_time = c.total
        candidate.ratio = c.total / base_time
        candidate.cost_terms = c.to_dict()
    return order(candidates)


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Fastest first; ties (within :data:`TIE_BAND` of the fastest of a run of candidates)
    go by :data:`TIE_RULE`: fewer techniques, then more frugal (a higher memory rank, summed
    over the dimensions), then faster, then by the whole plan, so the order is the same for the
    same costs whatever order the candidates came in."""
    keys = {id(c): _tie_key(c) for c in candidates}  # each plan serialised once
    by_time = sorted(candidates, key=lambda c: (c.step_time, *keys[id(c)]))
    ordered: list[Candidate] = []
    start = 0
    while start < len(by_time):
        end = start + 1
        limit = by_time[start].step_time * TIE_BAND
        while end < len(by_time) and by_time[end].step_time <= limit:
            end += 1
        ordered += sorted(by_time[start:end], key=lambda c: keys[id(c)])
        start = end
    return ordered


def _tie_key(c: Candidate) -> tuple:
    # Last, the whole plan: two plans the summary does not tell apart still have one order.
    plan = json.dumps(c.plan.to_dict(), sort_keys=True, default=str)
    return (len(c.plan.summary_parts()), -sum(c.rank), c.step_time, c.plan.summary(), plan)


def tied(a: Candidate, b: Candidate) -> bool:
    """Whether the cost model cannot tell ``a``'s step time from ``b``'s (:data:`TIE_BAND`)."""
    low, high = sorted((a.step_time, b.step_time))
    return high <= low * TIE_BAND
