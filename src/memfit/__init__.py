"""memfit: make PyTorch training fit in a memory budget.

Measure where training memory goes (:func:`track`, :func:`dry_run`), predict what fits, and
apply the techniques that make it fit (:class:`Plan`).

Applying a plan has one signature, ``(model, plan=None, *, optimizer=None, loss_fn=None,
keep_original_weights=False)``:
:func:`prepare` is the entry point for a training loop of your own (whole-batch ``step`` or
micro-batch ``accumulate``/``backward``); :func:`apply_plan` returns the bare
``TrainingSetup`` it wraps (``step``, ``stepper``, ``remove``), which the Trainer and the OOM
fallback use. Both refuse a plan passed where the optimizer goes, and the reverse.

Every error memfit raises on purpose is a :class:`MemfitError`; a wrong argument to a public
function is a :class:`MemfitTypeError` (a ``TypeError``) or a :class:`MemfitValueError` (a
``ValueError``) whose one sentence names the argument, what was given and what is accepted;
a call at the wrong moment (a tracker's ``report()`` before its block ran) a
:class:`MemfitStateError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .versions import __version__, check_versions

check_versions()  # before anything uses torch: an unsupported one is named in one sentence

from .accounting import CATEGORIES, MemoryReport, MemoryTracker, track  # noqa: E402
from .errors import (  # noqa: E402
    MemfitError,
    MemfitStateError,
    MemfitTypeError,
    MemfitValueError,
)
from .plan import Plan, PlanError  # noqa: E402
from .units import format_bytes, parse_size  # noqa: E402
from .workload import PRESETS, Workload, WorkloadError, load_workload  # noqa: E402

if TYPE_CHECKING:  # the lazy names below, for type checkers and editors
    from collections.abc import Callable, Iterable

    from .apply.compose import TrainingSetup, apply_plan
    from .estimate.dryrun import dry_run, measure
    from .planner import NothingFits, PlanResult
    from .planner.maximize import Maximized, maximize
    from .strategies.fused_step import optimizer_in_backward
    from .targets import DeviceProfile
    from .train import Prepared, TrainConfig, Trainer, prepare
    from .train.job import JobPhases, measure_job, predict_job

__all__ = [
    "CATEGORIES",
    "PRESETS",
    "JobPhases",
    "Maximized",
    "MemfitError",
    "MemfitStateError",
    "MemfitTypeError",
    "MemfitValueError",
    "MemoryReport",
    "MemoryTracker",
    "NothingFits",
    "Plan",
    "PlanError",
    "PlanResult",
    "Prepared",
    "TrainConfig",
    "Trainer",
    "TrainingSetup",
    "Workload",
    "WorkloadError",
    "__version__",
    "apply_plan",
    "dry_run",
    "format_bytes",
    "load_workload",
    "maximize",
    "measure",
    "measure_job",
    "optimizer_in_backward",
    "parse_size",
    "plan",
    "predict_job",
    "prepare",
    "track",
]

# Heavier parts load on first use, so `import memfit` stays cheap.
_LAZY = {
    "dry_run": ("memfit.estimate.dryrun", "dry_run"),
    "measure": ("memfit.estimate.dryrun", "measure"),
    "apply_plan": ("memfit.apply.compose", "apply_plan"),
    "TrainingSetup": ("memfit.apply.compose", "TrainingSetup"),
    "optimizer_in_backward": ("memfit.strategies.fused_step", "optimizer_in_backward"),
    "Trainer": ("memfit.train", "Trainer"),
    "TrainConfig": ("memfit.train", "TrainConfig"),
    "prepare": ("memfit.train", "prepare"),
    "Prepared": ("memfit.train", "Prepared"),
    "PlanResult": ("memfit.planner", "PlanResult"),
    "NothingFits": ("memfit.planner", "NothingFits"),
    "maximize": ("memfit.planner.maximize", "maximize"),
    "Maximized": ("memfit.planner.maximize", "Maximized"),
    "predict_job": ("memfit.train.job", "predict_job"),
    "measure_job": ("memfit.train.job", "measure_job"),
    "JobPhases": ("memfit.train.job", "JobPhases"),
}


def plan(
    workload: Workload | str,
    budget: int | str,
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    allow: Iterable[str] = (),
    forbid: Iterable[str] = (),
    base: Plan | None = None,
    device: str | DeviceProfile | None = None,
    max_predictions: int = 60,
    progress: Callable[[str], None] | None = None,
    host_budget: int | str | None = None,
    disk_dir: str | None = None,
    jobs: int = 2,
    lora_rank: int | None = None,
    expert_load: float = 1.0,
) -> PlanResult:
    """Find the fastest plan whose peak fits ``budget``: :func:`memfit.planner.plan`, whose
    parameters these are (written out here so that ``import memfit`` does not load the
    planner; a test keeps the two signatures equal).

    ``workload`` is a :class:`Workload` or a SPEC (then pass ``batch_size`` and ``seq_len``).

    ``memfit.plan`` is this function, also after ``import memfit.plan``: the module of that
    name (where :class:`Plan` lives) is reached with ``from memfit.plan import Plan``, and the
    function carries the module's public names, so ``memfit.plan.Plan`` is the class too.
    """
    from .planner import plan as _plan

    return _plan(
        workload,
        budget,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        batch_size=batch_size,
        seq_len=seq_len,
        allow=allow,
        forbid=forbid,
        base=base,
        device=device,
        max_predictions=max_predictions,
        progress=progress,
        host_budget=host_budget,
        disk_dir=disk_dir,
        jobs=jobs,
        lora_rank=lora_rank,
        expert_load=expert_load,
    )


plan.Plan = Plan  # type: ignore[attr-defined]
plan.PlanError = PlanError  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, as if they were loaded (tab completion, help(), dir()).
    return sorted({*globals(), *_LAZY})
