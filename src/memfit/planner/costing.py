"""Costing: a predicted step time for every candidate, and the order the search tries them in.

Costing is cheap (arithmetic on one workload profile measured on fake tensors), so every
candidate is costed; memory, the expensive part, is then predicted in this order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..estimate.cost import StepCost, WorkloadProfile, step_cost
from ..plan import Plan
from ..targets import DeviceProfile
from .result import Candidate

__all__ = ["TIE_BAND", "cost_into", "order"]

#: Step times within this factor of each other are a tie for the cost model. Its terms are
#: peak-rate estimates (vendor peak FLOP/s and bandwidth, a fitted small-batch derating):
#: differences under 2% are below what the model resolves, so among tied candidates the more
#: frugal is tried first, and the first that fits is found with fewer memory predictions.
TIE_BAND = 1.02


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
    """Fastest first; within a tie band (:data:`TIE_BAND`), the more frugal first."""
    return sorted(candidates, key=lambda c: (tie_bucket(c.step_time), -sum(c.rank)))


def tie_bucket(step_time: float) -> int:
    """Index of the :data:`TIE_BAND`-wide band of step times that ``step_time`` falls in."""
    return math.floor(math.log(max(step_time, 1e-12)) / math.log(TIE_BAND))
