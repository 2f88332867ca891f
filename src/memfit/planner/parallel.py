"""Plan for N data-parallel processes: the ZeRO stage and the single-device techniques.

For each ZeRO stage the single-device search (:mod:`memfit.planner.search`) runs inside a fake
process group of the world size, so every memory prediction is a rank's: its share of the
batch, and its engine's real sharding (FSDP2's code, ``ZeroRedundancyOptimizer``'s partition,
DDP's buckets; see :mod:`memfit.estimate.distributed`). The fastest fitting plan of each stage
competes; equal predicted step times go to the lower stage, which communicates no more (ZeRO
stages 0-2 move the same bytes per step as an all-reduce, stage 3 half as much again for the
second all-gather of the parameters). The winner's every rank is then predicted.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable

from ..distributed.config import ZERO_STAGES, ParallelConfig
from ..plan import Plan
from ..targets import DeviceProfile, get_device, parse_budget
from ..units import format_bytes
from ..workload import Workload, load_workload
from .result import NothingFits, PlanResult

__all__ = ["plan_parallel"]


def plan_parallel(
    workload: Workload | str,
    budget: int | str,
    world_size: int,
    *,
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
    stages: Iterable[int] = ZERO_STAGES,
) -> PlanResult:
    """The fastest plan over ``world_size`` processes whose every rank fits ``budget``.

    Args:
        workload: The workload at its global batch, or a SPEC.
        budget: Per-process budget (bytes, a size string or a device name).
        world_size: Data-parallel processes (must divide the batch).
        batch_size: With a SPEC: the global batch (default 8).
        seq_len: With a SPEC: tokens per sample (default 128).
        allow: Techniques that need consent, as :func:`memfit.planner.search.plan`'s.
        forbid: Default techniques to rule out, as :func:`memfit.planner.search.plan`'s.
        base: The user's plan to start from (its ``parallel`` settings other than the degree
            and stage are kept).
        device: Device profile for the cost model, as :func:`memfit.planner.search.plan`'s.
        max_predictions: Most memory predictions of each stage's search.
        progress: Called with a short message as the search advances.
        host_budget: Host memory each process's offload tiers may use.
        disk_dir: With ``offload`` allowed, a directory for the ``disk`` tier.
        jobs: Processes each stage's search may use.
        stages: The ZeRO stages to consider.

    Returns:
        The :class:`PlanResult`, with ``rank_peak_bytes``.

    Raises:
        ValueError: for a world size that is not a whole number >= 1 or does not divide the
            batch.
        NothingFits: when no stage fits; ``.result`` holds the closest plan.
    """
    from ..estimate.distributed import predict_ranks
    from .search import plan

    started = time.perf_counter()
    say = progress or (lambda msg: None)
    if isinstance(workload, str):
        workload = load_workload(workload, batch_size or 8, seq_len or 128)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"--world-size must be a whole number >= 1, got {world_size!r}")
    if workload.batch_size % world_size:
        raise ValueError(
            f"--world-size {world_size} does not divide the batch of {workload.batch_size} "
            f"samples; use a batch size that is a multiple of {world_size}"
        )
    base = base or Plan()
    # Every rank holds its NCCL communicators beside the context (estimate.nccl): the
    # search fits each rank's device total with them, on the device it plans for.
    budget_device = parse_budget(budget)[1]
    target = get_device(device) if device else (budget_device or get_device(None))
    # Each search plans one rank: its share of the batch (micro-batches, costs, dry runs).
    local = workload.replace(batch_size=workload.batch_size // world_size)
    search = functools.partial(
        plan,
        allow=allow,
        forbid=forbid,
        device=device,
        max_predictions=max_predictions,
        progress=progress,
        host_budget=host_budget,
        disk_dir=disk_dir,
        jobs=jobs,
    )
    results = _stage_results(local, budget, base, world_size, stages, search, say, target)
    if not results:
        raise ValueError(f"no ZeRO stage can shard the plan's optimizer {base.optimizer.name!r}")
    fitting = [r for r in results if r.fits]
    if not fitting:
        raise _nothing_fits(results, world_size)
    best = min(fitting, key=lambda r: (round(r.predicted_step_time_ratio, 3), r.plan.parallel.zero_stage))
    say(f"predicting every rank: {best.plan.summary()}")
    ranks = predict_ranks(workload, best.plan, device=target)
    best.rank_peak_bytes = list(ranks.peak_bytes)
    best.predicted_peak_bytes = ranks.max_peak_bytes
    best.explanation = _explain(best, results, world_size)
    best.seconds = time.perf_counter() - started
    return best


def _stage_results(
    local: Workload,
    budget: int | str,
    base: Plan,
    world_size: int,
    stages: Iterable[int],
    search: Callable[..., PlanResult],
    say: Callable[[str], None],
    target: DeviceProfile,
) -> list[PlanResult]:
    """Each ZeRO stage's answer (fitting or the closest) for one rank's share ``local`` of
    the batch, searched inside a fake process group of the world size on ``target`` as a
    rank sees it (its NCCL communicators counted); a stage the base plan's optimizer cannot
    be sharded by is left out."""
    from ..distributed.data import batches_are_local
    from ..estimate.distributed import fake_process_group
    from ..estimate.nccl import rank_target

    results: list[PlanResult] = []
    for stage in stages:
        par = dataclasses.replace(base.parallel, data=world_size, zero_stage=stage)
        assert isinstance(par, ParallelConfig)
        try:
            staged = base.replace(parallel=par)
        except ValueError:
            continue  # the base plan's optimizer cannot be sharded this way
        say(f"ZeRO stage {stage} on {world_size} processes")
        with fake_process_group(world_size), batches_are_local():
            try:
                # Data parallelism alone: every rank joins the same one group.
                result = search(local, budget, base=staged,
                                device=rank_target(target, staged.parallel, 0))
            except NothingFits as e:
                result = e.result
        results.append(result)
    return results


def _nothing_fits(results: list[PlanResult], world_size: int) -> NothingFits:
    """No stage fits: the closest stage's answer, its peak given to every rank."""
    closest = min(results, key=lambda r: r.predicted_peak_bytes)
    closest.rank_peak_bytes = [closest.predicted_peak_bytes] * world_size
    return NothingFits(
        closest,
        f"no plan fits {format_bytes(closest.budget_bytes)} per process on {world_size} "
        f"processes at any ZeRO stage; the closest (stage "
        f"{closest.plan.parallel.zero_stage}: {closest.plan.summary()}) needs "
        f"{format_bytes(closest.predicted_peak_bytes)}. Use more processes, allow more "
        "techniques (--allow), or a smaller batch or sequence length.",
    )


def _explain(best: PlanResult, results: list[PlanResult], world_size: int) -> str:
    """The winning stage's explanation, with how each other stage did."""
    others = ", ".join(
        f"stage {r.plan.parallel.zero_stage} "
        + (f"{r.predicted_step_time_ratio:.2f}x" if r.fits else "does not fit")
        for r in results
        if r is not best
    )
    return (
        f"ZeRO stage {best.plan.parallel.zero_stage} ({best.plan.parallel.engine}) on "
        f"{world_size} processes: {best.explanation} Other stages: {others}."
    )
