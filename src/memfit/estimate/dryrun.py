"""Run training steps of a workload under a plan, for real or on fake tensors, and measure them.

A dry run builds the model inside :class:`~torch._subclasses.fake_tensor.FakeTensorMode`:
every tensor has a shape, dtype and device but no memory, so a 7B model "trains" on a laptop in
seconds. The tracker counts storages at the dispatch level, where fake and real runs perform the
same operations, so a dry run's peak is the real run's peak, not an estimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..accounting import MemoryReport, track
from ..errors import MemfitError
from ..optim.registry import get as optimizer_spec
from ..plan import Plan, PlanError
from ..targets import DeviceProfile, emulate, get_device
from ..workload import Workload, load_workload
from .arguments import check_run_arguments

__all__ = [
    "DryRunLimitation",
    "dry_run",
    "dry_tensors",
    "measure",
    "model_error",
    "plan_for_target",
]

#: Called after each step with (steps done, steps in all).
Progress = Callable[[int, int], None]


class ModelError(MemfitError, RuntimeError):
    """The model itself raised inside its forward or backward (the cause is its own error)."""


class DryRunLimitation(ModelError):
    """A dry run cannot follow an operator that a real run handles (fake tensors have shapes,
    not values: a data-dependent output shape or a value read); the message names the operator
    and the module and says what to do instead."""


def model_error(exc: BaseException) -> ModelError:
    """Wrap an exception raised by the user's model so callers can show it as the model's."""
    err = ModelError(f"the model raised {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def measure(
    workload: Workload | str,
    plan: Plan | None = None,
    *,
    steps: int = 2,
    dry: bool = False,
    cap: int | str | None = None,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 128,
    device: str | DeviceProfile | None = None,
    progress: Progress | None = None,
    expert_load: float = 1.0,
    stop: str | None = None,
    at_forward_end: Callable[[Any], bool] | None = None,
    keep_trace: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> MemoryReport:
    """Run ``steps`` full training steps of ``workload`` under ``plan`` and report memory.

    ``measure`` is the one entry point; :func:`dry_run` is ``measure(..., dry=True)``.

    Each step is forward, backward, optimizer step and ``zero_grad(set_to_none=True)``
    (micro-batched, checkpointed, ... as the plan says). Parameters, buffers and the batch are
    counted from the start.

    Args:
        workload: A :class:`Workload`, or a SPEC (then ``batch_size`` and ``seq_len`` apply).
        plan: The plan (default: plain AdamW(lr=1e-3), fp32, nothing else).
        steps: Training steps to run (>= 1); the peak is over all of them.
        dry: Run on fake tensors (nothing allocated) instead of real ones.
        cap: Virtual memory cap: bytes or a size such as ``"4GiB"`` (raises
            ``torch.OutOfMemoryError`` beyond it).
        seed: Seed for model initialisation and the batch.
        batch_size: With a SPEC: samples per step.
        seq_len: With a SPEC: tokens per sample.
        device: The target device whose memory behaviour the run reproduces: a profile name
            (``h100``, ``a100``, ``a100-40gb``, ``rtx4090``, ``t4``, ``cpu``), a custom GPU
            description (see :func:`memfit.targets.parse_device`) or a profile. Default: this
            machine's own device. For a CUDA target the run keeps what that GPU's kernels
            keep (:mod:`memfit.targets.kernels`: fused attention where the GPU would take it,
            CUDA's autocast rules and dropout masks), torch's optimizers take the
            implementation torch picks there (foreach), and the report adds the caching
            allocator's reserved peak and the device's fixed overhead.
        progress: Called after each step with (done, total).
        expert_load: Dry runs only: how a mixture-of-experts router spreads tokens, whose
            choice depends on trained weights a dry run lacks. ``1.0``: evenly; ``c > 1``:
            expert 0 takes ``c`` times its share (a worst case). See
            :mod:`memfit.estimate.values` for this and the other data-dependent policies.
        stop: ``"forward"``: stop as the model's first forward returns (the report covers the
            run up to there: parameters, inputs and one micro-batch's forward; the planner
            uses it to rule out plans that pass the budget that early). ``None``: run every
            step.
        at_forward_end: Called with the tracker each time a forward of the model returns;
            returning true stops the run there (as ``stop="forward"`` does at the first).
        keep_trace: Keep the allocation trace on the report (``report.trace``) for a real
            run too (a dry run always keeps it): what a memory snapshot is built from.
        should_stop: Asked whether the run is still wanted (a dry run: every 64 operators,
            backward included; a real run: at each forward's end); true stops it there
            (``meta["stopped"]``: ``"should_stop"``).

    Returns:
        The :class:`MemoryReport`, with ``meta`` holding ``num_parameters``, ``dry_run``,
        ``model``, ``batch_size``, ``seq_len``, ``steps``, ``plan``, ``losses``,
        ``target_device``, ``attention_backends``; for a dry run, ``data_dependent``: where a
        data-dependent policy decided a shape or value (operator, module, policy); for a
        compiled plan, ``compile``: the kept-activation saving measured for real at a small
        size and applied (:mod:`memfit.estimate.compiled`).

    Raises:
        MemfitTypeError, MemfitValueError: for a wrong argument, before anything is built.
        ModelError: when the model itself fails; its own exception is the cause.
        PlanError: when the plan asks for what the target cannot do (bf16 on a T4).
    """
    cap = check_run_arguments(**locals())  # every argument, before any work (issue 37)
    from ..apply.compose import apply_plan

    if isinstance(workload, str):
        workload = load_workload(workload, batch_size, seq_len)
    target = get_device(device)
    plan = plan_for_target(plan or Plan(), target)
    run = _Run(workload, plan, target, dry=dry, progress=progress, keep_trace=keep_trace)
    values = _values(dry, expert_load, run.current_module)
    poll = None if should_stop is None else run.poll(should_stop)
    with _fake_mode(poll) if dry else contextlib.nullcontext(), values:
        model, batch = _build(workload, seed)
        run.num_parameters = sum(p.numel() for p in model.parameters())
        setup = apply_plan(model, plan, loss_fn=workload.loss_fn)
        watch = (lambda _: True) if stop == "forward" else at_forward_end
        watch = watch if should_stop is None or dry else _or_stop(watch, should_stop, run)
        run.train(model, batch, setup, steps=steps, cap=cap, watch=watch)
    report = run.report(steps, values, stopped_by=run.stopped_by or stop or "at_forward_end")
    if dry and plan.offload is not None and plan.offload.optimizer == "disk":
        _disk_tier_estimate(report, setup.optimizer, plan)
    if plan.compile_backend is not None:
        # Neither a dry run (fake tensors) nor the tracker's dispatch mode (under which dynamo
        # runs the model eagerly) sees compiled code: both apply the saving measured for real.
        _apply_compiled_saving(report, workload, plan, seed)
    return report


def _build(workload: Workload, seed: int) -> tuple[Any, Any]:
    """``workload``'s model and batch; fake tensors' own failure is a :class:`DryRunLimitation`."""
    from ..workload import WorkloadError

    try:
        return workload.build(seed=seed)
    except WorkloadError:
        raise
    except Exception as e:
        limitation = _dry_limitation(e, "while the model was built")
        if limitation is None:
            raise
        raise limitation from e


class _Run:
    """One run of :func:`measure`: its training steps under the tracker, and their report."""

    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        target: DeviceProfile,
        *,
        dry: bool,
        progress: Progress | None,
        keep_trace: bool = False,
    ) -> None:
        self.workload, self.plan, self.target = workload, plan, target
        self.dry, self.progress = dry, progress
        self.emulation = emulate(target)
        self.tracker: Any = None  # once the run is tracked
        self.losses: list[float | None] = []
        self.stopped = False  # whether ``watch`` (or ``should_stop``) stopped the run
        self.stopped_by: str | None = None  # "should_stop" when that stopped it
        self.in_step = False  # inside a training step (where ``should_stop`` may stop it)
        self.num_parameters = 0  # of the model as built, before the plan
        self.keep_trace = keep_trace or dry  # the report keeps the trace (dry runs always do)

    def poll(self, should_stop: Callable[[], bool]) -> Callable[[], None]:
        """A dry run's poll of ``should_stop`` (see :class:`~.fast_fake.DryFakeTensorMode`):
        stops the run once it holds (only once the run is tracked: building the model is
        not stopped)."""

        def check() -> None:
            if self.in_step and should_stop():
                self.stopped_by = "should_stop"
                raise _Stopped

        return check

    def current_module(self) -> str | None:
        """The module running now (``None`` before the run is tracked)."""
        return self.tracker and self.tracker.current_module

    def train(
        self,
        model: Any,
        batch: Any,
        setup: Any,
        *,
        steps: int,
        cap: int | None,
        watch: Callable[[Any], bool] | None,
    ) -> None:
        """Run ``steps`` steps of ``setup`` on ``batch`` under the tracker; ``watch(tracker)``
        at each forward's end stops the run when true."""
        hooks = contextlib.ExitStack()
        if watch is not None:

            def at_end(*args: Any) -> None:
                if watch(self.tracker):
                    raise _Stopped

            hooks.callback(model.register_forward_hook(at_end).remove)
        with hooks, track(model, setup.optimizer, cap=cap) as tracker, self.emulation:
            self.tracker = tracker
            tracker.add_inputs(batch)
            for i in range(steps):
                try:
                    loss = self._step(setup, batch)
                except _Stopped:
                    self.stopped = True
                    break
                self.losses.append(None if self.dry else float(loss))
                del loss
                if self.progress is not None:
                    self.progress(i + 1, steps)

    def _step(self, setup: Any, batch: Any) -> Any:
        """One step of ``setup``; the model's own failure is named as the model's."""
        from ..workload import WorkloadError

        self.in_step = True
        try:
            return setup.step(batch)
        except (_Stopped, WorkloadError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            if _stopped(e):
                raise _Stopped from None
            tracker = self.tracker
            where = tracker.failed_module or tracker.current_module
            limitation = _dry_limitation(
                e, f"inside module {where!r}" if where else "in the training step"
            )
            raise (limitation or model_error(e)) from e
        finally:
            self.in_step = False

    def report(self, steps: int, values: Any, *, stopped_by: str) -> MemoryReport:
        """The tracker's report, with the run's facts in ``meta`` and the target's memory."""
        from .target import add_device_memory

        report = self.tracker.report()
        report.meta.update(
            model=self.workload.name,
            batch_size=self.workload.batch_size,
            seq_len=self.workload.seq_len,
            steps=steps,
            num_parameters=int(self.num_parameters),
            dry_run=bool(self.dry),
            plan=self.plan.to_dict(),
            losses=self.losses,
            target_device=self.target.name,
            attention_backends=dict(getattr(self.emulation, "backends", {})),
        )
        if self.stopped:
            report.meta["stopped"] = stopped_by
        if self.dry:
            report.meta["data_dependent"] = values.summary()
        if self.keep_trace:
            report.trace = self.tracker.trace()
        add_device_memory(report, self.tracker, self.target)
        return report


class _Stopped(Exception):
    """Raised where a run asked to stop early (``stop="forward"``, ``at_forward_end``,
    ``should_stop``) reaches that point."""


def _stopped(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was caused by, :class:`_Stopped` (autograd may wrap an error
    raised during a recomputation in backward)."""
    while exc is not None:
        if isinstance(exc, _Stopped):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _or_stop(
    watch: Callable[[Any], bool] | None, should_stop: Callable[[], bool], run: _Run
) -> Callable[[Any], bool]:
    """``watch`` at a forward's end, or ``should_stop`` (then named as what stopped it)."""

    def at_end(tracker: Any) -> bool:
        if watch is not None and watch(tracker):
            return True
        if should_stop():
            run.stopped_by = "should_stop"
            return True
        return False

    return at_end


def _disk_tier_estimate(report: MemoryReport, optimizer: Any, plan: Plan) -> None:
    """The disk tier's host and disk bytes, from a dry run of the host tier.

    The device side of the two tiers is the same code (gradient buckets, the copy back), so the
    device figures stand. On the host, the disk tier keeps two window halves, each as large as
    its largest group of parameters (masters and state), instead of every master and all the
    state; those go to disk, twice (the current file and the one being written), with a 4 KiB
    header each. The host peak of the host-tier run, taken at its step, loses the difference:
    an estimate (the real tier's first step and its read-ahead buffers differ a little), not a
    byte-exact figure; ``meta["disk_tier"]`` says so and holds the numbers.
    """
    from ..strategies.disk_offload import footprint, tier_bytes

    state = optimizer.optimizer.state
    footprints = [
        footprint(m, [v for v in state.get(m, {}).values() if torch.is_tensor(v)])
        for m in optimizer.masters
    ]
    tier = tier_bytes(footprints, plan.offload.host_window_bytes)
    halves, disk, resident = tier["window"], tier["disk"], sum(footprints)
    host = report.peak_by_tier.get("host", 0)
    report.peak_by_tier["host"] = max(0, host - resident + halves)
    cats = report.peak_by_tier_category.get("host")
    if cats is not None:
        cats["optimizer_state"] = max(0, cats.get("optimizer_state", 0) - resident + halves)
    report.peak_by_tier["disk"] = disk
    disk_cats = report.peak_by_tier_category.setdefault("disk", {})
    disk_cats["optimizer_state"] = disk
    report.meta["disk_tier"] = {
        "estimate": True,
        "masters_and_state_bytes": resident,
        "window_bytes": halves,
        "disk_bytes": disk,
        "groups": tier["groups"],
    }


@contextlib.contextmanager
def dry_tensors(expert_load: float = 1.0, where: Callable[[], str | None] = lambda: None) -> Any:
    """Run the block on fake tensors as :func:`measure`'s dry runs do: the fake kernels that
    follow the real ones and the dry run's known values and data-dependent policies (for
    callers that run more of a job than training steps, :func:`memfit.train.job.predict_job`).

    Args:
        expert_load: How a mixture-of-experts router spreads tokens (see :func:`measure`).
        where: The module running now, named where a data-dependent policy decides.
    """
    with _fake_mode(), _values(True, expert_load, where):
        yield


@contextlib.contextmanager
def _fake_mode(poll: Callable[[], None] | None = None) -> Any:
    """Fake tensors, with the fake kernels that follow the real ones (:mod:`.fake_kernels`);
    ``poll`` is called every 64 operators (see :class:`~.fast_fake.DryFakeTensorMode`)."""
    from .fake_kernels import real_kernel_rules
    from .fast_fake import DryFakeTensorMode

    with real_kernel_rules(), DryFakeTensorMode(allow_non_fake_inputs=True, poll=poll):
        yield


def _apply_compiled_saving(report: MemoryReport, workload: Workload, plan: Plan, seed: int) -> None:
    """Scale a compiled plan's kept activations by the saving measured for real
    (:mod:`memfit.estimate.compiled`), phase by phase: each phase's peak loses its scaled-away
    activations, and the step's peak is the highest phase peak after that (it may move to
    another phase). The reserved peak falls by the same bytes. ``meta["compile"]`` says what
    was measured and applied."""
    from .compiled import compiled_activation_scale

    measured = compiled_activation_scale(workload, plan, seed=seed)
    scale = min(measured["scale"], 1.0)
    for phase, cats in report.phase_peak_by_category.items():
        kept = cats.get("activations", 0)
        saved = kept - round(kept * scale)
        cats["activations"] = kept - saved
        report.phase_peaks[phase] = report.phase_peaks.get(phase, 0) - saved
    before = report.peak_bytes
    if report.phase_peak_by_category:
        top = max(report.phase_peaks, key=lambda k: report.phase_peaks[k])
        report.peak_phase = top
        report.peak_bytes = report.phase_peaks[top]
        report.peak_by_category = dict(report.phase_peak_by_category[top])
    saved = before - report.peak_bytes
    if report.peak_reserved_bytes is not None:
        report.peak_reserved_bytes -= saved
    report.peak_by_tier["device"] = report.peak_bytes
    report.peak_by_tier_category["device"] = dict(report.peak_by_category)
    report.meta["compile"] = {**measured, "activation_bytes_saved": saved}


def _values(dry: bool, expert_load: float, where: Callable[[], str | None]) -> Any:
    """The dry run's value shadows and data-dependent policies (nothing for a real run)."""
    from .values import DryRunValues

    values = DryRunValues(expert_load=expert_load, where=where)  # checks expert_load always
    return values if dry else contextlib.nullcontext()


def _dry_limitation(exc: BaseException, where: str) -> DryRunLimitation | None:
    """A :class:`DryRunLimitation` when ``exc`` is fake tensors' own failure, else ``None``."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        why = (
            "reads a tensor's value"
            if isinstance(exc, DataDependentOutputException)
            else "has an output shape that depends on the data"
        )
    elif isinstance(exc, UnsupportedOperatorException):
        why = "has no fake-tensor implementation"
    else:
        return None
    op = getattr(exc, "func", None)
    return DryRunLimitation(
        f"dry-run limitation: operator {op} {why}, which fake tensors cannot follow ({where}); "
        "the real run handles it. Profile for real at a small size instead (without "
        "--dry-run, with a smaller --batch-size and --seq-len, or a shallower config)"
    )


def plan_for_target(plan: Plan, target: DeviceProfile) -> Plan:
    """The plan as it runs on ``target``: what torch and the hardware choose there.

    * torch's optimizers with ``foreach=None`` take torch's default for the target's tensors:
      foreach on CUDA (``torch.optim.optimizer._default_to_fused_or_foreach``), the per-tensor
      loop on the CPU. A dry run executes on CPU tensors, so a CUDA target's default is made
      explicit.

    Raises:
        PlanError: for bf16 precision on a target without bf16 (T4), naming fp16-mixed; for
            fp8 on a target without float8 matmuls (compute capability below 8.9).
    """
    import dataclasses

    mode = plan.precision.mode
    if mode.startswith("bf16") and not target.supports_bf16:
        raise PlanError(
            f"{target.name} has no bf16 support, so precision {mode!r} cannot run there; use "
            "fp16-mixed (or fp32)"
        )
    if mode == "fp8":
        from ..strategies.fp8 import fp8_problem

        problem = fp8_problem(target)
        if problem is not None:
            raise PlanError(problem)
    opt = plan.optimizer
    if target.is_cuda and optimizer_spec(opt.name).foreach and opt.foreach is None:
        fused = bool(dict(opt.kwargs).get("fused"))
        if not fused:
            plan = plan.replace(optimizer=dataclasses.replace(opt, foreach=True))
    return plan


def dry_run(
    workload: Workload | str,
    plan: Plan | None = None,
    steps: int = 2,
    *,
    cap: int | str | None = None,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 128,
    device: str | DeviceProfile | None = None,
    progress: Progress | None = None,
    expert_load: float = 1.0,
    stop: str | None = None,
    at_forward_end: Callable[[Any], bool] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> MemoryReport:
    """Run ``steps`` full training steps on fake tensors and return the :class:`MemoryReport`.

    Nothing is allocated: the model, batch, gradients and optimizer state are fake tensors, so
    any model size profiles in seconds. The peak equals the real run's. This is
    ``measure(..., dry=True)``; the arguments are :func:`measure`'s.

    Args:
        workload: A :class:`~memfit.workload.Workload` or a ``--model`` SPEC.
        plan: The plan to apply (default: plain AdamW, fp32).
        steps: Training steps.
        cap: Virtual memory cap: bytes or a size such as ``"4GiB"`` (raises
            ``torch.OutOfMemoryError`` beyond it).
        seed: Seed for model initialisation and the batch.
        batch_size: With a SPEC: samples per step.
        seq_len: With a SPEC: tokens per sample.
        device: The target device whose memory behaviour the run reproduces (default: this
            machine's own).
        progress: Called after each step with (done, total).
        expert_load: How a mixture-of-experts router spreads tokens (``1.0``: evenly).
        stop: ``"forward"``: stop as the model's first forward returns.
        at_forward_end: Called with the tracker each time a forward of the model returns;
            returning true stops the run there.
        should_stop: Asked every 64 operators whether the run is still wanted (true: it
            stops there, see :func:`measure`).
    """
    return measure(
        workload,
        plan,
        steps=steps,
        dry=True,
        cap=cap,
        seed=seed,
        batch_size=batch_size,
        seq_len=seq_len,
        device=device,
        progress=progress,
        expert_load=expert_load,
        stop=stop,
        at_forward_end=at_forward_end,
        should_stop=should_stop,
    )
