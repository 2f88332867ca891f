"""The out-of-memory fallback as the trainer's step: step the plan down and redo the step.

:class:`OOMFallbackCallback` runs each step through :class:`~memfit.train.oom.OOMFallback`
(which runs ``TrainingSetup.step``, the one loop over the plan's Stepper). When a step runs out
of memory it moves the trainer to the next plan (remove-then-apply on the same model), tells the
other callbacks (:meth:`~memfit.train.callbacks.base.Callback.on_plan_switch`) and redoes the step
from the same batch and RNG state, so no sample is lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...apply.compose import TrainingSetup
from ...plan import Plan
from ...workload import Batch
from ..oom import OOMFallback, StepDown
from .base import Callback, TrainerLike

__all__ = ["OOMFallbackCallback"]


class OOMFallbackCallback(Callback):
    """Runs the trainer's steps with an :class:`~memfit.train.oom.OOMFallback`.

    Args:
        fallback_plans: Plans to try when a step runs out of memory (for example the planner's
            frontier); see :meth:`~memfit.train.oom.OOMFallback.next_plan` for the order.
    """

    def __init__(self, fallback_plans: Sequence[Plan] | None = None) -> None:
        self.fallback_plans = None if fallback_plans is None else list(fallback_plans)
        self.fallback: OOMFallback | None = None

    @property
    def step_downs(self) -> list[StepDown]:
        """The step-downs taken in this fit, oldest first."""
        return [] if self.fallback is None else list(self.fallback.step_downs)

    def on_fit_start(self, trainer: TrainerLike) -> None:
        self.fallback = OOMFallback(
            trainer.setup,
            batch_size=trainer.batch_size,
            fallback_plans=self.fallback_plans,
            log=lambda m: trainer.warn(m),
            on_switch=lambda setup, rebuilt: self._switched(trainer, setup, rebuilt),
        )
        self.fallback.steps = trainer.step_count

    def step(self, trainer: TrainerLike, batch: Batch) -> torch.Tensor:
        """One optimizer step on ``batch``, stepping down as often as needed.

        Raises:
            torch.OutOfMemoryError: when no plan is left, or the step cannot be redone exactly.
        """
        if self.fallback is None:  # a step outside fit: no fallback prepared
            return trainer.setup.step(batch)
        return self.fallback.step(batch)

    def _switched(self, trainer: TrainerLike, setup: TrainingSetup, rebuilt: bool) -> None:
        trainer.adopt_setup(setup, rebuilt)
        for callback in trainer.callbacks:
            callback.on_plan_switch(trainer, rebuilt)
