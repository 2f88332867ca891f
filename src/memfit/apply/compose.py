"""Apply a whole :class:`~memfit.plan.Plan` to a model, step it, and take it off again.

Each technique lives in its own module, as one :class:`~memfit.techniques.Technique` that
knows nothing of the others; they meet here, in the registry's order
(:func:`memfit.techniques.apply_order`; each technique's module says why it stands where
it does): the KV cache off, freezing, the fused forwards, precision, checkpointing, parameter and
activation offload, a user's techniques, ``torch.compile``, the contiguous gradient buffer,
data parallelism, then the optimizer (fused into backward, or on the host), built by
:func:`apply_plan` at its place in the order. Every step then runs
:func:`~memfit.apply.stepper.run_step` (sequence truncation, micro-batches with weighted
losses, autocast and loss scaling, clipping, the optimizer step and
``zero_grad(set_to_none=True)``) through the plan's :class:`~memfit.apply.stepper.Stepper`.
The techniques of the step have no ``apply``: the registry still holds them, for the engines'
refusals, the OOM fallback and the planner.

Every technique's ``apply`` returns a handle (:class:`~memfit.strategies.removable.Removable`);
:meth:`TrainingSetup.remove` removes them in reverse order, so a plan can be switched by
removing one and applying another (:func:`memfit.train.oom.switch_plan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import MemfitTypeError, MemfitValueError, check_bool, describe
from ..plan import Plan
from ..strategies.grad_buffer import apply_grad_buffer
from ..strategies.removable import Removable
from ..techniques import ApplyContext
from ..workload import Batch, loss_from_output
from .stepper import Stepper, make_stepper, run_step

__all__ = [
    "LossFn",
    "TrainingSetup",
    "applied_by",
    "apply_plan",
    "apply_techniques",
    "check_plan_arguments",
    "refuse_unsupported",
]

LossFn = Callable[[Any, Batch], torch.Tensor]


@dataclass
class TrainingSetup:
    """A model with a plan applied, ready to step.

    Attributes:
        model: The model (the same object that was passed in, changed in place).
        plan: The plan applied.
        optimizer: The optimizer, or the optimizer-in-backward handle.
        loss_fn: Turns (output, batch) into a scalar loss.
        precision: The precision runtime (autocast context, loss scaler).
        stepper: The :class:`~memfit.apply.stepper.Stepper` that turns losses into
            updates (built from the fields above when not given).
        info: What each technique did (``frozen``, ``checkpointed`` names), for reports.
        steps_done: Optimizer steps taken.
        handles: ``(technique, handle)`` in the order applied; :meth:`remove` undoes them.
        optimizer_given: Whether the optimizer was the caller's (kept across plan switches)
            rather than built from the plan.
    """

    model: nn.Module
    plan: Plan
    optimizer: Any
    loss_fn: LossFn
    precision: Any
    stepper: Stepper | None = None
    info: dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    handles: list[tuple[str, Removable]] = field(default_factory=list, repr=False)
    optimizer_given: bool = False
    removed: bool = False
    parallel: Any = None

    def __post_init__(self) -> None:
        if self.stepper is None:
            self.stepper = make_stepper(
                self.optimizer,
                self.precision,
                self.model,
                fused=self.plan.optimizer_in_backward,
                max_grad_norm=self.plan.max_grad_norm,
            )
            if self.parallel is not None:
                from ..distributed.data import DataParallelStepper

                self.stepper = DataParallelStepper(self.stepper, self.parallel)

    def remove(self) -> None:
        """Take the plan off the model, last technique first: the fused step's hooks, the
        gradient buffer (plain gradients again), checkpointing's wrappers, precision (dtypes, input hook, optimizer wrappers), the
        fused loss (the head's forward and the model's ``loss_function``), fused pointwise
        forwards, freezing's ``requires_grad``.

        The model then has the structure, hooks, dtypes and ``requires_grad`` it had before
        :func:`apply_plan`, with its current (trained) values; see
        :mod:`memfit.strategies.precision` for which values bf16-pure gives back exactly. The
        setup cannot step afterwards. Idempotent.
        """
        while self.handles:
            _, handle = self.handles.pop()
            handle.remove()
        self.removed = True

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on ``batch`` (the effective batch): returns the (detached) loss.

        Runs :func:`~memfit.apply.stepper.run_step`, the one training loop.

        Raises:
            RuntimeError: after :meth:`remove`.
        """
        if self.removed:
            raise RuntimeError(
                "this training setup's plan was removed from the model; apply a plan again "
                "(apply_plan or switch_plan) to train"
            )
        plan = self.plan
        assert self.stepper is not None
        # Under data parallelism ``batch`` is the global batch: the stepper takes this rank's
        # share, the engine averages the gradients (so the step is the whole batch's) and the
        # stepper averages the loss over the ranks.
        module = self.model if self.parallel is None else self.parallel.module
        total = run_step(
            module,
            batch,
            stepper=self.stepper,
            autocast=self.precision.autocast,
            loss_fn=self.loss_fn,
            micro_batch_size=plan.micro_batch_for,  # of the rank's share
            normalization=plan.loss_normalization,
            max_seq_len=plan.max_seq_len,
        )
        self.steps_done += 1
        return total


