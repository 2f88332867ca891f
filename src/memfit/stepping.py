"""The :class:`Stepper` protocol, what every engine's step is, and :class:`BaseStepper`, its
defaults.

A stepper owns everything between a batch and updated parameters that differs from engine to
engine: which share of the batch this process trains on, what to do before a micro-batch's
forward (a data-parallel engine decides there whether its backward synchronises), what
backward and the step mean, how the step's loss is reported, and its checkpointable state.
:func:`memfit.apply.stepper.run_step`, the one training loop, drives it; the steppers
themselves live with their engines (:mod:`memfit.apply.stepper`'s plain and fused ones,
optimizer offload's, data parallelism's, the tensor/pipeline layout's).

This module stands below the engines (``strategies/`` and ``distributed/`` subclass
:class:`BaseStepper`) and imports only :mod:`memfit.workload`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from .workload import Batch

__all__ = ["BaseStepper", "Stepper"]


@runtime_checkable
class Stepper(Protocol):
    """Turns a batch's micro-batch losses into one optimizer step.

    Per optimizer step the loop takes this process's share of the batch
    (:meth:`local_batch`), then per micro-batch calls :meth:`before_forward`, runs the
    forward, and :meth:`backward` (``last=True`` on the last one); then :meth:`step` and
    :meth:`zero_grad`, and reports :meth:`reduce_loss` of the step's loss. Between
    ``backward(..., last=True)`` and ``step`` the gradients (if the stepper keeps any) are
    the step's whole gradient, so a caller may still rescale them (``prepare()``'s token
    weighting does).

    A stepper whose engine runs the step's forwards and backwards itself (a pipeline schedule)
    sets :attr:`owns_forward` and does them in :meth:`forward_backward` instead.
    """

    owns_forward: bool

    def local_batch(self, batch: Batch) -> Batch:
        """This process's share of the step's (global) batch."""

    def before_forward(self, last: bool) -> None:
        """Before a micro-batch's forward; ``last``: its backward ends the step."""

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Backpropagate one micro-batch's (weighted) loss; ``last`` ends the step's
        micro-batches (a distributed engine synchronises gradients only then)."""

    def forward_backward(self, batch: Batch, *, autocast: Callable[[], Any]) -> torch.Tensor:
        """With :attr:`owns_forward`: the step's forwards and backwards over ``batch`` (this
        process's share, already prepared); returns the step's loss (detached)."""

    def step(self) -> None:
        """Apply the accumulated gradients (unscaling, clipping, as configured)."""

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``): they hold no memory between steps."""

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as reported: this process's, or the mean over its replicas."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (and scaler) state, for checkpoints."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class BaseStepper:
    """The defaults of a :class:`Stepper` on one process: the whole batch is this process's,
    nothing happens before a forward, the loop runs the forwards, the loss is reported as it
    is. A stepper subclasses it and writes ``backward``, ``step``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict``, and only the defaults its engine changes."""

    #: Whether :meth:`forward_backward` runs the step's forwards and backwards (a pipeline
    #: schedule) instead of the loop's micro-batch forwards and :meth:`backward`.
    owns_forward: bool = False

    def local_batch(self, batch: Batch) -> Batch:
        """The whole batch: one process trains on all of it."""
        return batch

    def before_forward(self, last: bool) -> None:
        """Nothing to decide before a forward."""

    def forward_backward(self, batch: Batch, *, autocast: Callable[[], Any]) -> torch.Tensor:
        """Only for steppers that set :attr:`owns_forward`."""
        raise NotImplementedError(
            f"{type(self).__name__} leaves the forwards to the loop (owns_forward is False)"
        )

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as it is: this process trained on the whole batch."""
        return loss
