"""The planner's explanation table: the candidates it weighed, and why the winner won."""

from __future__ import annotations

from typing import Any

from ..units import format_bytes
from .search import PlanResult

__all__ = ["explain_table"]

_SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_state": "state",
    "activations": "acts",
}


def explain_table(result: PlanResult, limit: int = 15) -> Any:
    """A rich renderable: predicted peak by category and relative step time per candidate."""
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
    shown = result.candidates[:limit]
    for c in shown:
        cats = c.by_category or {}
        other = sum(v for k, v in cats.items() if k not in _SHORT)
        winner = c.plan == result.plan
        table.add_row(
            ("★ " if winner else "") + c.plan.summary(),
            f"{c.ratio:.2f}x",
            format_bytes(c.peak_bytes or 0),
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
