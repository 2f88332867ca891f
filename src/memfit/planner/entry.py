"""``memfit.planner.plan``: one process (:mod:`memfit.planner.search`) or several
(:mod:`memfit.planner.parallel`)."""

from __future__ import annotations

from typing import Any

from ..workload import Workload
from . import search
from .parallel import plan_parallel
from .result import PlanResult

__all__ = ["plan"]


def plan(
    workload: Workload | str,
    budget: int | str,
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    **kwargs: Any,
) -> PlanResult:
    """Find the fastest plan whose peak fits ``budget``.

    Args:
        workload: The workload at its full (global) batch, or a SPEC.
        budget: Bytes, a size string (``4GiB``) or a device name (``t4``); per process with
            ``world_size``.
        world_size: Plan for this many data-parallel processes: the ZeRO stage is chosen too
            and the result lists each rank's predicted peak
            (:func:`~memfit.planner.parallel.plan_parallel`). ``None``: one process.
        gpus_per_node: With ``world_size``: devices per node, which turns on the 3-D search
            (data x tensor x pipeline degrees, :func:`~memfit.planner.layout.plan_layout`);
            tensor parallelism stays within a node. That search keeps the plan's precision
            and optimizer and offloads nothing: it refuses ``allow`` values and ``disk_dir``
            with a ``ValueError`` rather than ignore them.
        **kwargs: The search's settings (``batch_size``, ``seq_len``, ``allow``, ``forbid``,
            ``base``, ``device``, ``max_predictions``, ``progress``, ``host_budget``,
            ``disk_dir``, ``jobs``): see :func:`memfit.planner.search.plan`.

    Raises:
        TypeError: for a keyword none of the searches takes.
        ValueError: for a malformed budget, an unknown allow/forbid value, an option the
            chosen search cannot honour, or a world size that does not divide the batch.
        NothingFits: when no allowed plan fits; ``.result`` holds the closest plan.
    """
    if gpus_per_node is not None:
        if world_size is None:
            raise ValueError("--gpus-per-node describes the machines of --world-size; give both")
        from .layout import plan_layout

        return plan_layout(workload, budget, world_size, gpus_per_node, **kwargs)
    if world_size is not None:
        return plan_parallel(workload, budget, world_size, **kwargs)
    return search.plan(workload, budget, **kwargs)
