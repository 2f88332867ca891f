"""``prepare``: a plan applied to a model for people who keep their own training loop.

Two ways to use it::

    prepared = memfit.train.prepare(model, plan=plan)
    for batch in loader:
        loss = prepared.step(batch)      # one optimizer step, micro-batched as the plan says

or, when the loop computes its own loss::

    for micro_batch in loader:
        with prepared.accumulate():
            with prepared.autocast():
                loss = my_loss(prepared.model(**micro_batch), micro_batch)
            prepared.backward(loss)      # scaled by 1 / grad_accum_steps
        # the optimizer stepped (and gradients were cleared) after every
        # grad_accum_steps-th block

Do not call ``optimizer.step()`` yourself inside ``accumulate``: the context does it at the
right micro-batch, with the plan's clipping, loss scaling and optimizer-in-backward handling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..plan import Plan
from ..strategies.compose import LossFn, TrainingSetup, apply_plan
from ..workload import Batch

__all__ = ["Prepared", "prepare"]


class Prepared:
    """A model with a plan applied, steppable whole-batch or micro-batch by micro-batch.

    Args:
        setup: The :class:`~memfit.strategies.compose.TrainingSetup` to drive.

    Attributes:
        setup: The setup (plan, precision runtime, info).
    """

    def __init__(self, setup: TrainingSetup) -> None:
        self.setup = setup
        self._micro = 0  # micro-batches done towards the current optimizer step
        self._open = False

    @property
    def model(self) -> nn.Module:
        """The model (possibly checkpointed or cast by the plan)."""
        return self.setup.model

    @property
    def optimizer(self) -> Any:
        """The optimizer (or the optimizer-in-backward handle)."""
        return self.setup.optimizer

    @property
    def plan(self) -> Plan:
        """The plan applied."""
        return self.setup.plan

    @property
    def sync_gradients(self) -> bool:
        """Whether the current (or next) micro-batch ends an optimizer step."""
        return self._micro + 1 >= self.plan.grad_accum_steps

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step over ``batch`` (the effective batch), micro-batched, truncated,
        cast, clipped as the plan says. Returns the (detached) loss of the whole batch."""
        return self.setup.step(batch)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The plan's autocast context (a no-op in fp32): run the forward and loss under it."""
        return self.setup.precision.autocast()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[Prepared]:
        """One micro-batch: call :meth:`backward` inside; the optimizer steps on exit after
        every ``grad_accum_steps``-th micro-batch, then gradients are cleared.

        A micro-batch whose body raises is not counted (and nothing steps).
        """
        if self._open:
            raise RuntimeError("prepared.accumulate() blocks cannot be nested")
        self._open = True
        try:
            yield self
        finally:
            self._open = False
        self._micro += 1
        if self._micro >= self.plan.grad_accum_steps:
            self._micro = 0
            self._optimizer_step()

    def backward(self, loss: torch.Tensor, *, weight: float | None = None) -> None:
        """Backward of one micro-batch's loss, scaled for accumulation.

        Args:
            loss: The micro-batch's mean loss.
            weight: Its share of the optimizer step's loss; default ``1 / grad_accum_steps``,
                exact when every micro-batch has as many loss terms (see
                :func:`memfit.strategies.accumulation.loss_weights` for token-weighted
                shares).
        """
        w = weight if weight is not None else 1.0 / self.plan.grad_accum_steps
        scaled = loss * w
        if self.plan.optimizer_in_backward:
            # The fused handle steps inside this backward when told it is the last one.
            self.optimizer.backward(scaled, last=self.sync_gradients)
        else:
            self.setup.precision.backward(scaled)

    def _optimizer_step(self) -> None:
        if self.plan.optimizer_in_backward:
            self.setup.steps_done += 1
            return
        self.setup.precision.step(self.optimizer, max_grad_norm=self.plan.max_grad_norm, model=self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.setup.steps_done += 1


def prepare(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    optimizer: Any = None,
    loss_fn: LossFn | None = None,
) -> Prepared:
    """Apply ``plan`` to ``model`` for a training loop you write yourself.

    The same arguments, in the same order, as :func:`memfit.apply_plan`, which returns the
    bare :class:`~memfit.strategies.compose.TrainingSetup` this wraps.

    Args:
        model: The model, in train mode.
        plan: The plan (default: plain AdamW, fp32).
        optimizer: Your optimizer, used instead of the plan's (not with
            ``optimizer_in_backward``, which builds its own per-parameter optimizers).
        loss_fn: ``loss_fn(output, batch)`` for :meth:`Prepared.step`; default: the output's
            ``.loss``.

    Returns:
        The :class:`Prepared` model, optimizer and step.

    Raises:
        TypeError: when ``plan`` is not a :class:`~memfit.plan.Plan` (an optimizer passed
            where the plan goes, as the old ``prepare(model, optimizer, plan)`` order did) or
            ``optimizer`` is a plan.
    """
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(
            f"prepare(model, plan, *, optimizer=...) takes a memfit.Plan second, got a "
            f"{type(plan).__name__}; pass an optimizer as optimizer=..."
        )
    if isinstance(optimizer, Plan):
        raise TypeError("optimizer= got a memfit.Plan; pass the plan second: prepare(model, plan)")
    return Prepared(apply_plan(model, plan, loss_fn=loss_fn, optimizer=optimizer))
