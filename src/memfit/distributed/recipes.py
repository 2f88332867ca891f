"""Large-batch recipes: the learning rate and warm-up for a batch larger than the tuned one.

Data parallelism multiplies the batch: ``world_size`` processes of ``b`` samples each (times
the gradient-accumulation steps) make one optimizer step on a global batch ``B``. With the
same number of epochs that is ``B / b`` times fewer steps, and keeping the loss needs a larger
learning rate, a warm-up, and -- past a few thousand samples -- a layer-wise optimizer:

* linear scaling (Goyal et al., 2017): ``lr = base_lr * B / base_batch_size``, with a warm-up
  of a fixed number of epochs, for SGD-like optimizers (LARS);
* square-root scaling (You et al., 2020, for LAMB and Adam-like optimizers):
  ``lr = base_lr * sqrt(B / base_batch_size)``.

:class:`LargeBatchRecipe` holds what was tuned at the base batch; :func:`scale_for_batch` gives
the learning rate and the warm-up in steps at another batch; :func:`build_optimizer` and
:func:`build_scheduler` make the optimizer (memfit's :class:`~memfit.optim.Lamb`,
:class:`~memfit.optim.Lars` or torch's AdamW) and its torch ``LambdaLR``;
:func:`optimizer_config` puts the optimizer in a :class:`~memfit.plan.Plan`, whose data-parallel
setup splits each global batch over the processes (``Plan(optimizer=optimizer_config(recipe,
B), parallel={"data": N})``), and :func:`build_scheduler` schedules the setup's optimizer. The schedule is the
Trainer's formula (:func:`memfit.optim.schedule.lr_factor`: linear warm-up, then constant,
cosine, linear or polynomial decay), so a recipe can also feed a
:class:`~memfit.train.TrainConfig`: ``lr`` and ``warmup_steps`` from :func:`scale_for_batch`,
``batch_size`` the global batch.

Example:
    >>> recipe = LargeBatchRecipe(optimizer="lamb", base_lr=1e-3, base_batch_size=32,
    ...                           warmup_epochs=1.0)
    >>> scale_for_batch(recipe, 256, samples_per_epoch=8192)
    ScaledSchedule(lr=0.002828..., warmup_steps=32)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..optim import build_optimizer as _build_named_optimizer
from ..optim import registry as optim_registry
from ..optim.config import OptimizerConfig
from ..optim.schedule import LR_SCHEDULES, lr_factor

__all__ = [
    "SCALING_RULES",
    "LargeBatchRecipe",
    "ScaledSchedule",
    "build_optimizer",
    "build_scheduler",
    "lr_lambda",
    "optimizer_config",
    "recipe_optimizers",
    "scale_for_batch",
]


def recipe_optimizers() -> tuple[str, ...]:
    """Optimizers a recipe may name: the registry's layer-wise ones (trust ratio per tensor,
    :attr:`~memfit.optim.registry.OptimizerSpec.layer_wise`), then torch's AdamW, the
    small-batch reference the large-batch papers compare with."""
    return (*(s.name for s in optim_registry.specs() if s.layer_wise), "adamw")

#: How the learning rate grows with the batch.
SCALING_RULES = ("linear", "sqrt")


class ScaledSchedule(NamedTuple):
    """The learning rate and warm-up of a recipe at one batch size (unpacks as a pair)."""

    lr: float
    """Peak learning rate, reached at the end of the warm-up."""

    warmup_steps: int
    """Optimizer steps of linear warm-up at this batch size."""


@dataclass(frozen=True, kw_only=True)
class LargeBatchRecipe:
    """What was tuned at a base batch size, and how to carry it to larger batches.

    The warm-up is a number of samples seen, given either as ``warmup_steps`` at the base batch
    or as ``warmup_epochs``; at a batch ``B`` it lasts as many samples, hence ``B /
    base_batch_size`` times fewer steps (Goyal et al. keep five epochs at every batch).

    Raises:
        ValueError: With one sentence, for an unknown name, a value out of range, or both or
            neither of ``warmup_steps`` and ``warmup_epochs``.
    """

    base_lr: float
    """Learning rate tuned at ``base_batch_size`` (the peak, after warm-up)."""

    base_batch_size: int
    """Global batch (samples per optimizer step, over all processes) ``base_lr`` was tuned at."""

    optimizer: str = "lamb"
    """``lamb`` (Adam with a layer-wise trust ratio), ``lars`` (SGD with momentum and a
    layer-wise trust ratio) or ``adamw`` (torch's, the small-batch reference)."""

    scaling: str = "sqrt"
    """``linear``: ``lr = base_lr * B / base_batch_size``; ``sqrt``: ``lr = base_lr *
    sqrt(B / base_batch_size)`` (keeps the update's variance: the published rule for LAMB)."""

    warmup_steps: int | None = None
    """Warm-up in optimizer steps at ``base_batch_size`` (converted by samples to other
    batches); give this or ``warmup_epochs``."""

    warmup_epochs: float | None = None
    """Warm-up in passes over the data (needs the epoch's size when scaling); give this or
    ``warmup_steps``."""

    schedule: str = "poly"
    """Decay after the warm-up: ``constant``, ``cosine``, ``linear`` or ``poly`` (to 0 at the
    run's last step)."""

    power: float = 1.0
    """Exponent of the ``poly`` decay (1: LAMB's BERT runs; 2: LARS's ImageNet runs)."""

    weight_decay: float = 0.01
    """Weight decay: decoupled for AdamW, added to the direction before the trust ratio for
    LAMB, added to the gradient before the trust ratio for LARS."""

    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Further keyword arguments for the optimizer (``betas``, ``momentum``, ``eta``, ...)."""

    def __post_init__(self) -> None:
        known = recipe_optimizers()
        if self.optimizer not in known:
            raise ValueError(
                f"optimizer {self.optimizer!r} is not known; use one of {', '.join(known)}"
            )
        if self.scaling not in SCALING_RULES:
            raise ValueError(
                f"scaling {self.scaling!r} is not known; use one of {', '.join(SCALING_RULES)}"
            )
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(
                f"schedule {self.schedule!r} is not known; use one of "
                f"{', '.join(LR_SCHEDULES)}"
            )
        if not _is_number(self.base_lr) or not self.base_lr > 0:
            raise ValueError(f"base_lr must be a number > 0, got {self.base_lr!r}")
        _check_batch("base_batch_size", self.base_batch_size)
        if (self.warmup_steps is None) == (self.warmup_epochs is None):
            raise ValueError(
                "give exactly one of warmup_steps and warmup_epochs (0 for no warm-up), got "
                f"warmup_steps={self.warmup_steps!r} and warmup_epochs={self.warmup_epochs!r}"
            )
        if self.warmup_steps is not None and (
            not isinstance(self.warmup_steps, int)
            or isinstance(self.warmup_steps, bool)
            or self.warmup_steps < 0
        ):
            raise ValueError(f"warmup_steps must be a whole number >= 0, got {self.warmup_steps!r}")
        if self.warmup_epochs is not None and (
            not _is_number(self.warmup_epochs) or not self.warmup_epochs >= 0
        ):
            raise ValueError(f"warmup_epochs must be a number >= 0, got {self.warmup_epochs!r}")
        if not _is_number(self.power) or not self.power > 0:
            raise ValueError(f"power must be a number > 0, got {self.power!r}")
        if not _is_number(self.weight_decay) or not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        reserved = {"lr", "weight_decay"} & set(self.optimizer_kwargs)
        if reserved:
            raise ValueError(
                f"optimizer_kwargs must not set {', '.join(sorted(reserved))}: the recipe sets "
                "them (base_lr scaled for the batch, weight_decay)"
            )


def scale_for_batch(
    recipe: LargeBatchRecipe, batch_size: int, *, samples_per_epoch: int | None = None
) -> ScaledSchedule:
    """The recipe's peak learning rate and warm-up steps at a global batch of ``batch_size``.

    Args:
        recipe: What was tuned at the base batch.
        batch_size: Samples per optimizer step over all processes (per-process batch times
            processes times gradient-accumulation steps). Need not be a multiple of the base.
        samples_per_epoch: Samples in one pass over the data; needed when the warm-up is in
            epochs.

    Returns:
        ``(lr, warmup_steps)``. The warm-up covers as many samples as at the base batch,
        rounded up to whole steps (at least one step when there is any warm-up).

    Raises:
        ValueError: For a batch size that is not a whole number >= 1, or a warm-up in epochs
            without a valid ``samples_per_epoch``.
    """
    _check_batch("batch_size", batch_size)
    ratio = batch_size / recipe.base_batch_size
    lr = recipe.base_lr * (ratio if recipe.scaling == "linear" else math.sqrt(ratio))
    if recipe.warmup_epochs is not None:
        if samples_per_epoch is None:
            raise ValueError(
                "samples_per_epoch is needed to turn warmup_epochs into steps; pass the number "
                "of samples in one pass over the data"
            )
        _check_batch("samples_per_epoch", samples_per_epoch)
        warmup_samples = recipe.warmup_epochs * samples_per_epoch
    else:
        assert recipe.warmup_steps is not None  # __post_init__ ensures exactly one is set
        warmup_samples = recipe.warmup_steps * recipe.base_batch_size
    # Rounded up, so a warm-up never disappears at a large batch; the 1e-9 keeps a product
    # that is whole up to float rounding (0.1 epochs of 2560 samples) from gaining a step.
    warmup = math.ceil(warmup_samples / batch_size - 1e-9) if warmup_samples > 0 else 0
    return ScaledSchedule(lr=lr, warmup_steps=warmup)


def lr_lambda(
    recipe: LargeBatchRecipe,
    batch_size: int,
    *,
    total_steps: int,
    samples_per_epoch: int | None = None,
) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at each step, for ``torch``'s ``LambdaLR``.

    Linear warm-up over :func:`scale_for_batch`'s warm-up steps, then the recipe's decay to 0
    at ``total_steps`` (the Trainer's formula, :func:`memfit.optim.schedule.lr_factor`).

    Args:
        recipe: The recipe.
        batch_size: The global batch size.
        total_steps: Optimizer steps of the whole run at this batch size.
        samples_per_epoch: Needed when the warm-up is in epochs.

    Raises:
        ValueError: For ``total_steps`` below 1, or as :func:`scale_for_batch`.
    """
    _check_batch("total_steps", total_steps)
    warmup = scale_for_batch(recipe, batch_size, samples_per_epoch=samples_per_epoch).warmup_steps
    schedule, power = recipe.schedule, recipe.power

    def factor(step: int) -> float:
        return lr_factor(
            step, schedule=schedule, warmup_steps=warmup, max_steps=total_steps, power=power
        )

    return factor


def build_optimizer(
    recipe: LargeBatchRecipe,
    params: Iterable[Any],
    batch_size: int,
    *,
    samples_per_epoch: int | None = None,
) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``params`` with the learning rate scaled for ``batch_size``.

    Args:
        recipe: The recipe.
        params: Parameters or parameter groups.
        batch_size: The global batch size.
        samples_per_epoch: Needed when the warm-up is in epochs.

    Returns:
        :class:`memfit.optim.Lamb`, :class:`memfit.optim.Lars` or ``torch.optim.AdamW``.
    """
    lr, _ = scale_for_batch(recipe, batch_size, samples_per_epoch=samples_per_epoch)
    return _build_named_optimizer(
        recipe.optimizer,
        params,
        lr=lr,
        weight_decay=recipe.weight_decay,
        **dict(recipe.optimizer_kwargs),
    )


def optimizer_config(
    recipe: LargeBatchRecipe, batch_size: int, *, samples_per_epoch: int | None = None
) -> OptimizerConfig:
    """The recipe's optimizer for a :class:`~memfit.plan.Plan` at a global batch size.

    Args:
        recipe: The recipe.
        batch_size: The global batch size (the plan's batches; data parallelism splits them).
        samples_per_epoch: Needed when the warm-up is in epochs.

    Returns:
        The plan's ``optimizer`` field: the recipe's optimizer, the scaled ``lr``, its weight
        decay and ``optimizer_kwargs``.
    """
    lr, _ = scale_for_batch(recipe, batch_size, samples_per_epoch=samples_per_epoch)
    kwargs = {"weight_decay": recipe.weight_decay, **dict(recipe.optimizer_kwargs)}
    return OptimizerConfig(name=recipe.optimizer, lr=lr, kwargs=kwargs)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    recipe: LargeBatchRecipe,
    batch_size: int,
    *,
    total_steps: int,
    samples_per_epoch: int | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` on ``optimizer`` following :func:`lr_lambda`.

    ``LambdaLR`` multiplies each group's learning rate as the optimizer was built, so build it
    with the scaled rate (:func:`build_optimizer`). Step it once after each optimizer step.
    """
    factor = lr_lambda(
        recipe, batch_size, total_steps=total_steps, samples_per_epoch=samples_per_epoch
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_batch(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