#: The engine applying plans in this context (:func:`applied_by`); ``None``: memfit's own.
_ENGINE: ContextVar[str | None] = ContextVar("memfit_engine", default=None)


@contextlib.contextmanager
def applied_by(engine: str) -> Iterator[None]:
    """Within this block, :func:`apply_plan` applies plans for ``engine`` (one of
    :data:`memfit.techniques.ENGINES`, e.g. ``"hf"`` for the Hugging Face bridge): the
    techniques see it in ``ctx.engine`` and refuse what that engine cannot run."""
    token = _ENGINE.set(engine)
    try:
        yield
    finally:
        _ENGINE.reset(token)


def apply_plan(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    optimizer: Any = None,
    loss_fn: LossFn | None = None,
    keep_original_weights: bool = False,
) -> TrainingSetup:
    """Apply ``plan`` to ``model`` and build its optimizer.

    The library-level entry point (the Trainer, the OOM fallback and ``measure`` use it);
    :func:`memfit.prepare` takes the same arguments in the same order and wraps the result for
    a training loop of one's own.

    Args:
        model: The model, in train mode; changed in place (:meth:`TrainingSetup.remove` undoes
            it).
        plan: The plan (default: the plain plan: AdamW, fp32, no technique on).
        optimizer: Use this optimizer instead of building the plan's (not allowed with
            ``optimizer_in_backward``, which builds one optimizer per parameter).
        loss_fn: ``loss_fn(output, batch)``; default: the output's ``.loss`` or scalar output.
        keep_original_weights: For ``bf16-pure``: keep the original weights on the host so
            that removing the plan gives back every weight training did not change bit for bit
            (see :func:`~memfit.strategies.precision.apply_precision`).

    Returns:
        The :class:`TrainingSetup`.

    Raises:
        MemfitTypeError: when an argument has the wrong kind (a plan where the optimizer goes,
            or the reverse), see :func:`check_plan_arguments`.
        ValueError: (a :class:`~memfit.errors.MemfitError`) when the plan cannot apply to
            this model (a freeze pattern that matches nothing, no blocks to checkpoint,
            ``fused_loss`` on a model that is not a Hugging Face causal LM with a linear head)
            or an optimizer is given with ``optimizer_in_backward``.
    """
    check_plan_arguments("apply_plan", model, plan, optimizer, loss_fn, keep_original_weights)
    plan = plan or Plan()
    if plan.optimizer_in_backward and optimizer is not None:
        raise MemfitValueError(
            "optimizer_in_backward builds one optimizer per parameter from the plan; "
            "pass no optimizer (or set optimizer_in_backward false)"
        )
    _check_offload(plan, optimizer)
    if plan.parallel.splits_model:
        raise MemfitValueError(
            f"the plan splits the model over tensor {plan.parallel.tensor} x pipeline "
            f"{plan.parallel.pipeline} x context {plan.parallel.context} processes, which apply_plan (one model per process) "
            "cannot do; build each rank's share with memfit.distributed.layout.build_layout"
        )
    engine = _ENGINE.get() or (
        "data" if plan.parallel.data > 1 or plan.parallel.zero_stage else "single"
    )
    refuse_unsupported(plan, engine, MemfitValueError)
    ctx = ApplyContext(
        plan=plan,
        engine=engine,
        keep_original_weights=keep_original_weights,
        optimizer=optimizer,
        optimizer_given=optimizer is not None,
        dry_stand_in=apply_grad_buffer,
    )
    handles: list[tuple[str, Removable]] = []
    try:
        # The optimizer is built at its place in the order: after every technique that
        # decides what it steps (the trainable set, dtypes, shards), before any later one.
        handles += apply_techniques(model, plan, ctx, until="optimizer")
        optimizer = _build_optimizer(model, plan, ctx.precision, optimizer, ctx.parallel)
        if ctx.parallel is not None:
            ctx.parallel.attach_optimizer(optimizer)  # 1-bit Adam's compressed all-reduce
        if plan.offload is not None and plan.offload.optimizer is not None:
            handles.append(("optimizer_offload", optimizer))
        elif plan.optimizer_in_backward:
            handles.append(("optimizer_in_backward", optimizer))
        handles += apply_techniques(model, plan, ctx, after="optimizer")
    except Exception:
        # A technique that cannot apply leaves the model as it was, not half-changed.
        for _, handle in reversed(handles):
            handle.remove()
        raise
    given = ctx.optimizer_given
    info, precision, parallel = ctx.info, ctx.precision, ctx.parallel
    return TrainingSetup(
        model=model,
        plan=plan,
        optimizer=optimizer,
        loss_fn=loss_fn or (lambda out, batch: loss_from_output(out)),
        precision=precision,
        info=info,
        handles=handles,
        optimizer_given=given,
        parallel=parallel,
    )


