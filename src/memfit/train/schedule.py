"""Learning-rate schedules: linear warm-up, then cosine or linear decay to 0, or flat.

They are torch schedulers on the optimizer. With ``optimizer_in_backward`` the optimizer is
memfit's handle, whose ``param_groups`` are the per-parameter optimizers' own group dicts, so the
same scheduler drives every per-parameter optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

# The formula is shared with the large-batch recipes (memfit.distributed.recipes): it lives
# in memfit.optim, below both.
from ..optim.schedule import LR_SCHEDULES, lr_factor

__all__ = ["LR_SCHEDULES", "build_scheduler", "lr_factor"]


def build_scheduler(
    optimizer: Any,
    schedule: str = "cosine",
    *,
    warmup_steps: int = 0,
    max_steps: int = 100,
    start_step: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A torch ``LambdaLR`` on ``optimizer``: warm-up, then cosine / linear decay to 0, or flat.

    Args:
        optimizer: A torch optimizer, an optimizer-in-backward handle, or an offload engine
            (its host optimizer is scheduled).
        schedule: One of :data:`~memfit.optim.schedule.LR_SCHEDULES` (``cosine``, ``linear``,
            ``constant``, ``poly``).
        warmup_steps: Steps of linear warm-up from ``lr / warmup_steps``.
        max_steps: Steps of the whole run (the decay ends there).
        start_step: Steps already done (to attach a schedule mid-run, e.g. to a rebuilt
            optimizer); the optimizer's current ``lr`` is taken as the base.

    Raises:
        ValueError: for an unknown schedule or negative warm-up.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"schedule {schedule!r} is not known; use one of {', '.join(LR_SCHEDULES)}"
        )
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")

    def factor(step: int) -> float:
        return lr_factor(step, schedule=schedule, warmup_steps=warmup_steps, max_steps=max_steps)

    if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        # Optimizer offload steps a torch optimizer over host masters: schedule that one.
        optimizer = optimizer.optimizer
    if start_step > 0:
        # LambdaLR resumes from last_epoch only when each group records its base LR.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)
