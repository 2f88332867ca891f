"""Evaluation: the mean held-out loss without gradients, every N steps and after the last.

Each evaluation reads at most ``eval_max_batches`` batches (the first ones of the held-out
samples) and stops before its next batch when a signal asks the run to stop
(:mod:`memfit.train.stopping`): a huge held-out split neither makes a step's evaluation last
for hours nor keeps a SIGTERM waiting (issue 37).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...workload import Batch, split_batch
from ..stopping import STOP, stop_requested
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
    stop: Callable[[], bool] = stop_requested,
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
        stop: Asked before each batch; ``True`` ends the pass there (default: whether a
            signal asked the run to stop, :func:`~memfit.train.stopping.stop_requested`).

    Returns:
        The mean loss over the batches evaluated (NaN when there was none).
    """
    total, weight = 0.0, 0
    for loss, n in eval_losses(
        model, batches, loss_fn=loss_fn, autocast=autocast, micro_batch_size=micro_batch_size,
        stop=stop,
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
    stop: Callable[[], bool] = stop_requested,
) -> Iterator[tuple[torch.Tensor, int]]:
    """The pass :func:`evaluate` averages: each micro-batch's loss tensor and its weight (label
    tokens, else samples), in eval mode without gradients, up to the first batch before which
    ``stop()`` is true. A dry run of the job (:func:`memfit.train.job.predict_job`) runs this
    same pass on fake tensors, whose losses it cannot read."""
    from ...strategies.accumulation import count_loss_terms
    from ...workload import batch_size_of, call_model, loss_from_output

    loss_fn = loss_fn or (lambda out, batch: loss_from_output(out))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            it = iter(batches)
            # Asked before the next batch is even made: a signal costs at most the batch in
            # flight, however many remain.
            while not stop():
                batch = next(it, _END)
                if batch is _END:
                    break
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
                del batch, parts
    finally:
        model.train(was_training)


_END = object()


class EvaluationCallback(Callback):
    """Evaluates the trainer's model on ``data`` every ``every`` steps and after the last one,
    appending ``(step, loss)`` to ``trainer.eval_losses`` and ``(step, batches)`` to
    :attr:`batches_run`.

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
        max_batches: Batches an evaluation reads at most (the first ones); ``None``: all
            (:attr:`~memfit.train.config.TrainConfig.eval_batch_limit` gives the run's).

    Attributes:
        batches_run: ``(step, batches evaluated)`` of each evaluation; one that a signal cut
            short (:mod:`memfit.train.stopping`) is here but not in ``eval_losses``, since
            its mean is over an arbitrary part of the held-out samples.
    """

    def __init__(
        self,
        data: Any,
        *,
        every: int | None,
        collate_fn: Callable[[list[Any]], Batch],
        at_start: bool = False,
        phases: Any = None,
        max_batches: int | None = None,
    ) -> None:
        self.data, self.every, self.collate_fn = data, every, collate_fn
        self.at_start, self.phases, self.max_batches = at_start, phases, max_batches
        self.batches_run: list[tuple[int, int]] = []
        self._counted: _Counted | None = None

    def on_fit_start(self, trainer: TrainerLike) -> None:
        if self.data is None or not self.at_start or trainer.step_count != 0:
            return
        self._evaluate_at(trainer, 0, None)

    def evaluate(
        self, trainer: TrainerLike, first: contextlib.AbstractContextManager[Any] | None = None
    ) -> float:
        """Mean loss on the evaluation data under the trainer's plan (NaN without data): its
        precision's autocast and its micro-batches, so evaluation fits wherever a step does;
        at most ``max_batches`` batches, and none after a signal asked the run to stop.
        ``first`` is entered around the first batch: made (collated), evaluated, let go."""
        if self.data is None:
            return float("nan")
        batches: Iterator[Batch] = (
            map_style_batches(self.data, trainer.batch_size, self.collate_fn)
            if is_map_style(self.data)
            else iter(self.data)
        )
        if first is not None:
            batches = _first_inside(batches, first)
        counted = self._counted = _Counted(batches, self.max_batches)
        device = trainer.device
        setup = trainer.setup
        stop = stop_requested
        if setup.parallel is not None:
            # Every process evaluates the same batches (a sharded forward is a collective),
            # so all stop before the same one.
            from ...distributed.data import any_rank

            def stop() -> bool:
                return any_rank(STOP.requested, device)

        try:
            return evaluate(
                trainer.model,
                (to_device(b, device) for b in counted),
                loss_fn=setup.loss_fn,
                autocast=setup.precision.autocast,
                micro_batch_size=setup.plan.micro_batch_for(
                    max(1, trainer.batch_size // setup.plan.parallel.data)
                ),
                stop=stop,
            )
        finally:
            counted.close()  # leaves ``first`` now, also when the pass stopped early

    def on_step_end(self, trainer: TrainerLike, info: StepInfo) -> None:
        if self.data is None or not due(info.step, trainer.max_steps, self.every):
            return
        phase = (
            self.phases.phase("eval", trainer.model, trainer.optimizer)
            if self.phases is not None
            else None
        )
        self._evaluate_at(trainer, info.step, phase)

    def _evaluate_at(self, trainer: TrainerLike, step: int, phase: Any) -> None:
        bound = f"at most {self.max_batches} batches" if self.max_batches else "all batches"
        trainer.say(f"step {step}: evaluating ({bound})")
        value = self.evaluate(trainer, phase)
        counted = self._counted
        assert counted is not None
        self.batches_run.append((step, counted.count))
        if not counted.finished and STOP.requested:
            trainer.say(
                f"step {step}: evaluation stopped by {STOP.signal_name} after {counted.count} "
                "batches"
            )
            return
        trainer.eval_losses.append((step, value))
        trainer.say(f"step {step}: eval loss {value:.4f} ({counted.count} batches)")


class _Counted:
    """An iterator over at most ``limit`` of ``batches`` (``None``: all) that counts what it
    gave and knows whether it reached its end (the limit, or the batches' own end)."""

    def __init__(self, batches: Iterator[Batch], limit: int | None) -> None:
        self._it, self.limit = batches, limit
        self.count, self._exhausted = 0, False

    @property
    def finished(self) -> bool:
        """Whether every batch it was to give was given."""
        return self._exhausted or (self.limit is not None and self.count >= self.limit)

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Batch:
        if self.limit is not None and self.count >= self.limit:
            raise StopIteration
        try:
            batch = next(self._it)
        except StopIteration:
            self._exhausted = True
            raise
        self.count += 1
        return batch

    def close(self) -> None:
        """Close the underlying generator (runs its ``finally`` and ``with`` exits now)."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


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
