"""Each rank's memory under data parallelism, predicted without launching a process.

A rank's dry run (:func:`memfit.estimate.dryrun.measure` on fake tensors) runs inside a fake
process group (torch's ``fake`` backend with a ``FakeStore``): FSDP2 then runs its real code,
shards the real parameter layout and allocates its real all-gather and reduce-scatter buffers,
while the collectives move nothing. That is the approach of torchtitan's memory estimator.
DDP's C++ constructor reads parameter values, which fake tensors lack, so a dry run stands in
DDP's buckets by memfit's contiguous gradient buffer (the same bytes, held the same way, rebuilt
once as DDP does; see :mod:`memfit.distributed.data`). ``ZeroRedundancyOptimizer`` runs for
real on the fake group.

What torch lacks and this adds: one call that gives every rank's predicted peak for any world
size, each rank's device total on a CUDA target with its NCCL communicators
(:mod:`memfit.estimate.nccl`), and the ZeRO paper's model-state formulas to check it against
(:func:`zero_model_state_bytes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..accounting.report import MemoryReport
from ..plan import Plan
from ..targets import DeviceProfile
from ..workload import Workload, load_workload

__all__ = [
    "RankPrediction",
    "fake_process_group",
    "predict_ranks",
    "zero_model_state_bytes",
]

#: World sizes up to this are dry-run rank by rank; beyond it the first and last ranks are
#: (FSDP2's shards and ZeRO-1's partitions are largest on the first ranks, padding and the
#: smallest partitions on the last) and the ranks between take the first rank's figure.
EVERY_RANK_UP_TO = 4


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of ``world_size`` in which this process is ``rank`` and collectives
    do nothing (torch's ``fake`` backend), for a dry run of one rank.

    Raises:
        RuntimeError: when a real process group is already initialised here.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a per-rank prediction needs its own fake process group, but this process is "
            "already in a process group; predict from a single process (memfit plan "
            "--world-size N) instead of under the launcher"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's cache of sharding decisions. It is keyed by device meshes, which
    compare equal across process groups (same shape, names and ranks): a later fake world would
    be handed an earlier one's mesh, whose process groups are gone (the names only resolved
    while every world happened to create its groups in the same order)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    # The C++ dispatch fast path keeps its own copy of the decisions.
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


class RankPrediction:
    """Every rank's predicted memory for one plan.

    Attributes:
        plan: The plan.
        peak_bytes: Predicted peak per rank (rank order; length ``plan.parallel.data``).
        reports: The dry-run report of each rank that was dry-run.
        measured_ranks: The ranks that were dry-run (the others take rank 0's figure).
        nccl_bytes: Each rank's NCCL communicator bytes (0 on the CPU and for one process).
        device_total_bytes: Each rank's predicted device total: its allocator's reserved peak,
            the CUDA context and workspaces, and its ``nccl_bytes``.
    """

    def __init__(self, plan: Plan, peak_bytes: list[int], reports: dict[int, MemoryReport],
                 nccl_bytes: list[int] | None = None):
        self.plan = plan
        self.peak_bytes = peak_bytes
        self.reports = reports
        self.measured_ranks = sorted(reports)
        self.nccl_bytes = list(nccl_bytes) if nccl_bytes is not None else [0] * len(peak_bytes)
        # A rank not dry-run holds rank 0's tensors with its own communicators.
        base = reports.get(0) or next(iter(reports.values()))
        self.device_total_bytes = [
            reports[r].device_total_bytes if r in reports
            else base.device_total_bytes - base.meta.get("nccl_bytes", 0) + self.nccl_bytes[r]
            for r in range(len(peak_bytes))
        ]

    @property
    def max_peak_bytes(self) -> int:
        """The largest rank's peak: what must fit the per-rank budget."""
        return max(self.peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``predicted_peak_bytes``, ``nccl_bytes`` and
        ``predicted_device_total_bytes`` per rank, the largest peak, and which ranks ran."""
        return {
            "predicted_peak_bytes": list(self.peak_bytes),
            "nccl_bytes": list(self.nccl_bytes),
            "predicted_device_total_bytes": list(self.device_total_bytes),
            "predicted_max_rank_peak_bytes": self.max_peak_bytes,
            "dry_run_ranks": self.measured_ranks,
            "predicted_peak_by_category": {
                str(r): rep.peak_by_category for r, rep in self.reports.items()
            },
        }


def predict_ranks(
    workload: Workload | str,
    plan: Plan,
    *,
    steps: int = 3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str | DeviceProfile | None = None,
    seed: int = 0,
    gpus_per_node: int = 8,
    expert_load: float = 1.0,
) -> RankPrediction:
    """Predict each rank's peak for ``plan`` (its ``parallel.data`` ranks) by dry runs.

    Args:
        workload: The workload; its batch is the global batch (each rank trains on
            ``batch / data``).
        plan: The plan, with ``parallel`` set.
        steps: Steps per dry run (3: DDP rebuilds its buckets once, at the second step).
        batch_size: With a SPEC: the global batch (default 8).
        seq_len: With a SPEC: tokens per sample (default 128).
        device: The target device of the dry runs (:func:`~memfit.estimate.dryrun.measure`'s;
            default: this machine's own). On a CUDA target each rank's device total includes
            its NCCL communicators (:func:`~memfit.estimate.nccl.rank_target`).
        seed: Seed for model initialisation and the batch.
        gpus_per_node: Devices per node (which of a group's ranks share a node).
        expert_load: Mixture-of-experts routing in every rank's dry run (:func:`~memfit.
            estimate.dryrun.measure`'s): ``1`` balanced; ``c > 1`` expert 0 takes ``c`` times
            its share of every rank's tokens, so with ``parallel.expert > 1`` the first rank
            of each expert group receives the most (``memfit profile --expert-load``).

    Raises:
        ValueError: when the data-parallel degree does not divide the batch, or for an
            ``NCCL_*`` setting NCCL would not take.
    """
    from ..targets import get_device
    from .dryrun import measure
    from .nccl import NcclSettings, rank_target

    target = get_device(device)
    settings = NcclSettings.from_env()
    if isinstance(workload, str):
        workload = load_workload(workload, batch_size or 8, seq_len or 128)
    world = plan.parallel.data
    if workload.batch_size % world:
        raise ValueError(
            f"a batch of {workload.batch_size} samples cannot be split evenly over {world} "
            f"processes; use a batch size that is a multiple of {world}"
        )
    def on(rank: int) -> DeviceProfile:
        return rank_target(target, plan.parallel, rank, gpus_per_node=gpus_per_node,
                           settings=settings)

    if world == 1 and plan.parallel.zero_stage == 0:
        report = measure(workload, plan, steps=steps, dry=True, device=on(0), seed=seed,
                         expert_load=expert_load)
        return RankPrediction(plan, [int(report.peak_bytes)], {0: report}, [0])
    if world <= EVERY_RANK_UP_TO:
        ranks = list(range(world))
    elif plan.parallel.zero_stage == 0 and plan.parallel.expert == 1:
        ranks = [0]  # every rank holds the same
    else:
        ranks = [0, world - 1]
    reports: dict[int, MemoryReport] = {}
    for rank in ranks:
        with fake_process_group(world, rank):
            reports[rank] = measure(workload, plan, steps=steps, dry=True, device=on(rank),
                                    seed=seed, expert_load=expert_load)
    peaks = [int(reports.get(r, reports[0]).peak_bytes) for r in range(world)]
    return RankPrediction(plan, peaks, reports, [on(r).nccl_bytes for r in range(world)])


def zero_model_state_bytes(
    num_parameters: int,
    world: int,
    stage: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    state_bytes: int = 8,
    master_bytes: int = 0,
) -> float:
    """The ZeRO paper's model-state bytes per rank.

    With ``P`` parameters, ``N`` ranks, ``K`` bytes of optimizer state (and fp32 masters, for
    mixed precision) per parameter: stage 0 holds everything, ``(p + g + K) P``; stage 1
    shards the state, ``(p + g) P + K P / N``; stage 2 the gradients too, ``p P + (g + K) P /
    N``; stage 3 everything, ``(p + g + K) P / N``. Mixed-precision Adam (``p = g = 2``,
    ``K = 12``) gives the paper's ``4P + 12P/N``, ``2P + 14P/N`` and ``16P/N``.

    Args:
        num_parameters: ``P``.
        world: ``N``.
        stage: 0-3.
        param_bytes: Bytes per parameter as the model holds it (``p``).
        grad_bytes: Bytes per gradient element (``g``).
        state_bytes: Optimizer state bytes per parameter (8 for Adam's two fp32 moments).
        master_bytes: fp32 master weight bytes per parameter (4 with a low-precision model,
            counted with the state).
    """
    p, g, k, n = param_bytes, grad_bytes, state_bytes + master_bytes, world
    per = {
        0: p + g + k,
        1: p + g + k / n,
        2: p + (g + k) / n,
        3: (p + g + k) / n,
    }[stage]
    return num_parameters * per
