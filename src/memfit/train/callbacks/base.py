"""What a trainer callback is: a few hooks the training loop calls, all optional.

The loop of :class:`~memfit.train.Trainer` is, per step::

    batch = next batch
    with every callback's step_context(trainer, batch):   # e.g. the memory tracker
        loss = the OOM fallback's step(batch)            # TrainingSetup.step, the Stepper
    every callback's on_step_end(trainer, info)          # progress, evaluation, checkpoints

with :meth:`Callback.on_fit_start` before the first step, :meth:`Callback.on_plan_switch` when a
step-down moves to another plan, and :meth:`Callback.on_fit_end` after the last step (or after an
error). Callbacks run in the trainer's order; give your own with ``Trainer(callbacks=[...])``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ...apply.compose import TrainingSetup
from ...plan import Plan
from ...workload import Batch
from ..result import TrainResult

__all__ = ["Callback", "MemoryFigures", "OnStep", "StepInfo", "TrainerLike", "due"]


class MemoryFigures(Protocol):
    """The running memory figures a trainer shows (its memory-report callback has them)."""

    @property
    def live_bytes(self) -> int:
        """Live bytes at the end of the last tracked step."""
        ...

    @property
    def peak_bytes(self) -> int:
        """The highest peak of the tracked steps so far."""
        ...


class TrainerLike(Protocol):
    """What a callback may use of the :class:`memfit.train.Trainer` that runs it.

    A protocol, not the class, so that the callbacks sit below the trainer (which imports
    them) with no import cycle; the trainer's own documentation describes each member.
    """

    model: nn.Module
    setup: TrainingSetup
    scheduler: Any
    stream: Any
    batch_size: int
    max_steps: int
    step_count: int
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    callbacks: list[Callback]
    memory: MemoryFigures

    @property
    def plan(self) -> Plan: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def checkpoint_dir(self) -> Path | None: ...

    def adopt_setup(self, setup: TrainingSetup, rebuilt: bool) -> None: ...

    def switch_plan(self, plan: Plan) -> None: ...

    def say(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...


@dataclass
class StepInfo:
    """What a step did, handed to :meth:`Callback.on_step_end` (and ``on_step`` functions).

    Attributes:
        step: Steps done (1-based: the step just finished).
        loss: Its loss.
        batch: The batch it trained on.
        indices: The dataset indices of the batch's samples (empty for batches that came
            from an iterable or a workload's batch maker).
        plan: The plan in force (after any step-down).
        tokens: Input tokens in the batch (by its attention mask, else its input ids).
    """

    step: int
    loss: float
    batch: Batch
    indices: list[int]
    plan: Plan
    tokens: int = 0


class Callback:
    """Base of the trainer's callbacks; every hook does nothing unless overridden."""

    def on_fit_start(self, trainer: TrainerLike) -> None:
        """Before the first step of :meth:`~memfit.train.Trainer.fit` (after a resume)."""

    def step_context(self, trainer: TrainerLike, batch: Batch) -> AbstractContextManager[Any]:
        """A context entered around the step on ``batch`` (its retries after an OOM included)."""
        return contextlib.nullcontext()

    def on_step_end(self, trainer: TrainerLike, info: StepInfo) -> None:
        """After each optimizer step (``trainer.step_count`` already counts it)."""

    def on_plan_switch(self, trainer: TrainerLike, rebuilt: bool) -> None:
        """After a step-down moved the run to ``trainer.plan`` (``rebuilt``: a new optimizer)."""

    def on_fit_end(self, trainer: TrainerLike, result: TrainResult | None) -> None:
        """After the run: ``result`` is the run's outcome, ``None`` when the run raised."""


class OnStep(Callback):
    """A function called with the :class:`StepInfo` of every step (``Trainer(on_step=fn)``)."""

    def __init__(self, fn: Callable[[StepInfo], None]) -> None:
        self.fn = fn

    def on_step_end(self, trainer: TrainerLike, info: StepInfo) -> None:
        self.fn(info)


def due(step: int, max_steps: int, every: int | None) -> bool:
    """Whether a periodic action (evaluation, checkpoint) runs after ``step`` steps: every
    ``every`` steps and after the last one."""
    return step == max_steps or bool(every and step % every == 0)

