"""One interface for every memory predictor: ``predict(workload, plan, target) -> Prediction``.

memfit predicts a plan's memory in several ways, each right for some plans and some costs;
each is a :class:`Predictor` here, and each answers with one
:class:`~memfit.estimate.prediction.Prediction` (per-rank peaks, the largest rank's peak by
category, allocated and reserved bytes):

* :class:`DryRun`: the plan dry-run at full depth on fake tensors
  (:func:`~memfit.estimate.dryrun.dry_run`, two micro-batches at most, the inputs scaled back
  to the whole batch).
* :class:`Composed`: dry runs at depths 2 and 3 extrapolated to the full depth
  (:func:`~memfit.estimate.compose.predict_peak`), the full depth dry-run where that does
  not apply; what the single-process planner uses.
* :class:`Ranks`: every data-parallel rank dry-run in a fake process group
  (:func:`~memfit.estimate.distributed.predict_ranks`).
* :class:`Layout`: each pipeline rank's real program on fake tensors, replayed over its
  schedule (:func:`~memfit.estimate.layout.predict_layout`), for tensor x pipeline layouts.
* :class:`LayoutModel`: the 3-D planner's per-stage model
  (:func:`~memfit.estimate.layout_cost.estimate_layout`): one block's dry run, the rest
  counted; cheap enough to price every layout.
* :class:`Measured`: the workload's own steps run as given, on fake tensors or for real
  (:func:`~memfit.estimate.dryrun.measure`), the whole report kept: what ``memfit profile``
  shows.

Example:
    >>> from memfit.estimate.predictor import Composed
    >>> from memfit.plan import Plan
    >>> from memfit.workload import load_workload
    >>> pred = Composed().predict(load_workload("gpt2-tiny", 4, 32), Plan(), "cpu")
    >>> pred.peak_bytes > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..distributed.config import ParallelConfig
from ..plan import Plan
from ..targets import DeviceProfile, get_device
from ..workload import Workload
from .prediction import Prediction

if TYPE_CHECKING:
    from .layout_cost import LayoutCandidate

__all__ = [
    "Composed",
    "DryRun",
    "Layout",
    "LayoutModel",
    "Measured",
    "Prediction",
    "Predictor",
    "Ranks",
    "layout_prediction",
]

Target = DeviceProfile | str | None


@runtime_checkable
class Predictor(Protocol):
    """Predicts the memory of training a workload under a plan on a target."""

    def predict(self, workload: Workload, plan: Plan, target: Target) -> Prediction:
        """Every rank's peak of training ``workload`` (at its global batch) under ``plan`` on
        ``target`` (a device profile or its name; ``None``: this machine's device)."""
        ...


@dataclass(frozen=True)
class DryRun:
    """The plan dry-run at full depth: two steps, two micro-batches at most (memory does not
    grow with more), the inputs scaled back to the whole batch."""

    def predict(self, workload: Workload, plan: Plan, target: Target) -> Prediction:
        """See :class:`Predictor`."""
        from .compose import predict_peak

        return predict_peak(workload, plan, compose=False, device=get_device(target))


@dataclass(frozen=True)
class Measured:
    """The workload's own steps run as given (its whole batch, every micro-batch), on fake
    tensors or for real, and measured: the prediction keeps the run's whole report
    (:attr:`~memfit.estimate.prediction.Prediction.report`).

    Attributes:
        dry: Run on fake tensors (nothing allocated) rather than for real.
        steps: Training steps to run.
        cap: Virtual memory cap in bytes (``torch.OutOfMemoryError`` beyond it).
        seed: Seed for model initialisation and the batch.
        expert_load: Dry runs only: how a mixture-of-experts router spreads tokens.
        keep_trace: Keep a real run's allocation trace on the report too.
        progress: Called after each step with (steps done, steps in all).
    """

    dry: bool = True
    steps: int = 2
    cap: int | None = None
    seed: int = 0
    expert_load: float = 1.0
    keep_trace: bool = False
    progress: Callable[[int, int], None] | None = None

    def predict(self, workload: Workload, plan: Plan | None, target: Target) -> Prediction:
        """See :class:`Predictor` (``plan`` ``None``: the plain plan).

        Raises:
            ModelError: when the model itself fails (see
                :func:`~memfit.estimate.dryrun.measure`).
        """
        from .dryrun import measure

        device = get_device(target)
        report = measure(
            workload, plan, steps=self.steps, dry=self.dry, cap=self.cap, seed=self.seed,
            device=device, progress=self.progress, expert_load=self.expert_load,
            keep_trace=self.keep_trace,
        )
        return Prediction(
            peak_bytes=report.peak_bytes,
            by_category=dict(report.peak_by_category),
            phase_peaks=dict(report.phase_peaks),
            peak_phase=report.peak_phase,
            method="measured",
            reserved_bytes=int(report.peak_reserved_bytes or report.peak_bytes),
            overhead_bytes=report.overhead_bytes,
            target_device=device.name,
            host_bytes=int(report.peak_by_tier.get("host", 0)),
            report=report,
        )


@dataclass(frozen=True)
class Composed:
    """Dry runs at depths 2 and 3 extrapolated to the full depth (the full depth dry-run where
    the model or the plan does not compose).

    Attributes:
        budget_bytes: A device budget: the depth-3 run stops once the full depth passes it,
            and the prediction is that floor (``method`` ``"at-least"``).
    """

    budget_bytes: int | None = None

    def predict(self, workload: Workload, plan: Plan, target: Target) -> Prediction:
        """See :class:`Predictor`."""
        from .compose import predict_peak

        return predict_peak(workload, plan, device=get_device(target),
                            budget_bytes=self.budget_bytes)


@dataclass(frozen=True)
class Ranks:
    """Every data-parallel rank of the plan dry-run in a fake process group (ranks alike
    beyond a few take the first's and last's figures).

    Attributes:
        steps: Steps per dry run (3: DDP rebuilds its buckets at the second).
        seed: Seed for model initialisation and the batch.
        expert_load: How a mixture-of-experts router spreads tokens (1: evenly; c > 1: the
            rank holding expert 0 gets c times its share).
    """

    steps: int = 3
    seed: int = 0
    expert_load: float = 1.0

    def predict(self, workload: Workload, plan: Plan, target: Target) -> Prediction:
        """See :class:`Predictor`."""
        from .distributed import predict_ranks

        device = get_device(target)
        ranks = predict_ranks(workload, plan, steps=self.steps, device=device, seed=self.seed,
                              expert_load=self.expert_load)
        top = max(ranks.reports, key=lambda r: ranks.reports[r].peak_bytes)
        report = ranks.reports[top]
        return Prediction(
            peak_bytes=ranks.max_peak_bytes,
            by_category=dict(report.peak_by_category),
            phase_peaks={},
            peak_phase="",
            method="ranks",
            extra={"ranks": ranks},
            reserved_bytes=int(report.peak_reserved_bytes or report.peak_bytes),
            # The ranks' communicators differ only in layouts; the most any rank holds.
            overhead_bytes=(device.overhead_bytes - device.nccl_bytes + max(ranks.nccl_bytes)
                            if device.is_cuda else 0),
            target_device=device.name,
            host_bytes=int(report.peak_by_tier.get("host", 0)),
            rank_peak_bytes=list(ranks.peak_bytes),
        )


@dataclass(frozen=True)
class Layout:
    """Each pipeline rank's own program on fake tensors in a fake process group, replayed
    over its schedule: a tensor x pipeline layout in the plan's optimizer (the layout path's
    ones), fp32, without checkpointing. Its figures are allocated bytes; a CUDA target's
    allocator is taken to reserve :data:`ALLOCATED_SHARE` more.

    Attributes:
        gpus_per_node: Devices per node (which ranks of a group share a node: NCCL's buffers).
    """

    gpus_per_node: int = 8

    def predict(self, workload: Workload, plan: Plan, target: Target) -> Prediction:
        """See :class:`Predictor`.

        Raises:
            LayoutError: for a layout that cannot work, or a model it cannot split.
        """
        from .layout import predict_layout

        device = get_device(target)
        pred = predict_layout(workload, plan.parallel, optimizer=plan.optimizer,
                              foreach=True if device.is_cuda else None,
                              checkpointing=plan.checkpointing)
        peaks = [int(x) for x in pred.peak_bytes]
        top = max(range(len(peaks)), key=peaks.__getitem__)
        role = pred.roles.get(plan.parallel.coordinates(top)["stage"])
        cats: dict[str, int] = {}
        if role is not None:
            cats = {"parameters": role.parameter_bytes, "gradients": role.gradient_bytes,
                    "optimizer_state": role.optimizer_state_bytes}
            # The rest of the peak is the micro-batches' activations and the step's working
            # set, which the replay does not tell apart.
            cats["activations"] = max(0, peaks[top] - sum(cats.values()))
        else:  # measured by category (the PipeDream schedules' stashed versions among them)
            cats = {k: v for k, v in pred.categories.get(
                plan.parallel.coordinates(top)["stage"], {}).items() if v}
        return _rank_prediction(peaks, cats, "layout", device, {"layout": pred}, plan.parallel,
                                self.gpus_per_node)


@dataclass(frozen=True)
class LayoutModel:
    """The 3-D planner's per-stage model of a layout: one block of each rank's local shapes
    dry-run, the stage's blocks, state and micro-batches in flight counted from it.

    Attributes:
        gpus_per_node: Devices per node (tensor parallelism stays within one; the links
            between stages and replicas follow from it).
    """

    gpus_per_node: int = 8

    def predict(self, workload: Workload, plan: Plan, target: Target) -> Prediction:
        """See :class:`Predictor`.

        Raises:
            WorkloadError: for a model that is not a transformer of a known layout.
        """
        from .layout_cost import estimate_layout, model_shape

        device = get_device(target)
        par = plan.parallel
        cand = estimate_layout(
            model_shape(workload), par, batch_size=workload.batch_size,
            seq_len=workload.seq_len, checkpointing=plan.checkpointing.mode == "full",
            device=device, precision=plan.precision.mode, optimizer=plan.optimizer,
            gpus_per_node=self.gpus_per_node,
            microbatches=plan.grad_accum_steps if par.pipeline == 1 else None,
        )
        return layout_prediction(cand, device, self.gpus_per_node)


def layout_prediction(cand: LayoutCandidate, target: Target, gpus_per_node: int = 8) -> Prediction:
    """The :class:`Prediction` of a layout the 3-D planner's model priced
    (:func:`~memfit.estimate.layout_cost.estimate_layout`), each rank's NCCL communicators
    counted for nodes of ``gpus_per_node`` devices."""
    return _rank_prediction(list(cand.rank_peak_bytes), dict(cand.by_category),
                            "layout-model", get_device(target), {"layout": cand},
                            cand.parallel, gpus_per_node)


#: Share of what a CUDA caching allocator reserves that the per-rank models' tensors fill:
#: its rounding and fragmentation, which they do not follow block by block.
ALLOCATED_SHARE = 0.95


def _rank_prediction(peaks: list[int], by_category: dict[str, int], method: str,
                     device: DeviceProfile, extra: dict, parallel: ParallelConfig,
                     gpus_per_node: int = 8) -> Prediction:
    """A prediction of each rank's allocated bytes; on a CUDA target the allocator reserves
    :data:`ALLOCATED_SHARE` more, and each rank holds its NCCL communicators
    (:func:`~memfit.estimate.nccl.nccl_rank_bytes`): the figures are the rank whose reserve and
    communicators together are largest (``extra["nccl_bytes"]``: every rank's)."""
    from .nccl import nccl_rank_bytes

    top = max(peaks)
    if not device.is_cuda:
        return Prediction(peak_bytes=top, by_category=by_category, phase_peaks={},
                          peak_phase="", method=method, extra=extra, reserved_bytes=top,
                          overhead_bytes=0, target_device=device.name, rank_peak_bytes=peaks)
    nccl = nccl_rank_bytes(parallel, device, gpus_per_node=gpus_per_node)
    share = round(ALLOCATED_SHARE * 100)
    totals = [-(-p * 100 // share) + n for p, n in zip(peaks, nccl, strict=True)]
    worst = max(range(len(peaks)), key=totals.__getitem__)
    return Prediction(
        peak_bytes=top,
        by_category=by_category,
        phase_peaks={},
        peak_phase="",
        method=method,
        extra={**extra, "nccl_bytes": nccl},
        reserved_bytes=totals[worst] - nccl[worst],
        overhead_bytes=device.overhead_bytes - device.nccl_bytes + nccl[worst],
        target_device=device.name,
        rank_peak_bytes=peaks,
    )
