"""``memfit.planner.plan``: one process (:mod:`memfit.planner.search`) or several
(:mod:`memfit.planner.parallel`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..plan import Plan
from ..targets import DeviceProfile
from ..workload import Workload
from . import search
from .arguments import check_plan_arguments
from .parallel import plan_parallel
from .result import PlanResult

__all__ = ["plan"]


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
    """Find the fastest plan whose peak fits ``budget``.

    Args:
        workload: The workload at its full (global) batch, or a SPEC (then ``batch_size`` and
            ``seq_len`` are required).
        budget: Whole bytes (an int), a size string (``4GiB``, ``4.5GiB``) or a device name
            (``t4``); per process with ``world_size``. A bare number that is not whole
            (``4.5``) is refused, not truncated.
        world_size: Plan for this many data-parallel processes: the ZeRO stage is chosen too
            and the result lists each rank's predicted peak
            (:func:`~memfit.planner.parallel.plan_parallel`). ``None``: one process.
        gpus_per_node: With ``world_size``: devices per node, which turns on the 3-D search
            (data x tensor x pipeline degrees, :func:`~memfit.planner.layout.plan_layout`);
            tensor parallelism stays within a node. That search keeps the plan's precision
            and optimizer and offloads nothing: it refuses ``allow`` values and ``disk_dir``
            with a ``ValueError`` rather than ignore them.
        batch_size: With a SPEC (required): samples per optimizer step, over all processes.
        seq_len: With a SPEC (required): tokens per sample.
        allow: Techniques that change training or use host memory, and need consent, as a
            name, names separated by commas (``"lora,qlora"``, as on the CLI) or a list:
            ``freeze``, ``shorter-seq``, ``8bit``, ``factored``, ``bf16-pure``, ``fp8`` (targets
            of compute capability 8.9+), ``offload``.
        forbid: Default techniques to rule out (a name, comma-separated names or a list):
            ``accumulation``, ``checkpointing``, ``full-checkpointing``, ``mixed-precision``,
            ``fused-step``, ``foreach-off``, ``fused-loss``.
        base: The user's plan to start from (its optimizer family and settings are kept).
        device: Device profile for the cost model (default: the budget's device if it names
            one, else the current device; ``cpu`` is measured here).
        max_predictions: Most memory predictions before giving the best found.
        progress: Called with a short message as the search advances.
        host_budget: Host memory the offload tiers may use (bytes or a size string; ``None``:
            not checked).
        disk_dir: With ``offload`` allowed, a directory for the ``disk`` tier.
        jobs: Processes the search may use (see :func:`memfit.planner.search.plan`).
        lora_rank: The LoRA rank tried with ``lora`` or ``qlora`` allowed (default 16; one
            process only).
        expert_load: With ``gpus_per_node``: the mixture-of-experts routing each layout must
            fit (``1`` balanced; ``c > 1``: the rank holding expert 0 receives ``c`` times its
            share of expert 0's tokens, as ``memfit profile --expert-load`` assumes).

    The settings from ``batch_size`` on are :func:`memfit.planner.search.plan`'s, and mean
    the same to the searches over several processes.

    Raises:
        MemfitTypeError: for an argument of a kind it does not accept (``workload=None``, a
            bare ``nn.Module``, ``base="bf16"``, ``device=123``), before any work.
        MemfitValueError: for a malformed budget, an unknown allow/forbid value, a SPEC
            without ``batch_size`` and ``seq_len``, an option the chosen search cannot honour,
            or a world size that does not divide the batch (a ``ValueError``).
        NothingFits: when no allowed plan fits; ``.result`` holds the closest plan.
    """
    # Every argument is checked before any work (issue 37); what the searches share comes
    # back normalised (allow/forbid as tuples of names; lora_rank only when given).
    settings = check_plan_arguments(**locals())
    if gpus_per_node is not None:
        from .layout import plan_layout

        return plan_layout(workload, budget, world_size, gpus_per_node, **settings,
                           expert_load=expert_load)
    if world_size is not None:
        return plan_parallel(workload, budget, world_size, **settings)
    return search.plan(workload, budget, **settings)
