"""Predict a plan's peak without a full-size dry run: profile one and two blocks, compose.

Every per-block quantity in a training step (parameters, gradients, optimizer state, the
activations a block keeps) is linear in the number of blocks, and so is the live memory at any
fixed point of the step. The predictor therefore dry-runs the workload at depth 2 and at depth 3
under the plan and extrapolates each phase's peak, category by category, to the full depth:
``m(n) = m(2) + (n - 2) * (m(3) - m(2))``. Depth 1 is avoided on purpose: with one block the
embeddings often dominate and the peak sits at another point of the step (the embedding's
gradient) than it does with many blocks (the start of backward). When a category shrinks from
depth 2 to 3, the two peaks were taken at different points, and the predictor dry-runs the full
depth instead. Blocks x count + embeddings + head + state, measured
rather than assumed. Micro-batching is profiled with two micro-batches (memory does not grow
with more), and the inputs are scaled back to the full batch.

A stack of unlike blocks (dense then mixture-of-experts layers, Mamba and attention
interleaved) is composed per block type (:mod:`memfit.estimate.depth`): the blocks' types come
from the full model built on fake tensors, the shallow depths profiled are ``2 .. m`` for the
least ``m`` whose prefix holds every type that comes after it, and each later block adds the
step its type added there.

Workloads that cannot change depth (``module:function``) and plans whose memory is not linear
in depth (``sqrt`` checkpointing) are dry-run at full size instead.

For a CUDA target the caching allocator's reserved peak is composed the same way from the two
shallow runs' replays (segments grow with the blocks they serve), and the device total adds
the target's fixed overhead (CUDA context, workspaces).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..accounting import CATEGORIES, PHASES, MemoryReport
from ..plan import Plan
from ..targets import DeviceProfile, get_device
from ..workload import Workload
from .depth import SHALLOW_DEPTHS, compose_pattern, layer_pattern, profile_depths
from .dryrun import dry_run
from .prediction import Prediction

__all__ = [
    "BudgetWatch",
    "block_pattern",
    "budget_watch",
    "composes",
    "confirm_peak",
    "first_forward_peak",
    "floor_prediction",
    "predict_peak",
    "shallow_report",
]


def block_pattern(workload: Workload, model: Any = None) -> list[int] | None:
    """The type of each block of ``workload``'s model (:func:`~.depth.layer_pattern`), from the
    full-depth model built on fake tensors (nothing allocated), or from ``model`` if given (such
    a model, which a caller built for its own reasons); ``None`` when unknown. Kept on the
    workload object, so every candidate of one search shares it."""
    assert workload.depth is not None
    cached = workload.__dict__.get("_block_pattern", _UNKNOWN)
    if cached is not _UNKNOWN:
        return cached
    from .fake_kernels import dry_tensors

    try:
        if model is None:
            with dry_tensors():
                model = workload.build_model()
        pattern = layer_pattern(model, workload.depth)
    except Exception:  # the model cannot be built on fake tensors: compose as uniform
        pattern = None
    workload.__dict__["_block_pattern"] = pattern
    return pattern


_UNKNOWN = object()


def _reduced(workload: Workload, plan: Plan) -> tuple[Workload, Plan, float]:
    """The smallest run with the plan's memory behaviour: two micro-batches at most."""
    batch = workload.batch_size
    micro = min(plan.micro_batch_for(batch), batch)
    steps_needed = -(-batch // micro)
    accum = 2 if steps_needed > 1 else 1
    small_batch = micro * accum
    reduced_plan = plan.replace(micro_batch_size=micro, grad_accum_steps=accum)
    return workload.replace(batch_size=small_batch), reduced_plan, batch / small_batch


def _by_phase(report: Any, input_scale: float) -> dict[str, dict[str, float]]:
    out = {}
    for phase in PHASES[:3]:
        cats = dict(report.phase_peak_by_category.get(phase, {}))
        if cats:
            cats["inputs"] = cats["inputs"] * input_scale
        out[phase] = cats
    return out


def _depth_choices(depths: list[int] | None, pattern: list[int]) -> list[list[int]]:
    """The shallow depths to compose from: ``depths``, then each one deeper when that still
    measures every block type past them (see :func:`~.depth.profile_depths`)."""
    if not depths:
        return []
    out = [depths]
    deeper = [d + 1 for d in depths]
    if deeper[-1] < len(pattern) and set(pattern[deeper[-1]:]) <= set(pattern[deeper[0]:deeper[-1]]):
        out.append(deeper)
    return out


def _compose_phases(
    depths: list[int], shallow: list[dict[str, dict[str, float]]], pattern: list[int]
) -> dict[str, dict[str, int]]:
    """Each phase's categories at full depth, composed from the shallow runs' (empty when a
    category falls from one depth to the next: the runs are not in the linear regime)."""
    phases: dict[str, dict[str, int]] = {}
    for phase in PHASES[:3]:
        at = [s[phase] for s in shallow]
        if not all(at):
            continue
        if any(b[c] < a[c] for a, b in itertools.pairwise(at) for c in CATEGORIES):
            return {}
        phases[phase] = {
            c: round(compose_pattern({d: v[c] for d, v in zip(depths, at, strict=True)}, pattern))
            for c in CATEGORIES
        }
    return phases


class _OverBudget(Exception):
    """The deeper shallow run stopped: the full depth is known to exceed the budget."""


class BudgetWatch:
    """Watches a depth-3 run against a budget at each forward's end (:func:`budget_watch`).

    The depth-2 run's hook (:meth:`mark`) keeps its trace at each forward's end; the depth-3
    run's (:meth:`check`) builds the full depth's run up to that point from the two runs'
    traces there and stops the run (returns true) once it passes ``limit`` bytes. Both are
    ``at_forward_end`` hooks of :func:`~.dryrun.dry_run` (see :meth:`at`). Where the depth-2
    run is made elsewhere, its marks may be appended to :attr:`marks` by whoever has them,
    before the check that needs them (the ``k``-th check reads ``marks[k]``; a check without
    its mark lets the run go on).

    Attributes:
        marks: The depth-2 run's trace at each forward's end, in order.
        checked: Forwards of the depth-3 run checked so far (the next check needs
            ``marks[checked]``).
        floor: Once the depth-3 run stopped: the bytes per category at the full depth's
            highest point up to the stop (``None`` until then).
        stopped_at: The forward (from 0) at whose end the depth-3 run stopped (-1: none).
    """

    def __init__(self, depth: int, scale: float, limit: int) -> None:
        self.depth, self.scale, self.limit = depth, scale, limit
        self.marks: list[Any] = []
        self.checked = 0
        self.floor: dict[str, int] | None = None
        self.stopped_at = -1

    def at(self, d: int) -> Any:
        """The hook for the run of depth ``d`` (``None``: not watched)."""
        return {2: self.mark, 3: self.check}.get(d)

    def mark(self, tracker: Any) -> bool:
        """The depth-2 run's hook: keeps its trace; never stops it."""
        self.marks.append(tracker.trace())
        return False

    def check(self, tracker: Any) -> bool:
        """The depth-3 run's hook: whether the full depth passed the limit (then stop)."""
        k = self.checked
        self.checked += 1
        if k >= len(self.marks):
            return False
        floor = _extended_peak({2: self.marks[k], 3: tracker.trace()}, self.depth, self.scale)
        if floor is not None and sum(floor.values()) > self.limit:
            self.floor, self.stopped_at = floor, k
            return True
        return False


def _extended_peak(at: dict[int, Any], depth: int, scale: float) -> dict[str, int] | None:
    """The categories at the highest point (forward, backward or step) of the full depth's
    trace built from ``at`` (:func:`~memfit.accounting.extend.extend_trace`), with the full
    batch's inputs; ``None`` when it cannot be built."""
    from ..accounting.extend import extend_trace
    from ..accounting.report import build_report

    trace = extend_trace(at, depth)
    if trace is None:
        return None
    phases = [c for c in _by_phase(build_report(trace), scale).values() if c]
    if not phases:
        return None
    top = max(phases, key=lambda c: sum(c.values()))
    return {c: round(v) for c, v in top.items()}


def floor_prediction(floor: dict[str, int], target: DeviceProfile, forward: int) -> Prediction:
    """The prediction of a run a :class:`BudgetWatch` stopped: ``floor`` (its
    :attr:`~BudgetWatch.floor`, at the end of forward ``forward``) as a lower bound on the
    peak (``method`` ``"at-least"``)."""
    peak = sum(floor.values())
    return Prediction(
        peak_bytes=peak,
        by_category=dict(floor),
        phase_peaks={},
        peak_phase="",
        method="at-least",
        reserved_bytes=peak,
        overhead_bytes=target.overhead_bytes if target.is_cuda else 0,
        target_device=target.name,
        extra={"stopped_at_forward": forward},
    )


def predict_peak(
    workload: Workload,
    plan: Plan | None = None,
    *,
    compose: bool = True,
    device: str | DeviceProfile | None = "cpu",
    budget_bytes: int | None = None,
    known_reports: Mapping[int, MemoryReport] | None = None,
) -> Prediction:
    """Predict the peak of training ``workload`` under ``plan`` on ``device``.

    Args:
        workload: The workload at its full size and batch.
        plan: The plan (default: the plain plan).
        compose: Compose from depth-2 and depth-3 profiles when possible; otherwise (or when
            impossible) dry-run at full size.
        device: The target whose kernels and allocator the dry runs model (default: the CPU,
            as measured here).
        budget_bytes: A device budget: composing from a model of like blocks, the depth-3
            run stops as soon as the full depth's run, built from the two runs' traces up to
            a forward's end, passes it; the prediction is then that floor (``method``
            ``"at-least"``), not the peak.
        known_reports: Shallow runs already made, by depth: each the :func:`shallow_report`
            of this workload and plan at that depth on ``device`` (run to its end: a depth-3
            report watched against the budget elsewhere that did not stop). Those depths are
            not run again; the prediction is the same. A depth-3 run made here is watched
            only with a depth-2 run made here too.
    """
    plan = plan or Plan()
    target = get_device(device)
    small_wl, small_plan, scale = _reduced(workload, plan)
    if compose and composes(workload, plan):
        runs = _ShallowRuns(workload, plan, target, budget_bytes, known_reports or {})
        composed = runs.predict()
        if composed is not None:
            return composed
    report = dry_run(small_wl, small_plan, steps=2, device=target)
    return _from_report(report, scale, target, "dry-run")


class _Shallow(NamedTuple):
    """What :func:`predict_peak` keeps of one shallow run."""

    phases: dict[str, dict[str, float]]  # each phase's categories (full batch's inputs)
    reserved: int  # the allocator's reserved peak (the tensor peak without one)
    peak: int  # the tensor peak
    host: int  # the host tier's peak


class _ShallowRuns:
    """:func:`predict_peak`'s shallow runs of one workload and plan, each made once (here,
    or taken from ``known``), and their composition to the full depth."""

    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        target: DeviceProfile,
        budget_bytes: int | None,
        known: Mapping[int, MemoryReport],
    ) -> None:
        assert workload.with_depth is not None and workload.depth is not None
        self.workload, self.target, self.known = workload, target, known
        self.small_wl, self.small_plan, self.scale = _reduced(workload, plan)
        self.pattern = block_pattern(workload) or [0] * workload.depth
        self.depths = profile_depths(self.pattern)
        self.runs: dict[int, _Shallow] = {}
        self.traces: dict[int, Any] = {}
        self.watch = budget_watch(workload, plan, target, budget_bytes)

    def run(self, d: int) -> _Shallow:
        """The run at depth ``d``; raises :class:`_OverBudget` when the watch stopped it."""
        if d in self.runs:
            return self.runs[d]
        report = self.known.get(d)
        if report is None:
            watch = self.watch
            report = _shallow_run(
                self.workload, self.small_plan, self.small_wl, d, self.target,
                None if watch is None else watch.at(d),
            )
            if watch is not None and watch.floor is not None:
                raise _OverBudget
        self.runs[d] = _Shallow(
            _by_phase(report, self.scale),
            report.peak_reserved_bytes or report.peak_bytes,
            report.peak_bytes,
            report.peak_by_tier.get("host", 0),
        )
        self.traces[d] = report.trace
        return self.runs[d]

    def predict(self) -> Prediction | None:
        """The composed prediction (or the floor over the budget); ``None`` when no choice
        of shallow depths is in the linear regime (then the full depth is dry-run)."""
        # A phase's peak may fall at another moment in the shallowest run (with the step in
        # backward, depth 2's optimizer phase peaks at the embedding's step, deeper ones while
        # the last blocks' activations live): then the same depths, one deeper, are tried
        # before the full-depth run.
        for tried in _depth_choices(self.depths, self.pattern):
            try:
                shallow = [self.run(d) for d in tried]
            except _OverBudget:
                assert self.watch is not None and self.watch.floor is not None
                return floor_prediction(self.watch.floor, self.target, self.watch.stopped_at)
            phases = _compose_phases(tried, [s.phases for s in shallow], self.pattern)
            if phases:
                return self._composed(tried, shallow, phases)
        return None

    def _composed(
        self, tried: list[int], shallow: list[_Shallow], phases: dict[str, dict[str, int]]
    ) -> Prediction:
        at_host = {d: r.host for d, r in zip(tried, shallow, strict=True)}
        extra: dict[str, Any] = {}
        if len(set(self.pattern)) == 1 and len(tried) == 2:
            extra["traces"] = {d: self.traces[d] for d in tried}
        # The allocator's slack (reserved minus tensors) is not linear in depth: it depends on
        # which cached blocks happen to fit. Take the larger slack of the two shallow runs.
        slack = max(s.reserved - s.peak for s in shallow)
        phase_peaks = {k: sum(v.values()) for k, v in phases.items()}
        peak_phase = max(phase_peaks, key=lambda k: phase_peaks[k])
        return Prediction(
            peak_bytes=phase_peaks[peak_phase],
            by_category=phases[peak_phase],
            phase_peaks=phase_peaks,
            peak_phase=peak_phase,
            method="composed",
            reserved_bytes=phase_peaks[peak_phase] + max(slack, 0),
            overhead_bytes=self.target.overhead_bytes if self.target.is_cuda else 0,
            target_device=self.target.name,
            host_bytes=round(compose_pattern(at_host, self.pattern)),
            extra=extra,
        )


