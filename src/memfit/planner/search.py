"""Search the plans that fit a memory budget for the fastest one.

The candidates and their memory ranks come from :mod:`memfit.planner.candidates`; the cost
model (:mod:`memfit.estimate.cost`) orders them; :mod:`memfit.estimate.compose` predicts their
memory; the winner is confirmed by one full-depth dry run.

Every candidate gets a predicted step time from the cost model (cheap: arithmetic on one
measured profile). Memory is the expensive part, so it is predicted lazily, in order of
predicted speed: the first candidate whose predicted peak fits is confirmed with one dry run at
full depth and returned. Two rules keep the number of memory predictions small:

* the most frugal candidate is predicted first: if even it does not fit, nothing does, and the
  answer says how far off it is;
* dominance: a candidate that uses at least as much memory as a known misfit in every
  dimension (larger micro-batch, less checkpointing, wider precision, bigger optimizer state,
  ...) cannot fit and is skipped without a prediction.

What must fit is what the target device would hold. For a GPU that is the device total: the
caching allocator's reserved peak (the allocator model replaying the dry runs' allocations)
plus the CUDA context and library workspaces; for the CPU, the tensors' peak.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..plan import Plan
from ..targets import DeviceProfile
from ..workload import Workload
from .candidates import (
    ALLOW,
    FORBID,
    _check_names,
    _dominated,
    _space,
    _trainable_fractions,
)

__all__ = ["ALLOW", "FORBID", "Candidate", "PlanResult", "plan"]

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
        reserved_bytes: Predicted reserved peak of the target's caching allocator.
        device_total_bytes: Predicted device total (what is compared with the budget).
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
        seconds: Time the search took.
        predicted_peak_reserved_bytes: Reserved peak of ``plan`` on the target (allocator
            model; the tensors' peak on the CPU).
        predicted_device_total_bytes: Reserved plus the target's CUDA context and workspaces:
            what was fitted into the budget.
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

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``memfit plan``."""
        return {
            "fits": self.fits,
            "plan": self.plan.to_dict(),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_peak_by_category": self.predicted_peak_by_category,
            "predicted_peak_reserved_bytes": self.predicted_peak_reserved_bytes,
            "predicted_device_total_bytes": self.predicted_device_total_bytes,
            "predicted_step_time_ratio": self.predicted_step_time_ratio,
            "candidates": [c.to_dict() for c in self.candidates],
            "explanation": self.explanation,
            "device": self.device,
            "target_device": self.device,
            "seconds": self.seconds,
        }


class NothingFits(Exception):
    """No plan in the allowed space fits; carries the :class:`PlanResult` with the closest."""

    def __init__(self, result: PlanResult, message: str) -> None:
        super().__init__(message)
        self.result = result


