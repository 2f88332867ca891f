"""The Stepper: how gradients become parameter updates, behind one small protocol.

Every way of training runs the same micro-batch loop, :func:`run_step` (truncation to
``max_seq_len``, the micro-batch split, the loss weights, the forward under autocast, backward
through the stepper, the step): :meth:`~memfit.apply.compose.TrainingSetup.step`,
``prepare()``'s ``step``, and the OOM fallback. A user's own loop (``prepare()``'s
``accumulate`` + ``backward``) uses the same pieces one micro-batch at a time:
:func:`forward_loss` for the forward, the stepper's ``backward``, :func:`finish_step` for the
step. The :class:`Stepper` decides what backward and the step mean:

* :class:`PlainStepper`: backward through the precision runtime (loss scaling for fp16),
  then clipping, the optimizer step and ``zero_grad(set_to_none=True)``;
* :class:`FusedStepper`: the optimizer step fused into backward
  (:func:`~memfit.strategies.fused_step.optimizer_in_backward`); ``step`` has nothing left.

The protocol and its defaults (:class:`~memfit.stepping.Stepper`,
:class:`~memfit.stepping.BaseStepper`) stand a floor below the engines, in
:mod:`memfit.stepping`, so that each engine's stepper lives with it. Engines that step
differently plug in as further steppers, without another copy of the loop:
an offload engine (gradients moved to the host in ``backward``, a host optimizer in
``step``), DDP or FSDP2 (a rank's share of the batch, no gradient synchronisation unless
``last``, the sharded optimizer in ``step``, the loss averaged over the ranks), the
tensor/pipeline layout (its pipeline schedule runs the forwards and backwards). A stepper owns
everything between a weighted micro-batch loss and updated parameters, including its own
checkpointable state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..stepping import BaseStepper, Stepper
from ..workload import Batch, batch_size_of, call_model, split_batch

__all__ = [
    "BaseStepper",
    "FusedStepper",
    "PlainStepper",
    "Stepper",
    "finish_step",
    "forward_loss",
    "make_stepper",
    "prepare_batch",
    "run_step",
]


class PlainStepper(BaseStepper):
    """Backward, then clip, step and zero the gradients.

    Args:
        optimizer: The optimizer.
        precision: The precision runtime (``backward`` scales for fp16; ``step`` unscales,
            skips on overflow, clips).
        model: The model (for runtimes that need it).
        max_grad_norm: Clip to this global norm (``None``: no clipping).
    """

    def __init__(
        self, optimizer: Any, precision: Any, model: nn.Module, max_grad_norm: float | None
    ) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self.model = model
        self.max_grad_norm = max_grad_norm

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.precision.backward(loss)

    def step(self) -> None:
        self.precision.step(self.optimizer, max_grad_norm=self.max_grad_norm, model=self.model)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict()}
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])


class FusedStepper(BaseStepper):
    """The optimizer step fused into backward: each parameter steps when its gradient is
    ready, inside :meth:`backward` of the last micro-batch.

    Args:
        handle: The :class:`~memfit.strategies.fused_step.OptimizerInBackward` handle.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.handle.backward(loss, last=last)

    def begin_step(self, last: bool) -> None:
        """Before a micro-batch's backward that someone else's loop runs (``loss.backward()``
        in the Hugging Face Trainer): whether it ends the step (the hooks then step each
        parameter) or accumulates. See
        :meth:`~memfit.strategies.fused_step.OptimizerInBackward.begin_step`."""
        self.handle.begin_step(last)

    def end_step(self) -> None:
        """After the last backward of a step begun with :meth:`begin_step`: step the
        parameters the last micro-batch left without a gradient, record the step's norm."""
        self.handle.end_step()

    def step(self) -> None:
        """Nothing left: the parameters stepped during the last backward."""

    def zero_grad(self) -> None:
        """Nothing to drop: the fused step frees each gradient after its update."""

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.handle.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.handle.load_state_dict(state["optimizer"])


def make_stepper(
    optimizer: Any,
    precision: Any,
    model: nn.Module,
    *,
    fused: bool,
    max_grad_norm: float | None,
) -> Stepper:
    """The stepper for a plan: :class:`FusedStepper` over an optimizer-in-backward handle
    (``fused``), else :class:`PlainStepper`."""
    if hasattr(optimizer, "make_stepper"):  # an engine that steps its own way (offload)
        return optimizer.make_stepper(precision, model, max_grad_norm)
    if fused:
        return FusedStepper(optimizer)
    return PlainStepper(optimizer, precision, model, max_grad_norm)


def prepare_batch(batch: Batch, max_seq_len: int | None) -> Batch:
    """The batch as the plan trains on it (truncated to ``max_seq_len`` when set)."""
    if max_seq_len is None:
        return batch
    from ..strategies.sequence import truncate

    return truncate(batch, max_seq_len)