def composes(workload: Workload, plan: Plan) -> bool:
    """Whether :func:`predict_peak` composes ``workload`` under ``plan`` from shallow runs
    (depths 2 and 3 at least), rather than dry-running its full depth: a depth knob and
    more than three blocks, and a plan whose memory is linear in depth."""
    return (
        workload.scalable
        and (workload.depth or 0) > 3
        and plan.checkpointing.mode not in ("sqrt", "budget")
    )


def budget_watch(
    workload: Workload, plan: Plan, target: DeviceProfile, budget_bytes: int | None
) -> BudgetWatch | None:
    """The watch of :func:`predict_peak`'s depth-3 run of ``workload`` under ``plan`` against
    ``budget_bytes`` on ``target`` (``None``: not watched: no budget, a plan or model that
    does not compose, or a model of unlike blocks)."""
    if budget_bytes is None or not composes(workload, plan):
        return None
    assert workload.depth is not None
    pattern = block_pattern(workload) or [0] * workload.depth
    if len(set(pattern)) != 1 or profile_depths(pattern) != [2, 3]:
        return None
    _, _, scale = _reduced(workload, plan)
    limit = budget_bytes - (target.overhead_bytes if target.is_cuda else 0)
    return BudgetWatch(workload.depth, scale, limit)


def _shallow_run(
    workload: Workload,
    small_plan: Plan,
    small_wl: Workload,
    depth: int,
    target: DeviceProfile,
    at_forward_end: Callable[[Any], bool] | None,
    should_stop: Callable[[], bool] | None = None,
) -> MemoryReport:
    assert workload.with_depth is not None
    return dry_run(
        workload.with_depth(depth).replace(batch_size=small_wl.batch_size),
        small_plan,
        steps=2,
        device=target,
        at_forward_end=at_forward_end,
        should_stop=should_stop,
    )