def apply_techniques(
    model: nn.Module,
    plan: Plan,
    ctx: ApplyContext,
    *,
    until: str | None = None,
    after: str | None = None,
) -> list[tuple[str, Removable]]:
    """Apply ``plan``'s techniques to ``model`` in the registry's order (the one loop every
    engine runs: :func:`apply_plan`, Lightning's callback, the OOM fallback's swaps).

    Args:
        model: The model, changed in place.
        plan: The plan.
        ctx: Shared state (:class:`~memfit.techniques.ApplyContext`); techniques record what
            they did in ``ctx.info`` and leave the precision runtime and data-parallel handle.
        until: Stop before the technique of this name (the optimizer, which its engine
            builds).
        after: Start after the technique of this name.

    Returns:
        ``(technique name, handle)`` in the order applied. When a technique raises, the ones
        applied by this call are removed first.
    """
    techniques = plan.techniques()
    names = [t.name for t, _ in techniques]
    if until is not None and until in names:
        techniques = techniques[: names.index(until)]
    if after is not None and after in names:
        techniques = techniques[names.index(after) + 1 :]
    handles: list[tuple[str, Removable]] = []
    try:
        for technique, _ in techniques:
            if technique.apply is None:
                continue  # a technique of the step: run_step reads the plan's fields
            handle = technique.apply(model, ctx)
            if handle is not None:
                handles.append((technique.name, handle))
    except Exception:
        for _, handle in reversed(handles):
            handle.remove()
        raise
    return handles


