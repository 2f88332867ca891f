"""Apply a whole :class:`~memfit.plan.Plan` to a model and run training steps under it.

Each technique lives in its own module and knows nothing of the others; this is the one place
where they meet, in a fixed order:

1. freezing (decides which parameters train),
2. precision (may cast the model to bf16),
3. checkpointing (wraps blocks; sees the final dtypes and the frozen set),
4. the optimizer, fused into backward or not,
5. per step: sequence truncation, micro-batches with normalised losses, autocast and loss
   scaling, clipping, the optimizer step and ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan import Plan
from ..workload import Batch, loss_from_output

__all__ = ["TrainingSetup", "apply_plan"]

LossFn = Callable[[Any, Batch], torch.Tensor]


@dataclass
class TrainingSetup:
    """A model with a plan applied, ready to step.

    Attributes:
        model: The (possibly wrapped or cast) model.
        plan: The plan applied.
        optimizer: The optimizer, or the optimizer-in-backward handle.
        loss_fn: Turns (output, batch) into a scalar loss.
        precision: The precision runtime (autocast context, loss scaler).
        info: What each technique did (frozen names, wrapped blocks, ...), for reports.
    """

    model: nn.Module
    plan: Plan
    optimizer: Any
    loss_fn: LossFn
    precision: Any
    info: dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    undo: list[tuple[str, Callable[[], None]]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Take the plan off the model, last technique first: the fused step's hooks,
        checkpointing's wrappers, bf16-pure's dtypes and input hook, freezing's
        ``requires_grad``. The model is then what it was before :func:`apply_plan` (its
        parameter values are the trained ones), ready for another plan; this setup must not
        step again."""
        while self.undo:
            _, undo = self.undo.pop()
            undo()

    @property
    def stepper(self) -> Any:
        """The :class:`~memfit.strategies.stepper.Stepper` that turns losses into updates."""
        from .stepper import FusedStepper, PlainStepper

        if self.plan.optimizer_in_backward:
            return FusedStepper(self.optimizer)
        return PlainStepper(self.optimizer, self.precision, self.model, self.plan.max_grad_norm)

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on ``batch`` (the effective batch): returns the (detached) loss.

        Runs :func:`~memfit.strategies.stepper.run_step`, the one training loop."""
        from .stepper import run_step

        plan = self.plan
        total = run_step(
            self.model,
            batch,
            stepper=self.stepper,
            autocast=self.precision.autocast,
            loss_fn=self.loss_fn,
            micro_batch_size=plan.micro_batch_for(_batch_size(prepare_batch(batch, plan))),
            normalization=plan.loss_normalization,
            max_seq_len=plan.max_seq_len,
        )
        self.steps_done += 1
        return total


def apply_plan(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: Any = None,
) -> TrainingSetup:
    """Apply ``plan`` to ``model`` and build its optimizer.

    Args:
        model: The model, in train mode.
        plan: The plan (default: the plain plan: AdamW, fp32, no technique on).
        loss_fn: ``loss_fn(output, batch)``; default: the output's ``.loss`` or scalar output.
        optimizer: Use this optimizer instead of building the plan's (not allowed with
            ``optimizer_in_backward``, which needs a factory).

    Returns:
        The :class:`TrainingSetup`.
    """
    plan = plan or Plan()
    info: dict[str, Any] = {}
    undo: list[tuple[str, Callable[[], None]]] = []  # (technique, how to take it off)
    if plan.freeze:
        from .freezing import apply_freezing

        trainable = {n: p.requires_grad for n, p in model.named_parameters()}
        info["frozen"] = apply_freezing(model, plan.freeze)
        undo.append(("freeze", lambda: _restore_requires_grad(model, trainable)))
    from .precision import apply_precision, remove_precision

    dtypes = {n: t.dtype for n, t in model.named_parameters(remove_duplicate=False)}
    dtypes.update({n: t.dtype for n, t in model.named_buffers(remove_duplicate=False)})
    precision = apply_precision(model, plan.precision)
    undo.append(("precision", lambda: remove_precision(model, dtypes)))
    if plan.checkpointing.mode != "none":
        from .checkpointing import apply_checkpointing, remove_checkpointing

        info["checkpointed"] = apply_checkpointing(model, plan.checkpointing)
        undo.append(("checkpointing", lambda: remove_checkpointing(model)))
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.optimizer_in_backward:
        if optimizer is not None:
            raise ValueError(
                "optimizer_in_backward builds one optimizer per parameter from the plan; "
                "pass no optimizer (or set optimizer_in_backward false)"
            )
        from .fused_step import optimizer_in_backward

        opt_cfg = precision.optimizer_config(plan.optimizer)
        optimizer = optimizer_in_backward(
            model,
            lambda ps: precision.wrap_optimizer(opt_cfg.build(ps)),
            grad_accum_steps=plan.grad_accum_steps,
            max_grad_norm=plan.max_grad_norm,
            clip_mode=plan.grad_clip_mode,
        )
        undo.append(("optimizer_in_backward", optimizer.remove))
    elif optimizer is None:
        optimizer = precision.optimizer_config(plan.optimizer).build(params)
        optimizer = precision.wrap_optimizer(optimizer)
    return TrainingSetup(
        model=model,
        plan=plan,
        optimizer=optimizer,
        loss_fn=loss_fn or (lambda out, batch: loss_from_output(out)),
        precision=precision,
        info=info,
        undo=undo,
    )


def _restore_requires_grad(model: nn.Module, trainable: dict[str, bool]) -> None:
    for name, p in model.named_parameters():
        if name in trainable:
            p.requires_grad_(trainable[name])


def prepare_batch(batch: Batch, plan: Plan) -> Batch:
    """``batch`` as ``plan`` trains on it (sequences truncated to ``max_seq_len``)."""
    from .stepper import prepare_batch as _prepare

    return _prepare(batch, plan.max_seq_len)


def _batch_size(batch: Batch) -> int:
    from ..workload import batch_size_of

    return batch_size_of(batch)
