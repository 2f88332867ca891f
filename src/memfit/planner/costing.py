"""Costing: a predicted step time for every candidate, and the order the search tries them in.

Costing is cheap (arithmetic on one workload profile measured on fake tensors), so every
candidate is costed; memory, the expensive part, is then predicted in this order.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

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
        fraction = trainable.get(tuple(p.freeze), 1.0)
        if p.lora is not None:
            fraction *= LORA_BACKWARD_SHARE
        c = step_cost(profile, p, device, batch_size=batch_size, trainable_fraction=fraction)
        return c if p.lora is None else _with_dequantisation(c, p, profile, device)

    base_time = cost(baseline).total
    for candidate in candidates:
        c = cost(candidate.plan)
        candidate.step_time = c.total
        candidate.ratio = c.total / base_time
        candidate.cost_terms = c.to_dict()
    return order(candidates)


#: LoRA's share of a full fine-tune's backward (the cost model's ``trainable_fraction``): the
#: frozen base computes the gradients of its inputs but none of its weights, about half the
#: backward's matmuls; the optimizer is costed for that share of the parameters too, an
#: overestimate of the adapters' few.
LORA_BACKWARD_SHARE = 0.5


def _with_dequantisation(c: StepCost, plan: Plan, profile: WorkloadProfile, device: Any) -> StepCost:
    """QLoRA's extra time: every pass over the model (forward, backward, and the recompute
    of checkpointing) dequantises each 4-bit weight, reading half a byte and writing two (a
    bound on memory bandwidth, counted with the pointwise work) per parameter."""
    if not plan.lora.quantize_base:
        return c
    passes = (2 + (plan.checkpointing.mode != "none")) * plan.grad_accum_steps
    seconds = passes * profile.num_parameters * 2.5 / device.mem_bandwidth
    return dataclasses.replace(c, pointwise=c.pointwise + seconds)


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
    # QLoRA is two techniques in one phrase: adapters, and a 4-bit base (which changes the
    # forward too), so plain LoRA wins a tie with it.
    lora = c.plan.lora
    parts = len(c.plan.summary_parts()) + int(lora is not None and bool(lora.quantize_base))
    return (parts, -sum(c.rank), c.step_time, c.plan.summary(), plan)


def tied(a: Candidate, b: Candidate) -> bool:
    """Whether the cost model cannot tell ``a``'s step time from ``b``'s (:data:`TIE_BAND`)."""
    low, high = sorted((a.step_time, b.step_time))
    return high <= low * TIE_BAND