def forward_loss(
    model: nn.Module,
    batch: Batch,
    *,
    autocast: Callable[[], Any],
    loss_fn: Callable[[Any, Batch], torch.Tensor],
) -> torch.Tensor:
    """The loss of one (already truncated) micro-batch: the forward and the loss under
    ``autocast``. The model's output is dropped as soon as the loss exists."""
    with autocast():
        out = call_model(model, batch)
        loss = loss_fn(out, batch)
    del out
    return loss


def finish_step(stepper: Stepper, model: nn.Module, *, divide_by: float | None = None) -> None:
    """End an optimizer step: divide the accumulated gradients by ``divide_by`` when given
    (a user loop that weighted micro-batch losses by their token counts), then ``step`` and
    ``zero_grad``."""
    if divide_by is not None:
        divide = getattr(stepper, "divide_grads", None)
        if divide is not None:  # the stepper keeps the gradients elsewhere (offload: the host)
            divide(divide_by)
        else:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(divide_by)
    stepper.step()
    stepper.zero_grad()


def run_step(
    model: nn.Module,
    batch: Batch,
    *,
    stepper: Stepper,
    autocast: Callable[[], Any],
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None,
    micro_batch_size: int | Callable[[int], int],
    normalization: str,
    max_seq_len: int | None,
) -> torch.Tensor:
    """One optimizer step over ``batch``: the one training loop.

    Takes the stepper's share of ``batch`` (:meth:`~memfit.stepping.Stepper.local_batch`: a
    data-parallel rank's slice), truncates it to ``max_seq_len``, splits it into micro-batches
    of ``micro_batch_size``, weighs their losses
    (:func:`~memfit.strategies.accumulation.loss_weights`: ``n_i / N`` for ``mean``,
    ``t_i / T`` label tokens for ``tokens``, so the weighted sum is the whole batch's loss),
    runs each forward under ``autocast`` (:func:`forward_loss`), hands each weighted loss to
    ``stepper``, then steps and zeroes the gradients (:func:`finish_step`). A stepper that
    runs the forwards and backwards itself (``owns_forward``: a pipeline schedule, which splits
    the micro-batches its own way) gets the prepared share whole instead.

    Args:
        model: What the forwards run through.
        batch: The step's batch (the global one, under data parallelism).
        stepper: The engine's :class:`~memfit.stepping.Stepper`.
        autocast: The precision's autocast context factory.
        loss_fn: ``loss_fn(output, micro_batch)`` (unused when the stepper owns the forward).
        micro_batch_size: Samples per micro-batch, or a function of the share's size giving it.
        normalization: ``"mean"`` or ``"tokens"``.
        max_seq_len: Truncate sequences to this length (``None``: as they come).

    Returns:
        The (detached) loss of the whole batch, as the stepper reports it
        (:meth:`~memfit.stepping.Stepper.reduce_loss`: the mean over data-parallel replicas).
    """
    batch = prepare_batch(stepper.local_batch(batch), max_seq_len)
    if stepper.owns_forward:
        total = stepper.forward_backward(batch, autocast=autocast)
        finish_step(stepper, model)
        return stepper.reduce_loss(total)
    assert loss_fn is not None
    total = _micro_batches(model, batch, stepper, autocast, loss_fn, micro_batch_size,
                           normalization)
    finish_step(stepper, model)
    return stepper.reduce_loss(total)


def _micro_batches(
    model: nn.Module,
    batch: Batch,
    stepper: Stepper,
    autocast: Callable[[], Any],
    loss_fn: Callable[[Any, Batch], torch.Tensor],
    micro_batch_size: int | Callable[[int], int],
    normalization: str,
) -> torch.Tensor:
    """The loop's forwards and backwards over ``batch``'s weighted micro-batches; returns the
    batch's loss (the weighted sum, detached)."""
    from ..strategies.accumulation import loss_weights

    size = batch_size_of(batch)
    if callable(micro_batch_size):
        micro_batch_size = micro_batch_size(size)
    parts: Sequence[Batch] = split_batch(batch, micro_batch_size) if micro_batch_size < size else [batch]
    weights = loss_weights(parts, normalization)
    # A micro-batch without a loss term (every label ignored) has weight 0 and a NaN mean
    # loss: it is skipped, and the last one that counts ends the step.
    live = [i for i, w in enumerate(weights) if w > 0]
    total: torch.Tensor | None = None
    for i in live:
        part, weight = parts[i], weights[i]
        # A data-parallel stepper decides before the forward whether its backward synchronises.
        stepper.before_forward(i == live[-1])
        loss = forward_loss(model, part, autocast=autocast, loss_fn=loss_fn)
        stepper.backward(loss * weight, last=i == live[-1])
        contribution = loss.detach() * weight
        total = contribution if total is None else total + contribution
        # Only the running total outlives its micro-batch: every micro-batch after the first
        # then holds the same scalars, so two micro-batches (what a composed prediction runs)
        # show the peak of any number of them.
        del loss, contribution
    assert total is not None
    return total
