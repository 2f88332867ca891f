"""The Stepper: how gradients become parameter updates, behind one small protocol.

Every way of training (a whole-batch step, a user's own loop through ``prepare``, the OOM
fallback) runs the same micro-batch loop (:func:`run_step`) and hands each loss to a
:class:`Stepper`. The stepper decides what backward and the step mean:

* :class:`PlainStepper`: backward through the precision runtime (loss scaling for fp16),
  then clipping, the optimizer step and ``zero_grad(set_to_none=True)``;
* :class:`FusedStepper`: the optimizer step fused into backward
  (:func:`~memfit.strategies.fused_step.optimizer_in_backward`); ``step`` has nothing left to do.

Offload and the distributed engines plug in as further steppers (host optimizers, FSDP2 and
DDP with their own synchronisation), without another copy of the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..workload import Batch, batch_size_of, call_model, split_batch

__all__ = ["FusedStepper", "PlainStepper", "Stepper", "run_step"]


@runtime_checkable
class Stepper(Protocol):
    """Turns micro-batch losses into one optimizer step."""

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Backpropagate one micro-batch's (weighted) loss; ``last`` ends the step's
        micro-batches."""

    def step(self) -> None:
        """Apply the accumulated gradients (clipping, scaling as configured)."""

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``)."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (and scaler) state, for checkpoints."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class PlainStepper:
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


class FusedStepper:
    """The optimizer step fused into backward: each parameter steps when its gradient is
    ready, inside :meth:`backward` of the last micro-batch.

    Args:
        handle: The :class:`~memfit.strategies.fused_step.OptimizerInBackward` handle.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.handle.backward(loss, last=last)

    def step(self) -> None:
        """Nothing left: the parameters stepped during the last backward."""

    def zero_grad(self) -> None:
        """Nothing to drop: the fused step frees each gradient after its update."""

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.handle.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.handle.load_state_dict(state["optimizer"])


def prepare_batch(batch: Batch, max_seq_len: int | None) -> Batch:
    """The batch as the plan trains on it (truncated to ``max_seq_len`` when set)."""
    if max_seq_len is None:
        return batch
    from .sequence import truncate

    return truncate(batch, max_seq_len)


def run_step(
    model: nn.Module,
    batch: Batch,
    *,
    stepper: Stepper,
    autocast: Callable[[], Any],
    loss_fn: Callable[[Any, Batch], torch.Tensor],
    micro_batch_size: int,
    normalization: str,
    max_seq_len: int | None,
) -> torch.Tensor:
    """One optimizer step over ``batch``: truncate, split into micro-batches, weight their
    losses (mean or token-weighted), run each forward under ``autocast``, hand each loss to
    ``stepper``, then step and zero the gradients. Returns the (detached) loss of the batch.

    This is the one training loop: :meth:`TrainingSetup.step`, ``prepare()`` and the OOM
    fallback all run it.
    """
    from .accumulation import loss_weights

    batch = prepare_batch(batch, max_seq_len)
    size = batch_size_of(batch)
    parts: Sequence[Batch] = split_batch(batch, micro_batch_size) if micro_batch_size < size else [batch]
    weights = loss_weights(parts, normalization)
    total: torch.Tensor | None = None
    for i, (part, weight) in enumerate(zip(parts, weights, strict=True)):
        with autocast():
            out = call_model(model, part)
            loss = loss_fn(out, part)
        del out
        stepper.backward(loss * weight, last=i == len(parts) - 1)
        contribution = loss.detach() * weight
        total = contribution if total is None else total + contribution
        del loss
    stepper.step()
    stepper.zero_grad()
    assert total is not None
    return total