def refuse_unsupported(plan: Plan, engine: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` with the first sentence of a technique ``plan`` turns on that
    ``engine`` cannot apply (each technique says why and what to do instead)."""
    for technique, _ in plan.techniques():
        reason = technique.refuses(plan, engine)
        if reason is not None:
            raise error(reason)


def _check_offload(plan: Plan, optimizer: Any) -> None:
    """Refuse the offload settings apply_plan cannot honour, before anything changes."""
    off = plan.offload
    if off is None:
        return
    if off.optimizer == "disk" and plan.optimizer_in_backward:
        raise MemfitValueError(
            "optimizer offload to 'disk' steps after backward, group by group; set "
            "optimizer_in_backward false (or use optimizer 'host', which steps in backward)"
        )
    if off.parameters is not None and plan.compile_backend is not None:
        raise MemfitValueError(
            "parameter offload with compile is not available yet: its storage resizes run in "
            "hooks dynamo does not trace; set compile false"
        )
    if off.optimizer is not None and optimizer is not None:
        raise MemfitValueError(
            "optimizer offload builds its own optimizer over host copies of the parameters from "
            "the plan; pass no optimizer (or set offload optimizer to null)"
        )


def _build_optimizer(
    model: nn.Module, plan: Plan, precision: Any, optimizer: Any, parallel: Any = None
) -> Any:
    if plan.offload is not None and plan.offload.optimizer is not None:
        from ..strategies.optimizer_offload import HostOffloadOptimizer, host_optimizer_builder

        # fp32 masters on the host: the plan's optimizer as configured (no bf16 wrapper: the
        # host copy is the high-precision weight that bf16-pure's rounding stands in for).
        params = [p for p in model.parameters() if p.requires_grad]
        build = host_optimizer_builder(plan.optimizer)
        if plan.offload.optimizer == "disk":
            from torch._guards import active_fake_mode

            from ..strategies.disk_offload import DiskOffloadOptimizer

            if active_fake_mode() is not None:
                # A dry run writes no files: the host tier's optimizer does the same on the
                # device (the disk tier is its subclass there), and the dry run moves the
                # masters and state from its host figure to disk
                # (memfit.estimate.dryrun._disk_tier_estimate).
                return HostOffloadOptimizer(params, build, plan.offload)

            # Checks disk_dir (exists, writable, room for the state) and the host window
            # before any file is written or step taken.
            return DiskOffloadOptimizer(params, build, plan.offload)
        return HostOffloadOptimizer(
            params,
            build,
            plan.offload,
            step_in_backward=plan.optimizer_in_backward,
            max_grad_norm=plan.max_grad_norm,
        )
    if plan.optimizer_in_backward:
        from ..strategies.fused_step import optimizer_in_backward

        opt_cfg = precision.optimizer_config(plan.optimizer)
        return optimizer_in_backward(
            model,
            lambda ps: precision.wrap_optimizer(opt_cfg.build(ps)),
            grad_accum_steps=plan.grad_accum_steps,
            max_grad_norm=plan.max_grad_norm,
            clip_mode=plan.grad_clip_mode,
        )
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = precision.optimizer_config(plan.optimizer).build(params)
    if parallel is not None:
        optimizer = parallel.shard_optimizer(optimizer)  # ZeRO stage 1; others unchanged
    # bf16-pure wraps the optimizer's step (the runtime unwraps it on removal); other modes
    # return it unchanged.
    return precision.wrap_optimizer(optimizer)


def check_plan_arguments(
    func: str, model: Any, plan: Any, optimizer: Any, loss_fn: Any,
    keep_original_weights: Any = False,
) -> None:
    """Refuse arguments of the wrong kind with one sentence (shared by :func:`apply_plan`
    and :func:`memfit.prepare`, whose signature is ``(model, plan=None, *, optimizer=None,
    loss_fn=None)``).

    Raises:
        MemfitTypeError: (a ``TypeError``) for a model that is not an ``nn.Module``, a plan
            that is not a :class:`~memfit.plan.Plan` (an optimizer where the plan goes, as the
            old ``prepare(model, optimizer, plan)`` order had it), an optimizer that is a plan
            or has no ``step``/``param_groups``, a ``loss_fn`` that is not callable, or a
            ``keep_original_weights`` that is not a bool.
    """
    if not isinstance(model, nn.Module):
        raise MemfitTypeError(
            f"{func}(model, plan, *, optimizer=..., loss_fn=...) takes an nn.Module first, "
            f"got {describe(model)}"
        )
    if plan is not None and not isinstance(plan, Plan):
        hint = (
            "pass an optimizer as optimizer=..."
            if hasattr(plan, "param_groups")
            else "build one with memfit.Plan(...) or Plan.from_dict(...)"
        )
        raise MemfitTypeError(
            f"{func}(model, plan, *, optimizer=...) takes a memfit.Plan second, got "
            f"{describe(plan)}; {hint}"
        )
    if isinstance(optimizer, Plan):
        raise MemfitTypeError(
            f"optimizer= got a memfit.Plan; pass the plan second: {func}(model, plan)"
        )
    if optimizer is not None and not (
        hasattr(optimizer, "step") and hasattr(optimizer, "param_groups")
    ):
        raise MemfitTypeError(
            f"optimizer= takes a torch optimizer (with step and param_groups), got "
            f"{describe(optimizer)}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise MemfitTypeError(
            f"loss_fn= takes a function loss_fn(output, batch) -> loss, got "
            f"{describe(loss_fn)}"
        )
    check_bool(keep_original_weights, "keep_original_weights")
