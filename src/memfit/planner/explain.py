"""The planner's explanations: why the winner won, why nothing fits, and the table of the
candidates it weighed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..strategies.fp8 import fp8_problem
from ..targets import DeviceProfile
from ..units import format_bytes
from .candidates import allow_names
from .costing import TIE_RULE
from .result import Candidate, PlanResult

__all__ = ["explain_table", "nothing_fits_message", "why_it_won"]

_SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_state": "state",
    "activations": "acts",
}


def explain_table(result: PlanResult, limit: int = 15) -> Any:
    """A rich renderable: predicted peak by category and relative step time per candidate.

    The first ``limit`` candidates, the chosen plan always among them (in the last row when it
    ranks later), then the verdict."""
    from rich.console import Group
    from rich.table import Table

    table = Table(
        title=f"Candidates weighed against a budget of {format_bytes(result.budget_bytes)} "
        f"(cost model: {result.device})",
        title_justify="left",
    )
    table.add_column("plan")
    table.add_column("time", justify="right")
    table.add_column("peak", justify="right")
    for short in _SHORT.values():
        table.add_column(short, justify="right")
    table.add_column("other", justify="right")
    table.add_column("fits", justify="center")
    shown = _shown(result, limit)
    for c in shown:
        cats = c.by_category or {}
        other = sum(v for k, v in cats.items() if k not in _SHORT)
        winner = c.plan == result.plan
        table.add_row(
            ("★ " if winner else "") + c.plan.summary(),
            f"{c.ratio:.2f}x",
            ("≥ " if c.at_least else "") + format_bytes(c.peak_bytes or 0),
            *(format_bytes(cats.get(k, 0)) for k in _SHORT),
            format_bytes(other),
            "yes" if c.fits else "no",
            style="bold green" if winner else None,
        )
    more = len(result.candidates) - len(shown)
    notes = [table]
    if more > 0:
        notes.append(f"(+{more} more candidates in the JSON)")
    verdict = "Winner" if result.fits else "Closest"
    notes.append(f"{verdict}: {result.plan.summary()}: {result.explanation}")
    return Group(*notes)


def _shown(result: PlanResult, limit: int) -> list[Candidate]:
    """The candidates the table lists: the first ``limit``, the winner always among them."""
    shown = list(result.candidates[: max(limit, 1)])
    if any(c.plan == result.plan for c in shown):
        return shown
    winner = next((c for c in result.candidates if c.plan == result.plan), None)
    return shown if winner is None else [*shown[:-1], winner]


def why_it_won(
    winner: Candidate,
    predicted: Sequence[Candidate],
    budget_bytes: int,
    target: DeviceProfile,
    ties: Sequence[Candidate] = (),
) -> str:
    """Why ``winner`` won: the faster candidates that did not fit, and what was fitted.

    ``ties`` are the candidates the cost model predicts faster by less than it resolves,
    which the tie rule (:data:`~memfit.planner.costing.TIE_RULE`) put after the winner."""
    faster_misfits = [c for c in predicted if c.step_time < winner.step_time and c.fits is False]
    total = format_bytes(winner.device_total_bytes or 0)
    if faster_misfits:
        smallest = min(faster_misfits, key=lambda c: c.device_total_bytes or 0)
        why = (
            f"{len(faster_misfits)} faster candidate(s) were predicted over the budget (the "
            f"smallest of them, {smallest.plan.summary()}, needs "
            f"{'at least ' if smallest.at_least else ''}"
            f"{format_bytes(smallest.device_total_bytes or 0)}); this is the fastest predicted "
            f"plan that fits, confirmed at {total} of {format_bytes(budget_bytes)}."
        )
    else:
        why = (
            f"the fastest plan in the search already fits: {total} of "
            f"{format_bytes(budget_bytes)}."
        )
    if ties:
        why += (
            f" {len(ties)} untried plan(s) were predicted faster by under 2% (such as "
            f"{ties[0].plan.summary()}): {TIE_RULE}."
        )
    moved = _what_moved(winner, target)
    return why + " " + _what_fits(target, winner) + (" " + moved if moved else "")


def _what_moved(winner: Candidate, target: DeviceProfile) -> str:
    """What the winner moves off the device, where to, and what the cost model charges."""
    off = winner.plan.offload
    if off is None:
        return ""
    parts = []
    if off.optimizer:
        grads = "every micro-batch's" if off.gradients_on_host else "the last micro-batch's"
        when = "during backward" if winner.plan.optimizer_in_backward else "after backward"
        parts.append(
            f"fp32 master weights and optimizer state live on the {off.optimizer} and step "
            f"there {when}; {grads} gradients go down in {format_bytes(off.bucket_bytes)} "
            "buckets and the new weights come back"
        )
    if getattr(off, "parameters", None):
        parts.append(f"parameters wait on the {off.parameters} and come up one block at a time")
    if off.activations:
        parts.append("tensors saved for backward wait in host memory")
    seconds = winner.cost_terms.get("offload", 0.0)
    share = seconds / winner.step_time if winner.step_time else 0.0
    return (
        "Moved off the device: " + "; ".join(parts) + f". The cost model charges "
        f"{seconds * 1e3:.1f} ms per step for it ({share:.0%} of the step; host link "
        f"{format_bytes(int(target.host_bandwidth))}/s, host memory "
        f"{format_bytes(int(target.host_mem_bandwidth))}/s), what the transfers and the host "
        "step add beyond the compute they overlap."
    )


def _what_fits(target: DeviceProfile, winner: Candidate) -> str:
    if not target.is_cuda:
        return "Fitted: the tensors' peak (the CPU has no caching allocator)."
    return (
        f"Fitted on {target.name}: the device total, {format_bytes(winner.peak_bytes or 0)} of "
        f"tensors, {format_bytes(winner.reserved_bytes or 0)} reserved by the caching allocator "
        f"(model), plus {format_bytes(target.overhead_bytes)} of CUDA context and workspaces"
        + (f" (NCCL's communicators: {format_bytes(target.nccl_bytes)})."
           if target.nccl_bytes else ".")
    )


def nothing_fits_message(result: PlanResult, allow: Sequence[str], target: DeviceProfile) -> str:
    """The paragraph of :class:`~memfit.planner.NothingFits`: the closest plan, what it needs,
    and what to allow or change."""
    missing = [a for a in allow_names() if a not in allow]
    if "fp8" in missing and fp8_problem(target) is not None:
        missing.remove("fp8")  # the target has no float8 matmuls: allowing it would not help
    hint = (
        f"allowing {', '.join(missing)} (--allow {','.join(missing)})"
        if missing
        else "a smaller batch or sequence"
    )
    total = result.predicted_device_total_bytes or result.predicted_peak_bytes
    need = result.predicted_device_total_upper_bytes or total
    what = (
        f"the smallest device total reachable on {target.name} is {format_bytes(total)} "
        f"({format_bytes(result.predicted_peak_bytes)} of tensors; the caching allocator's "
        "reserve and the CUDA context included; up to "
        f"{format_bytes(need)} at the upper edge of its error band)"
        if target.is_cuda
        else f"the smallest peak reachable is {format_bytes(total)}"
    )
    return (
        f"Nothing fits in {format_bytes(result.budget_bytes)}: {what}, with "
        f"{result.plan.summary()}. It would need a budget of at least {format_bytes(need)}, "
        f"or {hint}."
    )
