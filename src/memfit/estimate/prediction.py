"""What every predictor returns: one :class:`Prediction` of a plan's memory, per rank.

Every way memfit predicts a plan's memory (a full dry run, a composition of shallow dry runs,
each rank's dry run in a fake process group, each pipeline rank's program replayed over its
schedule, the 3-D planner's per-stage model: :mod:`memfit.estimate.predictor`) answers with
this one record, so the planner, the benchmarks and the commands read one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..accounting import MemoryReport
from .target import upper_edge

__all__ = ["Prediction"]


@dataclass
class Prediction:
    """A predicted (or measured) peak: the largest rank's, and every rank's.

    Attributes:
        peak_bytes: Predicted peak of live (allocated) device bytes; with several ranks, the
            largest rank's.
        by_category: Bytes per category at that peak.
        phase_peaks: Predicted peak of each phase (empty where the predictor has no phases).
        peak_phase: The phase holding the peak (empty where unknown).
        method: How it was predicted: ``composed`` (depth 2 and 3 extrapolated),
            ``extended`` (the full depth's trace built from theirs, see
            :func:`~memfit.estimate.compose.confirm_peak`), ``dry-run`` (full size),
            ``at-least`` (a floor over the budget, see
            :func:`~memfit.estimate.compose.predict_peak`'s ``budget_bytes``: ``peak_bytes``
            and ``by_category`` are that floor's), ``ranks`` (every rank dry-run in a fake
            process group), ``layout`` (each pipeline rank's program replayed over its
            schedule), ``layout-model`` (the 3-D planner's per-stage model) or ``measured``
            (the workload's own steps run as given, for real or on fake tensors: see
            :attr:`report`).
        extra: ``traces``: a composed prediction's shallow allocation traces by depth, kept
            for :func:`~memfit.estimate.compose.confirm_peak` (only for models of like
            blocks); other predictors keep their own record here (``ranks``: the
            :class:`~memfit.estimate.distributed.RankPrediction`, ``layout``: the
            :class:`~memfit.estimate.layout.LayoutPrediction` or the
            :class:`~memfit.estimate.layout_cost.LayoutCandidate`).
        reserved_bytes: Predicted peak the target's caching allocator reserves (``peak_bytes``
            on the CPU, and where the predictor does not model the allocator).
        overhead_bytes: The target's memory outside the allocator (CUDA context, workspaces).
        target_device: The target modelled.
        host_bytes: Predicted peak of the host tier (offload's masters, state, gradients and
            activations), composed over depth like the device categories.
        rank_peak_bytes: Predicted peak of every rank, in rank order (empty: one process,
            whose peak is ``peak_bytes``; see :attr:`ranks`).
        report: The run's whole :class:`~memfit.accounting.MemoryReport` (modules, timeline,
            trace, the run's facts in ``meta``) where the predictor made one run of the
            workload as given (``measured``); ``None`` for the others.
    """

    peak_bytes: int
    by_category: dict[str, int]
    phase_peaks: dict[str, int]
    peak_phase: str
    method: str
    extra: dict[str, Any] = field(default_factory=dict)
    reserved_bytes: int = 0
    overhead_bytes: int = 0
    target_device: str = "cpu"
    host_bytes: int = 0
    rank_peak_bytes: list[int] = field(default_factory=list)
    report: MemoryReport | None = None

    @property
    def device_total_bytes(self) -> int:
        """What the device holds at the peak: reserved bytes plus the fixed overhead."""
        return max(self.reserved_bytes, self.peak_bytes) + self.overhead_bytes

    @property
    def upper_device_total_bytes(self) -> int:
        """The device total's error band's upper edge (on a GPU target: the device total plus
        what the GPU harness saw real runs exceed predictions by; on the CPU the device total,
        since dry runs are exact there). What a budget must hold."""
        return upper_edge(self.device_total_bytes, self.overhead_bytes > 0)

    @property
    def ranks(self) -> list[int]:
        """Every rank's predicted peak, in rank order (one entry for one process)."""
        return list(self.rank_peak_bytes) or [self.peak_bytes]
