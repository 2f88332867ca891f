"""The learning-rate multiplier of a warm-up-then-decay schedule, as a plain function of the step.

One formula for every layer that schedules a learning rate: the Trainer's
(:mod:`memfit.train.schedule`) and the large-batch recipes (:mod:`memfit.distributed.recipes`)
both wrap it in a torch ``LambdaLR``. It lives here, below both, so neither imports the other.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "lr_factor"]

#: Decays after warm-up that :func:`lr_factor` knows.
LR_SCHEDULES = ("cosine", "linear", "constant", "poly")


def lr_factor(
    step: int, *, schedule: str, warmup_steps: int, max_steps: int, power: float = 1.0
) -> float:
    """The LR multiplier at ``step`` (0-based): linear warm-up, then the schedule's decay.

    Warm-up takes ``warmup_steps`` steps from ``1 / warmup_steps`` to 1; after it the factor
    decays over the remaining ``max_steps - warmup_steps`` steps to 0 (``cosine``: half a
    cosine; ``linear``: a straight line; ``poly``: ``(1 - progress) ** power``, LAMB's and
    LARS's polynomial decay) or stays at 1 (``constant``). Past ``max_steps`` it stays at the
    end value.

    Args:
        step: The optimizer step, counted from 0.
        schedule: One of :data:`LR_SCHEDULES`.
        warmup_steps: Steps of linear warm-up (0: none).
        max_steps: Steps of the whole run, warm-up included.
        power: The exponent of ``poly`` (ignored by the others).

    Raises:
        ValueError: For a schedule not in :data:`LR_SCHEDULES`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "poly":
        return (1.0 - progress) ** power
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule {schedule!r} is not known; use one of {', '.join(LR_SCHEDULES)}")
