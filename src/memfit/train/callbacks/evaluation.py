"""Evaluation: the mean held-out loss without gradients, every N steps and after the last."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...workload import Batch, split_batch
from ..streams import is_map_style, map_style_batches, to_device
from .base import Callback, StepInfo, TrainerLike, due

__all__ = ["EvaluationCallback", "eval_losses", "evaluate"]


def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    autocast: Callable[[], Any] | None = None,
    micro_batch_size: int | None = None,
) -> float:
    """Mean loss of ``model`` over ``batches`` without gradients, weighted like the training
    loss (by label tokens for token labels, else by samples).

    Args:
        model: The model; put in eval mode for the pass and back in its former mode after.
        batches: The evaluation batches.
        loss_fn: ``loss_fn(output, batch)``; default: the output's ``.loss``.
        autocast: A factory of the precision's autocast context (``None``: fp32).
        micro_batch_size: Split batches into pieces of this size (keeps evaluation within the
            training plan's activation memory).

    Returns:
        The mean loss (NaN when there was no batch).
    """
    total, weight = 0.0, 0
    for loss, n in eval_losses(
        model, batches, loss_fn=loss_fn, autocast=autocast, micro_batch_size=micro_batch_size
    ):
        total += float(loss) * n
        weight += n
    return total / weight if weight else float("nan")


def eval_losses(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    autocast: Callable[[], Any] | None = None,
    micro_batch_size: int | None = None,
) -> Iterator[tuple[torch.Tensor, int]]:
    """The pass :func:`evaluate` averages: each micro-batch's loss tensor and its weight (label
    tokens, else samples), in eval mode without gradients. A dry run of the job
    (:func:`memfit.train.job.predict_job`) runs this same pass on fake tensors, whose losses it
    cannot read."""
    from ...strategies.accumulation import count_loss_terms
    from ...workload import batch_size_of, call_model, loss_from_output

    loss_fn = loss_fn or (lambda out, batch: loss_from_output(out))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                parts = split_batch(batch, micro_batch_size) if micro_batch_size else [batch]
                for part in parts:
                    try:
                        n = count_loss_terms(part)
                    except ValueError:
                        n = batch_size_of(part)
                    if n == 0:
                        continue
                    with autocast() if autocast is not None else contextlib.nullcontext():
                        loss = loss_fn(call_model(model, part), part)
                    yield loss, n
                    del loss
    finally:
        model.train(was_training)


class EvaluationCallback(Callback):
    """Evaluates the trainer's model on ``data`` every ``every`` steps and after the last one,
    appending ``(step, loss)`` to ``trainer.eval_losses``.

    Args:
        data: A map-style dataset of samples (batched ``trainer.batch_size`` at a time with
            ``collate_fn``) or an iterable of batches; ``None``: no evaluation.
        every: Steps between evaluations; ``None``: only after the last step.
        collate_fn: Turns a list of samples into a batch.
        at_start: Also evaluate before the first step, as step 0 (a fine-tune's starting
            loss); not when a resumed run starts past step 0.
        phases: The trainer's :class:`~memfit.train.phases.PhaseRecorder`: the first batch of
            the first evaluation after a step is the job's ``eval`` phase (one batch, so the
            tracker's records stay small however large the evaluation data).
    """

    def __init__(
        self,
        data: Any,
        *,
        every: int | None,
        collate_fn: Callable[[list[Any]], Batch],
        at_start: bool = False,
        phases: Any = None,
    ) -> None:
        self.data, self.every, self.collate_fn = data, every, collate_fn
        self.at_start, self.phases = at_start, phases

    def on_fit_start(self, trainer: TrainerLike) -> None:
        if self.data is None or not self.at_start or trainer.step_count != 0:
            return
        value = self.evaluate(trainer)
        trainer.eval_losses.append((0, value))
        trainer.say(f"step 0: eval loss {value:.4f}")

    def evaluate(
        self, trainer: TrainerLike, first: contextlib.AbstractContextManager[Any] | None = None
    ) -> float:
        """Mean loss on the evaluation data under the trainer's plan (NaN without data): its
        precision's autocast and its micro-batches, so evaluation fits wherever a step does.
        ``first`` is entered around the first batch: made (collated), evaluated, let go."""
        if self.data is None:
            return float("nan")
        batches = (
            map_style_batches(self.data, trainer.batch_size, self.collate_fn)
            if is_map_style(self.data)
            else iter(self.data)
        )
        if first is not None:
            batches = _first_inside(batches, first)
        device = trainer.device
        setup = trainer.setup
        return evaluate(
            trainer.model,
            (to_device(b, device) for b in batches),
            loss_fn=setup.loss_fn,
            autocast=setup.precision.autocast,
            micro_batch_size=setup.plan.micro_batch_for(
                max(1, trainer.batch_size // setup.plan.parallel.data)
            ),
        )

    def on_step_end(self, trainer: TrainerLike, info: StepInfo) -> None:
        if self.data is None or not due(info.step, trainer.max_steps, self.every):
            return
        phase = (
            self.phases.phase("eval", trainer.model, trainer.optimizer)
            if self.phases is not None
            else None
        )
        value = self.evaluate(trainer, phase)
        trainer.eval_losses.append((info.step, value))
        trainer.say(f"step {info.step}: eval loss {value:.4f}")


def _first_inside(batches: Iterable[Batch], context: Any) -> Iterator[Batch]:
    """``batches``, the first made and used inside ``context`` (left when the next is asked
    for)."""
    it = iter(batches)
    with context:
        batch = next(it, None)
        if batch is None:
            return
        yield batch
        del batch
    yield from it
