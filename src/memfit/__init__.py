"""memfit: make PyTorch training fit in a memory budget.

Measure where training memory goes (:func:`track`, :func:`dry_run`), predict what fits, and
apply the techniques that make it fit (:class:`Plan`).

Applying a plan has one signature, ``(model, plan=None, *, optimizer=None, loss_fn=None,
keep_original_weights=False)``:
:func:`prepare` is the entry point for a training loop of your own (whole-batch ``step`` or
micro-batch ``accumulate``/``backward``); :func:`apply_plan` returns the bare
``TrainingSetup`` it wraps (``step``, ``stepper``, ``remove``), which the Trainer and the OOM
fallback use. Both refuse a plan passed where the optimizer goes, and the reverse.
"""

from __future__ import annotations

from typing import Any

from .versions import __version__, check_versions

check_versions()  # before anything uses torch: an unsupported one is named in one sentence

from .accounting import CATEGORIES, MemoryReport, MemoryTracker, track  # noqa: E402
from .plan import Plan, PlanError  # noqa: E402
from .units import format_bytes, parse_size  # noqa: E402
from .workload import PRESETS, Workload, WorkloadError, load_workload  # noqa: E402

__all__ = [
    "CATEGORIES",
    "PRESETS",
    "MemoryReport",
    "MemoryTracker",
    "NothingFits",
    "Plan",
    "PlanError",
    "PlanResult",
    "Trainer",
    "Workload",
    "WorkloadError",
    "__version__",
    "apply_plan",
    "dry_run",
    "format_bytes",
    "load_workload",
    "measure",
    "optimizer_in_backward",
    "parse_size",
    "plan",
    "prepare",
    "track",
]

# Heavier parts load on first use, so `import memfit` stays cheap.
_LAZY = {
    "dry_run": ("memfit.estimate.dryrun", "dry_run"),
    "measure": ("memfit.estimate.dryrun", "measure"),
    "apply_plan": ("memfit.apply.compose", "apply_plan"),
    "optimizer_in_backward": ("memfit.strategies.fused_step", "optimizer_in_backward"),
    "Trainer": ("memfit.train", "Trainer"),
    "prepare": ("memfit.train", "prepare"),
    "PlanResult": ("memfit.planner", "PlanResult"),
    "NothingFits": ("memfit.planner", "NothingFits"),
}


def plan(workload: Any, budget: int | str, **kwargs: Any) -> Any:
    """Find the fastest plan whose peak fits ``budget``: see :func:`memfit.planner.plan`.

    ``workload`` is a :class:`Workload` or a SPEC (then pass ``batch_size`` and ``seq_len``).

    ``memfit.plan`` is this function, also after ``import memfit.plan``: the module of that
    name (where :class:`Plan` lives) is reached with ``from memfit.plan import Plan``, and the
    function carries the module's public names, so ``memfit.plan.Plan`` is the class too.
    """
    from .planner import plan as _plan

    return _plan(workload, budget, **kwargs)


plan.Plan = Plan  # type: ignore[attr-defined]
plan.PlanError = PlanError  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