def plan(
    workload: Workload | str,
    budget: int | str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    allow: Iterable[str] = (),
    forbid: Iterable[str] = (),
    base: Plan | None = None,
    device: str | None = None,
    max_predictions: int = 60,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """Find the fastest plan whose peak fits ``budget``.

    Args:
        workload: The workload at its full batch and sequence length, or a SPEC.
        budget: Bytes, a size string (``4GiB``) or a device name (``t4``).
        allow: Techniques that change training and need consent: ``freeze``,
            ``shorter-seq``, ``8bit``, ``factored``, ``bf16-pure``.
        forbid: Default techniques to rule out: ``accumulation``, ``checkpointing``,
            ``full-checkpointing``, ``mixed-precision``, ``fused-step``, ``foreach-off``.
        base: The user's plan to start from (its optimizer family and settings are kept).
        device: Device profile for the cost model (default: the budget's device if it names
            one, else the current device; ``cpu`` is measured here).
        max_predictions: Most memory predictions before giving the best found.
        progress: Called with a short message as the search advances.
        batch_size: With a SPEC: samples per optimizer step (default 8).
        seq_len: With a SPEC: tokens per sample (default 128).

    Returns:
        The :class:`PlanResult`.

    Raises:
        ValueError: for a malformed budget or an unknown allow/forbid value.
        NothingFits: when no allowed plan fits; ``.result`` holds the closest plan.
    """
    from ..estimate.compose import _reduced, predict_peak
    from ..estimate.cost import profile_workload, step_cost
    from ..estimate.dryrun import dry_run
    from ..targets import get_device, parse_budget

    started = time.perf_counter()
    say = progress or (lambda msg: None)
    if isinstance(workload, str):
        from ..workload import load_workload

        workload = load_workload(workload, batch_size or 8, seq_len or 128)
    allow = _check_names(allow, ALLOW, "--allow")
    forbid = _check_names(forbid, FORBID, "--forbid")
    budget_bytes, budget_device = parse_budget(budget)
    profile_device = get_device(device) if device else (budget_device or get_device(None))
    base = base or Plan()
    if (
        profile_device.name != "cpu"
        and base.optimizer.foreach is None
        and base.optimizer.name
        in (
            "adamw",
            "adam",
            "sgd",
        )
    ):
        # Dry runs happen on CPU, where torch's optimizers default to the per-tensor loop; on a
        # GPU their default is foreach, which costs a parameter-sized temporary: plan for it.
        base = base.replace(optimizer=dataclasses.replace(base.optimizer, foreach=True))

    say("profiling the workload (FLOPs, activations) on fake tensors")
    profile = profile_workload(workload)
    trainable = _trainable_fractions(workload) if "freeze" in allow else {}

    def cost_of(p: Plan):
        frac = trainable.get(tuple(p.freeze), 1.0)
        return step_cost(
            profile, p, profile_device, batch_size=workload.batch_size, trainable_fraction=frac
        )

    baseline = cost_of(Plan(optimizer=base.optimizer)).total
    candidates = [
        Candidate(plan=p, rank=r, step_time=(c := cost_of(p)).total, cost_terms=c.to_dict())
        for p, r in _space(workload, base, allow, forbid, profile_device)
    ]
    for c in candidates:
        c.ratio = c.step_time / baseline
    # Fastest first; among candidates within 2% of each other (a tie for the cost model), the
    # more frugal first, so the first that fits is found with fewer memory predictions.
    candidates.sort(
        key=lambda c: (math.floor(math.log(max(c.step_time, 1e-12)) / math.log(1.02)), -sum(c.rank))
    )

    predicted: list[Candidate] = []
    misfits: list[tuple[int, ...]] = []

    def predict(c: Candidate) -> bool:
        say(f"predicting memory: {c.plan.summary()}")
        pred = predict_peak(workload, c.plan, device=profile_device)
        c.peak_bytes, c.by_category = pred.peak_bytes, pred.by_category
        c.reserved_bytes, c.device_total_bytes = pred.reserved_bytes, pred.device_total_bytes
        c.fits = pred.device_total_bytes <= budget_bytes
        c.note = f"{pred.method}, peak in {pred.peak_phase}"
        predicted.append(c)
        if not c.fits:
            misfits.append(c.rank)
        return bool(c.fits)

    # Memory is not monotone in the micro-batch once the step is fused into backward, so two
    # frugal seeds stand for "the least memory": the smallest micro-batch with everything else
    # at its most frugal, and the whole batch with the fused step.
    def frugal(pred: Callable[[Candidate], bool]) -> Candidate | None:
        pool = [c for c in candidates if pred(c)]
        return max(pool, key=lambda c: (sum(c.rank[1:]), c.rank[0], -c.step_time)) if pool else None

    seeds = [
        s
        for s in (
            frugal(
                lambda c: (
                    c.plan.grad_accum_steps == max(x.plan.grad_accum_steps for x in candidates)
                )
            ),
            frugal(lambda c: c.plan.optimizer_in_backward and c.plan.grad_accum_steps == 1),
        )
        if s is not None
    ]
    winner: Candidate | None = None
    if any([predict(s) for s in seeds]):
        for c in candidates:
            if len(predicted) >= max_predictions:
                break
            if c.fits is False or _dominated(c.rank, misfits):
                continue
            if c.fits is None and not predict(c):
                continue
            # Confirm with one dry run at full depth (two micro-batches stand for all).
            say(f"confirming at full size: {c.plan.summary()}")
            small_wl, small_plan, scale = _reduced(workload, c.plan)
            report = dry_run(small_wl, small_plan, steps=2, device=profile_device)
            by_cat = dict(report.peak_by_category)
            grown = round(by_cat["inputs"] * scale) - by_cat["inputs"]
            by_cat["inputs"] += grown
            peak = sum(by_cat.values())
            c.peak_bytes, c.by_category = peak, by_cat
            c.reserved_bytes = max((report.peak_reserved_bytes or 0) + grown, peak)
            c.device_total_bytes = _device_total(c.reserved_bytes, profile_device)
            c.note += f"; confirmed by a full-depth dry run: {c.device_total_bytes} bytes"
            if c.device_total_bytes <= budget_bytes:
                winner = c
                break
            c.fits = False
            misfits.append(c.rank)
    predicted.sort(key=lambda c: c.step_time)
    seconds = time.perf_counter() - started
    frontier = [c.plan for c in predicted if c.fits]

    if winner is None:
        closest = min(
            (c for c in predicted if c.device_total_bytes is not None),
            key=lambda c: c.device_total_bytes or 0,
        )
        result = PlanResult(
            fits=False,
            plan=closest.plan,
            budget_bytes=budget_bytes,
            predicted_peak_bytes=int(closest.peak_bytes or 0),
            predicted_peak_by_category=dict(closest.by_category or {}),
            predicted_step_time_ratio=closest.ratio,
            candidates=predicted,
            frontier=[],
            explanation="",
            device=profile_device.name,
            seconds=seconds,
            predicted_peak_reserved_bytes=int(closest.reserved_bytes or 0),
            predicted_device_total_bytes=int(closest.device_total_bytes or 0),
        )
        message = _nothing_fits_message(result, allow, profile_device)
        result.explanation = message
        raise NothingFits(result, message)

    faster_misfits = [c for c in predicted if c.step_time < winner.step_time and c.fits is False]
    from ..units import format_bytes

    if faster_misfits:
        smallest = min(faster_misfits, key=lambda c: c.device_total_bytes or 0)
        why = (
            f"{len(faster_misfits)} faster candidate(s) were predicted over the budget (the "
            f"smallest of them, {smallest.plan.summary()}, needs "
            f"{format_bytes(smallest.device_total_bytes or 0)}); this is the fastest predicted "
            f"plan that fits, confirmed at {format_bytes(winner.device_total_bytes or 0)} of "
            f"{format_bytes(budget_bytes)}."
        )
    else:
        why = (
            "the fastest plan in the search already fits: "
            f"{format_bytes(winner.device_total_bytes or 0)} of {format_bytes(budget_bytes)}."
        )
    why += " " + _what_fits(profile_device, winner)
    return PlanResult(
        fits=True,
        plan=winner.plan,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=int(winner.peak_bytes or 0),
        predicted_peak_by_category=dict(winner.by_category or {}),
        predicted_step_time_ratio=winner.ratio,
        candidates=predicted,
        frontier=[winner.plan] + [p for p in frontier if p is not winner.plan and p != winner.plan],
        explanation=why,
        device=profile_device.name,
        seconds=seconds,
        predicted_peak_reserved_bytes=int(winner.reserved_bytes or 0),
        predicted_device_total_bytes=int(winner.device_total_bytes or 0),
    )


def _device_total(reserved: int, target: DeviceProfile) -> int:
    """What ``target`` holds when its allocator has ``reserved`` bytes: the CUDA context and
    workspaces come on top on a GPU; the CPU holds the tensors."""
    return reserved + (target.overhead_bytes if target.is_cuda else 0)


def _what_fits(target: DeviceProfile, winner: Candidate) -> str:
    from ..units import format_bytes

    if not target.is_cuda:
        return "Fitted: the tensors' peak (the CPU has no caching allocator)."
    return (
        f"Fitted on {target.name}: the device total, {format_bytes(winner.peak_bytes or 0)} of "
        f"tensors, {format_bytes(winner.reserved_bytes or 0)} reserved by the caching allocator "
        f"(model), plus {format_bytes(target.overhead_bytes)} of CUDA context and workspaces."
    )


def _nothing_fits_message(result: PlanResult, allow: Sequence[str], target: DeviceProfile) -> str:
    from ..units import format_bytes

    missing = [a for a in ALLOW if a not in allow]
    hint = (
        f"allowing {', '.join(missing)} (--allow {','.join(missing)})"
        if missing
        else "offloading to host memory (not yet available) or a smaller batch or sequence"
    )
    need = result.predicted_device_total_bytes or result.predicted_peak_bytes
    what = (
        f"the smallest device total reachable on {target.name} is {format_bytes(need)} "
        f"({format_bytes(result.predicted_peak_bytes)} of tensors; the caching allocator's "
        "reserve and the CUDA context included)"
        if target.is_cuda
        else f"the smallest peak reachable is {format_bytes(need)}"
    )
    return (
        f"Nothing fits in {format_bytes(result.budget_bytes)}: {what}, with "
        f"{result.plan.summary()}. It would need a budget of at least {format_bytes(need)}, "
        f"or {hint}."
    )