def shallow_report(
    workload: Workload,
    plan: Plan,
    depth: int,
    *,
    device: str | DeviceProfile | None = "cpu",
    at_forward_end: Callable[[Any], bool] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> MemoryReport:
    """The report of :func:`predict_peak`'s run of ``workload`` at ``depth`` under ``plan``
    (the reduced batch: two micro-batches at most), for ``predict_peak``'s ``known_reports``.

    ``at_forward_end`` and ``should_stop`` are :func:`~.dryrun.dry_run`'s: called with the
    tracker at each forward's end (a :class:`BudgetWatch`'s hook, say), and asked every few
    operators whether the run is still wanted; true stops the run there. A report so
    stopped (``meta["stopped"]``) is not one ``known_reports`` takes.
    """
    target = get_device(device)
    small_wl, small_plan, _ = _reduced(workload, plan)
    return _shallow_run(
        workload, small_plan, small_wl, depth, target, at_forward_end, should_stop
    )


def first_forward_peak(
    workload: Workload, plan: Plan, *, device: str | DeviceProfile | None = "cpu"
) -> dict[str, int] | None:
    """The highest live bytes of the full-depth run up to the end of its first forward, as
    the full-depth dry run records them (a floor under the plan's peak: what a budget must
    hold before the first backward even starts), with the inputs of the full batch.

    Built from the first forwards of the depth-2 and depth-3 runs
    (:func:`memfit.accounting.extend.extend_trace`), which cost a few blocks' forward: a
    plan whose floor is over the budget is ruled out at a fraction of a prediction's cost.
    Returns the bytes per category at that highest point, or ``None`` when it cannot be
    built (a model of unlike blocks, no depth knob, a plan not linear in depth, or traces
    that do not extend).
    """
    if not composes(workload, plan) or plan.compile_backend is not None:
        return None
    assert workload.with_depth is not None and workload.depth is not None
    n = workload.depth
    pattern = block_pattern(workload) or [0] * n
    if len(set(pattern)) != 1:
        return None
    target = get_device(device)
    small_wl, small_plan, scale = _reduced(workload, plan)
    traces = {
        d: dry_run(
            workload.with_depth(d).replace(batch_size=small_wl.batch_size),
            small_plan,
            steps=1,
            device=target,
            stop="forward",
        ).trace
        for d in SHALLOW_DEPTHS
    }
    return _extended_peak(traces, n, scale)


def confirm_peak(
    workload: Workload,
    plan: Plan,
    composed: Prediction | None = None,
    *,
    device: str | DeviceProfile | None = "cpu",
) -> Prediction:
    """The peak of training ``workload`` under ``plan`` at its full depth: what a full-size
    dry run reports.

    When ``composed`` (a :func:`predict_peak` of the same workload and plan) kept its shallow
    runs' allocation traces, the full-depth trace is built from them event by event
    (:func:`memfit.accounting.extend.extend_trace`), which gives the dry run's figures without
    running it. That needs a model of like blocks, a target without a caching allocator (whose
    layout depends on which allocation each free releases, which the traces do not carry)
    and a plan whose report is the trace's alone (no compiled saving, no disk-tier estimate).
    Otherwise, or when the two traces are not one run with a stretch per block, the full depth
    is dry-run.
    """
    from ..accounting.extend import extend_trace
    from ..accounting.report import build_report

    target = get_device(device)
    traces = composed.extra.get("traces") if composed is not None else None
    offload = plan.offload
    if (
        traces
        and workload.depth is not None
        and not target.is_cuda
        and plan.compile_backend is None
        and not (offload is not None and offload.optimizer == "disk")
    ):
        trace = extend_trace(traces, workload.depth)
        if trace is not None:
            _, _, scale = _reduced(workload, plan)
            return _from_report(build_report(trace), scale, target, "extended")
    return predict_peak(workload, plan, compose=False, device=target)


def _from_report(report: Any, scale: float, target: DeviceProfile, method: str) -> Prediction:
    """The prediction a full-depth run's report gives (the batch's inputs scaled back from
    the reduced run's): each phase's peak, the allocator's slack on top of the highest, the
    host tier's peak."""
    phases = {
        k: {c: round(v) for c, v in cats.items()}
        for k, cats in _by_phase(report, scale).items()
        if cats
    }
    phase_peaks = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(phase_peaks, key=lambda k: phase_peaks[k])
    # The slack of the reduced run, on top of the peak with the full batch's inputs.
    slack = (report.peak_reserved_bytes or report.peak_bytes) - report.peak_bytes
    return Prediction(
        peak_bytes=phase_peaks[peak_phase],
        by_category=phases[peak_phase],
        phase_peaks=phase_peaks,
        peak_phase=peak_phase,
        method=method,
        reserved_bytes=phase_peaks[peak_phase] + max(slack, 0),
        overhead_bytes=target.overhead_bytes if target.is_cuda else 0,
        target_device=target.name,
        host_bytes=report.peak_by_tier.get("host", 0),
    )
