"""What the planner hands back: the candidates it weighed and its answer.

:class:`Candidate` travels through the search's stages (generation, costing, prediction,
confirmation), each filling its fields; :class:`PlanResult` is the answer and the JSON of
``memfit plan``; :class:`NothingFits` carries the closest plan when none fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import MemfitError
from ..plan import Plan

__all__ = ["Candidate", "NothingFits", "PlanResult"]


@dataclass
class Candidate:
    """One plan considered by the planner.

    Attributes:
        plan: The plan.
        rank: Memory rank per dimension (higher uses less memory), for dominance.
        step_time: Predicted seconds per step.
        ratio: ``step_time`` relative to the unoptimised plan.
        peak_bytes: Predicted peak (``None`` when never predicted).
        by_category: Predicted bytes per category at the peak.
        fits: Whether the prediction fits the budget (``None`` when not predicted).
        note: How the verdict was reached.
        cost_terms: The cost model's terms in seconds (:class:`memfit.estimate.cost.StepCost`).
        reserved_bytes: Predicted reserved peak of the target's caching allocator.
        device_total_bytes: Predicted device total (what is compared with the budget).
        host_bytes: Predicted host-tier peak (offload), compared with a host budget if given.
        host_misfit: Whether it fits the device but not the host budget (such a misfit rules
            out no other candidate: offloading less would use less host memory).
        composed: The prediction of a candidate that fits, kept until it is confirmed (its
            shallow runs' traces may spare the full-depth run); not exported.
        at_least: Whether the figures are a floor rather than the peak: the candidate was
            ruled out by what its run holds at the end of the first forward (see
            :func:`memfit.planner.predict.probe`).
        probed: Whether a probe alone ruled it out (its first forward over the budget), at a
            fraction of a prediction's cost; the search counts only full predictions when it
            decides to predict the most frugal candidates.
    """

    plan: Plan
    rank: tuple[int, ...]
    step_time: float
    ratio: float = 1.0
    peak_bytes: int | None = None
    by_category: dict[str, int] | None = None
    fits: bool | None = None
    note: str = ""
    cost_terms: dict[str, float] = field(default_factory=dict)
    reserved_bytes: int | None = None
    device_total_bytes: int | None = None
    host_bytes: int | None = None
    host_misfit: bool = False
    composed: Any = field(default=None, repr=False, compare=False)
    at_least: bool = False
    probed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "plan": self.plan.to_dict(),
            "summary": self.plan.summary(),
            "predicted_step_time_ratio": self.ratio,
            "predicted_peak_bytes": self.peak_bytes,
            "predicted_peak_by_category": self.by_category,
            "predicted_peak_reserved_bytes": self.reserved_bytes,
            "predicted_device_total_bytes": self.device_total_bytes,
            "predicted_host_bytes": self.host_bytes,
            "peak_is_lower_bound": self.at_least,
            "fits": self.fits,
            "note": self.note,
        }


@dataclass
class PlanResult:
    """The planner's answer.

    Attributes:
        fits: Whether a plan fits the budget.
        plan: The fastest plan that fits; when nothing fits, the plan with the smallest peak.
        budget_bytes: The budget.
        predicted_peak_bytes: Peak of ``plan`` (confirmed by a full-depth dry run).
        predicted_peak_by_category: Its bytes per category.
        predicted_step_time_ratio: Its predicted step time relative to the unoptimised plan.
        candidates: Every candidate whose memory was predicted, fastest first.
        frontier: Fitting plans (and plans predicted to fit), fastest first: the trainer's
            fallbacks when a step runs out of memory.
        explanation: Why the winner won, in a sentence or two.
        device: The device profile's name (the cost model's and the dry runs' target).
        seconds: Time the search took (not in the JSON, which holds the answer alone: the
            same question gives the same bytes).
        predicted_peak_reserved_bytes: Reserved peak of ``plan`` on the target (allocator
            model; the tensors' peak on the CPU).
        predicted_device_total_bytes: Reserved plus the target's CUDA context and workspaces:
            what was fitted into the budget.
        predicted_host_bytes: Predicted host-tier peak (offload's masters, state, gradients,
            activations).
        predicted_device_total_upper_bytes: The device total's error band's upper edge: what
            was fitted into the budget (the device total itself on the CPU).
        error_band: Each predicted figure's relative error band
            (:func:`~memfit.estimate.target.error_band`), keyed by its JSON name.
        rank_peak_bytes: For a plan over several processes: each rank's predicted peak, in
            rank order (``predicted_peak_bytes`` is then the largest).
        layout: For a 3-D plan (:mod:`memfit.planner.layout`): the predicted step time, its
            parts, each rank's busy time and the next best layouts (the JSON's ``layout``).
    """

    fits: bool
    plan: Plan
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_peak_by_category: dict[str, int]
    predicted_step_time_ratio: float
    candidates: list[Candidate]
    frontier: list[Plan]
    explanation: str
    device: str
    seconds: float = 0.0
    predicted_peak_reserved_bytes: int = 0
    predicted_device_total_bytes: int = 0
    predicted_host_bytes: int = 0
    predicted_device_total_upper_bytes: int = 0
    error_band: dict[str, dict[str, float]] | None = None
    rank_peak_bytes: list[int] | None = None
    layout: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``memfit plan``. For a plan over several processes
        (``rank_peak_bytes`` set), ``predicted_peak_bytes`` is the list of each rank's peak
        (also ``predicted_rank_peak_bytes``, and ``ranks`` with one entry per rank)."""
        data = self._plain_dict()
        if self.rank_peak_bytes is not None:
            peaks = [int(p) for p in self.rank_peak_bytes]
            data.update(
                world_size=len(peaks),
                predicted_peak_bytes=peaks,
                predicted_rank_peak_bytes=peaks,
                predicted_max_rank_peak_bytes=max(peaks),
                ranks=[self._rank_entry(r, v) for r, v in enumerate(peaks)],
            )
        return data

    def _rank_entry(self, rank: int, peak: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"rank": rank, "predicted_peak_bytes": peak}
        if self.layout is not None:
            where = self.plan.parallel.coordinates(rank)
            entry.update(where)
            entry["predicted_step_seconds"] = self.layout["step_seconds"]
            entry["predicted_busy_seconds"] = self.layout["stage_busy_seconds"][where["stage"]]
        return entry

    def _plain_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "plan": self.plan.to_dict(),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_peak_by_category": self.predicted_peak_by_category,
            "predicted_peak_reserved_bytes": self.predicted_peak_reserved_bytes,
            "predicted_device_total_bytes": self.predicted_device_total_bytes,
            "predicted_host_bytes": self.predicted_host_bytes,
            "predicted_device_total_upper_bytes": self.predicted_device_total_upper_bytes,
            **({"error_band": self.error_band} if self.error_band is not None else {}),
            "predicted_step_time_ratio": self.predicted_step_time_ratio,
            "candidates": [c.to_dict() for c in self.candidates],
            "explanation": self.explanation,
            "device": self.device,
            "target_device": self.device,
            **({"layout": self.layout} if self.layout is not None else {}),
        }


class NothingFits(MemfitError):
    """No plan in the allowed space fits; carries the :class:`PlanResult` with the closest."""

    def __init__(self, result: PlanResult, message: str) -> None:
        super().__init__(message)
        self.result = result
