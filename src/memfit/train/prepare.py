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
            prepared.backward(loss, batch=micro_batch)   # weighted as the plan says
        # the optimizer stepped (and gradients were cleared) after every
        # grad_accum_steps-th block

(``prepared.loss(micro_batch)`` is the plan's own forward and loss: truncation, autocast.)
Both ways run the plan's :class:`~memfit.strategies.stepper.Stepper`, as the trainer does.

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
        self._tokens = 0.0  # loss terms seen towards the current step ("tokens" normalisation)

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

    def loss(self, micro_batch: Batch) -> torch.Tensor:
        """The loss of one micro-batch as the plan computes it: truncated to ``max_seq_len``,
        the forward and the loss under the plan's autocast. For loops that do not need their
        own forward."""
        from ..strategies.stepper import prepare_batch
        from ..workload import call_model

        micro_batch = prepare_batch(micro_batch, self.plan.max_seq_len)
        with self.autocast():
            return self.setup.loss_fn(call_model(self.model, micro_batch), micro_batch)

    def backward(
        self, loss: torch.Tensor, *, batch: Batch | None = None, weight: float | None = None
    ) -> None:
        """Backward of one micro-batch's loss, weighted for accumulation.

        Args:
            loss: The micro-batch's mean loss.
            batch: The micro-batch. With ``loss_normalization="tokens"`` it is needed: the
                loss is weighted by the micro-batch's count of loss terms (label tokens that
                are not ignored), and the accumulated gradients are divided by the step's total
                before the optimizer steps, which is exactly the full batch's token-mean
                gradient, whatever the micro-batches' sizes.
            weight: An explicit share of the step's loss instead (``mean``: default
                ``1 / grad_accum_steps``).

        Raises:
            ValueError: for token normalisation without ``batch``, or with the optimizer step
                fused into backward (the step's token total is not known before its last
                backward: use :meth:`step`, which weighs the whole batch first).
        """
        tokens = self.plan.loss_normalization == "tokens" and weight is None
        if tokens:
            if batch is None:
                raise ValueError(
                    "loss_normalization 'tokens' weighs each micro-batch by its label tokens: "
                    "pass the micro-batch, prepared.backward(loss, batch=micro_batch)"
                )
            if self.plan.optimizer_in_backward:
                raise ValueError(
                    "loss_normalization 'tokens' with the optimizer step fused into backward "
                    "needs the whole step's token count before its last backward; use "
                    "prepared.step(batch) for such plans"
                )
            from ..strategies.accumulation import count_loss_terms
            from ..strategies.stepper import prepare_batch

            w = float(count_loss_terms(prepare_batch(batch, self.plan.max_seq_len)))
            self._tokens += w
        else:
            w = weight if weight is not None else 1.0 / self.plan.grad_accum_steps
        self.setup.stepper.backward(loss * w, last=self.sync_gradients)

    def _optimizer_step(self) -> None:
        if self._tokens:
            # Micro-batch losses were weighted by their token counts: divide by the total.
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(self._tokens)
            self._tokens = 0.0
        stepper = self.setup.stepper
        stepper.step()
        stepper.zero_grad()
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
