"""The checks the training entry points (:class:`~memfit.train.Trainer`,
:func:`~memfit.train.prepare`) run on their arguments before any model is built or changed
(issue 37): a wrong kind is a :class:`~memfit.errors.MemfitTypeError` naming the argument, and a
batch smaller than the plan's accumulation is refused instead of silently accumulating fewer
micro-batches than the plan says."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ..errors import MemfitTypeError, MemfitValueError, check_bool, check_type, describe
from ..plan import Plan
from ..workload import Workload
from .callbacks.base import Callback
from .config import TrainConfig

__all__ = ["check_batch_covers_accumulation", "check_trainer_arguments"]


def check_trainer_arguments(given: Mapping[str, Any]) -> None:
    """Check the arguments of ``Trainer(...)`` (``given``: its ``locals()`` at entry) whose
    kind the :class:`TrainConfig` fields do not cover (those are the config's to check).

    Raises:
        MemfitTypeError: for an argument of a kind it does not accept.
        MemfitValueError: for a model given without ``train_data``.
    """
    model = given["workload_or_model"]
    if not isinstance(model, (Workload, nn.Module)):
        raise MemfitTypeError(
            f"Trainer needs a Workload or a torch.nn.Module first (workload_or_model), got "
            f"{describe(model)}"
        )
    check_type(given["plan"], (Plan, type(None)), "plan",
               "a memfit.Plan or None (build one with memfit.Plan(...) or Plan.from_dict(...))")
    check_type(given["config"], (TrainConfig, type(None)), "config", "a TrainConfig or None")
    if given["train_data"] is None and not isinstance(model, Workload):
        raise MemfitValueError(
            "Trainer needs train_data when given a model (a Workload makes its own batches)"
        )
    fallback = given["fallback_plans"]
    if fallback is not None and (
        not isinstance(fallback, Sequence) or isinstance(fallback, str)
        or not all(isinstance(p, Plan) for p in fallback)
    ):
        raise MemfitTypeError(f"fallback_plans must be a list of memfit.Plan or None, got "
                              f"{describe(fallback)}")
    callbacks = given["callbacks"]
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, str) or not all(
        isinstance(c, Callback) for c in callbacks
    ):
        raise MemfitTypeError(
            "callbacks must be a list of memfit.train.callbacks.Callback objects, got "
            f"{describe(callbacks)}"
        )
    check_bool(given["progress"], "progress")
    for name, what in (("loss_fn", "loss_fn(output, batch) -> loss"),
                       ("collate_fn", "collate_fn(samples) -> batch"),
                       ("on_step", "on_step(info)")):
        value = given[name]
        if value is not None and (not callable(value) or (name != "loss_fn"
                                                          and isinstance(value, nn.Module))):
            raise MemfitTypeError(f"{name} must be a function {what}, or None, got "
                                  f"{describe(value)}")
    check_type(given["report_png"], (str, os.PathLike, type(None)), "report_png",
               "a file path or None")


def check_batch_covers_accumulation(batch_size: int, plan: Plan) -> None:
    """Refuse a batch of fewer samples than the plan's micro-batches.

    With ``micro_batch_size`` unset, a step splits its batch into ``grad_accum_steps``
    micro-batches (per data-parallel process); a smaller batch would give fewer of them than
    the plan says, and the step would silently differ from the one planned and predicted. A
    fixed ``micro_batch_size`` takes any batch (the count follows the batch).

    Raises:
        MemfitValueError: naming the batch, the accumulation and what to do instead.
    """
    if plan.micro_batch_size is not None or plan.grad_accum_steps <= 1:
        return
    processes = plan.parallel.data
    needed = plan.grad_accum_steps * processes
    if batch_size < needed:
        where = f" x {processes} processes" if processes > 1 else ""
        raise MemfitValueError(
            f"batch of {batch_size} samples is smaller than the plan's grad_accum_steps="
            f"{plan.grad_accum_steps}{where}: give a batch of at least {needed} samples "
            "(the effective batch, split into micro-batches) or lower grad_accum_steps"
        )
