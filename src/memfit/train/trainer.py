"""The Trainer: a plan-driven training loop built from parts that also work alone.

:class:`Trainer` composes

* a batch stream (:class:`~memfit.train.data.BatchStream`, or any iterable of batches),
* :func:`~memfit.strategies.compose.apply_plan` (the plan's techniques),
* :func:`memfit.track` over the whole run (measured peak, optional virtual cap),
* :class:`~memfit.train.oom.OOMFallback` (step down and redo a step that ran out of memory),
* an LR schedule (:func:`build_scheduler`), evaluation (:func:`evaluate`),
* checkpoints (:mod:`memfit.train.checkpoint`) and a progress bar (:class:`TrainProgress`).

LR schedules are torch schedulers on the optimizer. With ``optimizer_in_backward`` the
optimizer is memfit's handle, whose ``param_groups`` are the per-parameter optimizers' own
group dicts, so the same scheduler drives every per-parameter optimizer.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..accounting import MemoryReport, track
from ..plan import Plan
from ..strategies.compose import TrainingSetup, apply_plan
from ..workload import Batch, Workload, WorkloadError, split_batch
from .checkpoint import latest_checkpoint, load_checkpoint, read_state, save_checkpoint
from .data import BatchStream, collate
from .oom import OOMFallback, switch_plan

__all__ = [
    "SCHEDULES",
    "StepInfo",
    "TrainProgress",
    "TrainResult",
    "Trainer",
    "build_scheduler",
    "evaluate",
]

#: LR schedules :func:`build_scheduler` knows.
SCHEDULES = ("cosine", "linear", "constant")


# ---------------------------------------------------------------------------------- schedule
def lr_factor(step: int, *, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """The LR multiplier at ``step`` (0-based): linear warm-up, then the schedule's decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


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
        optimizer: A torch optimizer or an optimizer-in-backward handle.
        schedule: ``cosine``, ``linear`` or ``constant``.
        warmup_steps: Steps of linear warm-up from ``lr / warmup_steps``.
        max_steps: Steps of the whole run (the decay ends there).
        start_step: Steps already done (to attach a schedule mid-run, e.g. to a rebuilt
            optimizer); the optimizer's current ``lr`` is taken as the base.

    Raises:
        ValueError: for an unknown schedule or negative warm-up.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not known; use one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")

    def factor(step: int) -> float:
        return lr_factor(step, schedule=schedule, warmup_steps=warmup_steps, max_steps=max_steps)

    if start_step > 0:
        # LambdaLR resumes from last_epoch only when each group records its base LR.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)


# ---------------------------------------------------------------------------------- eval
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
    import contextlib

    from ..strategies.accumulation import count_loss_terms
    from ..workload import batch_size_of, call_model, loss_from_output

    loss_fn = loss_fn or (lambda out, batch: loss_from_output(out))
    was_training = model.training
    model.eval()
    total, weight = 0.0, 0
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
                    total += float(loss) * n
                    weight += n
    finally:
        model.train(was_training)
    return total / weight if weight else float("nan")


# ---------------------------------------------------------------------------------- progress
class TrainProgress:
    """A rich progress bar: step, loss, tokens/s, live and peak memory, ETA.

    Args:
        total: Steps of the run.
        console: The rich console (default: stderr).
        enabled: ``False`` makes every method a no-op.
        start: Steps already done (a resumed run).
    """

    def __init__(
        self, total: int, *, console: Any = None, enabled: bool = True, start: int = 0
    ) -> None:
        self.enabled = enabled
        self._bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console(stderr=True)
        self._bar = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]}"),
            TextColumn("mem {task.fields[mem]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._bar.add_task(
            "train", total=total, completed=start, loss="-", speed="-", mem="-"
        )

    def __enter__(self) -> TrainProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, loss: float, tokens_per_s: float, live: int, peak: int) -> None:
        """Show the state after ``step`` steps."""
        if self._bar is None:
            return
        from ..units import format_bytes

        self._bar.update(
            self._task,
            completed=step,
            loss=f"{loss:.4f}",
            speed=f"{tokens_per_s:,.0f} tok/s",
            mem=f"{format_bytes(live)} (peak {format_bytes(peak)})",
        )

    def print(self, message: str) -> None:
        """Print a line above the bar."""
        if self._bar is not None:
            self._bar.console.print(message, highlight=False)


# ---------------------------------------------------------------------------------- result
@dataclass
class StepInfo:
    """What a step did, handed to ``on_step`` callbacks.

    Attributes:
        step: Steps done (1-based: the step just finished).
        loss: Its loss.
        batch: The batch it trained on.
        indices: The dataset indices of the batch's samples (empty for batches that came
            from an iterable or a workload's batch maker).
        plan: The plan in force (after any step-down).
    """

    step: int
    loss: float
    batch: Batch
    indices: list[int]
    plan: Plan


@dataclass
class TrainResult:
    """The outcome of :meth:`Trainer.fit`.

    Attributes:
        first_loss: Loss of the first step of the whole run (also when resumed).
        final_loss: Loss of the last step.
        steps: Optimizer steps done in all.
        peak_bytes: Peak device memory measured by :func:`memfit.track` over this ``fit``.
        losses: Every step's loss.
        eval_losses: ``(step, loss)`` of each evaluation.
        report: The :class:`~memfit.accounting.MemoryReport` of the run
            (``report.plot(path)`` draws it).
        plan: The plan in force at the end (after step-downs), as a dict.
        step_downs: The step-downs taken after out-of-memory errors (dicts).
        tokens: Input tokens trained on in this ``fit``.
        seconds: Wall time of this ``fit``'s loop.
        checkpoint: The last checkpoint written, if any.
    """

    first_loss: float
    final_loss: float
    steps: int
    peak_bytes: int
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    report: MemoryReport
    plan: dict[str, Any]
    step_downs: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    checkpoint: str | None = None

    @property
    def tokens_per_second(self) -> float:
        """Training throughput of this ``fit``."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the report as its peak breakdown; ``report.to_dict()`` has it
        all)."""
        return {
            "first_loss": self.first_loss,
            "final_loss": self.final_loss,
            "steps": self.steps,
            "peak_bytes": self.peak_bytes,
            "peak_by_category": dict(self.report.peak_by_category),
            "losses": list(self.losses),
            "eval_losses": [list(e) for e in self.eval_losses],
            "plan": self.plan,
            "step_downs": list(self.step_downs),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "checkpoint": self.checkpoint,
        }


# ---------------------------------------------------------------------------------- streams
class _WorkloadStream:
    """Fresh batches from a workload's batch maker (random tokens for the presets)."""

    def __init__(self, workload: Workload, model: nn.Module, batch_size: int) -> None:
        self.workload, self.model, self.batch_size = workload, model, batch_size

    def next_batch(self) -> tuple[list[int], Batch]:
        return [], self.workload.make_batch(self.model, self.batch_size, self.workload.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {}  # batches depend only on the RNG state, which checkpoints restore

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class _IterableStream:
    """Batches of an iterable (a DataLoader), re-iterated at its end; resumable by skipping."""

    def __init__(self, batches: Iterable[Batch]) -> None:
        self.batches = batches
        self.position = 0
        self._it: Iterator[Batch] | None = None

    def next_batch(self) -> tuple[list[int], Batch]:
        if self._it is None:
            self._it = iter(self.batches)
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.batches)
            try:
                batch = next(self._it)
            except StopIteration:
                raise WorkloadError(
                    "the training data gave no batch at all; give some data"
                ) from None
        self.position += 1
        return [], batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._it = None
        target, self.position = int(state.get("position", 0)), 0
        for _ in range(target):
            self.next_batch()


def _is_map_style(data: Any) -> bool:
    if isinstance(data, torch.utils.data.DataLoader):
        return False
    return hasattr(data, "__getitem__") and hasattr(data, "__len__")


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device) if batch.device != device else batch
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _count_tokens(batch: Batch) -> int:
    """Input tokens in a batch: real tokens by its attention mask, else its input ids."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return int(ids.numel())
    from ..workload import batch_size_of

    return batch_size_of(batch)


# ---------------------------------------------------------------------------------- trainer
class Trainer:
    """Train a model under a memory plan, with OOM step-down, checkpoints and a memory report.

    Example::

        trainer = Trainer(model, plan, dataset, batch_size=16, max_steps=200, lr=3e-3)
        result = trainer.fit()
        print(result.final_loss, result.peak_bytes)

    Args:
        workload_or_model: A :class:`~memfit.workload.Workload` (built with ``seed``; its loss
            and, without ``train_data``, its batch maker are used) or an ``nn.Module``.
        plan: The plan (default: plain AdamW, fp32). Its ``sequence`` settings shape batches
            of a dataset (length grouping, pad multiple).
        train_data: A map-style dataset of samples (dicts of 1-D tensors, e.g.
            :class:`~memfit.train.data.TextDataset`), batched by a seeded
            :class:`~memfit.train.data.BatchStream`; or an iterable of ready batches (a
            ``DataLoader``), re-iterated when exhausted.
        eval_data: Evaluation data of the same kinds (one pass per evaluation).
        lr: Learning rate; overrides the plan's optimizer ``lr``.
        schedule: ``cosine``, ``linear`` or ``constant`` (see :func:`build_scheduler`).
        warmup_steps: Linear warm-up steps.
        max_steps: Optimizer steps of the run (a resumed run counts the steps already done).
        eval_every: Evaluate every N steps (and at the end) when ``eval_data`` is given;
            ``None``: only at the end.
        checkpoint_dir: Folder for checkpoints (``None``: no checkpoints).
        checkpoint_every: Save every N steps (and at the end); ``None``: only at the end.
        keep_checkpoints: Checkpoints kept in ``checkpoint_dir``.
        resume: Continue from the latest checkpoint in ``checkpoint_dir``, if there is one.
        cap: Virtual memory cap in bytes: :func:`memfit.track` raises
            ``torch.OutOfMemoryError`` beyond it, like a full GPU; the trainer steps down.
        fallback_plans: Plans to try when a step runs out of memory (e.g. the planner's
            frontier): those that keep the optimizer first, in order, then
            :func:`~memfit.train.oom.step_down`, then those that need a new optimizer (see
            :meth:`~memfit.train.oom.OOMFallback.next_plan`).
        seed: Seed of the model's initialisation, the data order and the RNG.
        batch_size: Samples per optimizer step (the effective batch); default 8, or the
            workload's.
        progress: Show the progress bar, step-down notices and the final memory table.
        loss_fn: ``loss_fn(output, batch)``; default: the workload's, else the output's
            ``.loss``.
        collate_fn: Turns a list of samples into a batch (default: dynamic padding with pad
            id 0; padded positions never reach the loss).
        on_step: Called with a :class:`StepInfo` after every step.
        report_png: Write the memory report's plot here at the end.
        console: The rich console for progress and messages (default: stderr).
        track_every: Memory is tracked in windows, so that a long run's host memory stays
            bounded (the tracker records every operation while open): the first two steps,
            every ``track_every``-th step, and the two steps after a step-down are tracked,
            each by a fresh tracker; the report is the tracked step with the highest peak.
            Steps in between run with no dispatch mode at all (no overhead), unless ``cap``
            is set: then every step is tracked, the cap needs it, and only windowed steps
            build a report.
    """

    def __init__(
        self,
        workload_or_model: Workload | nn.Module,
        plan: Plan | None = None,
        train_data: Any = None,
        *,
        eval_data: Any = None,
        lr: float | None = None,
        schedule: str = "cosine",
        warmup_steps: int = 0,
        max_steps: int = 100,
        eval_every: int | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        resume: bool = False,
        cap: int | None = None,
        fallback_plans: Sequence[Plan] | None = None,
        seed: int = 0,
        batch_size: int | None = None,
        progress: bool = True,
        loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
        report_png: str | Path | None = None,
        console: Any = None,
        track_every: int = 100,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(
                f"schedule {schedule!r} is not known; use one of {', '.join(SCHEDULES)}"
            )
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a whole number >= 1, got {max_steps!r}")
        if not isinstance(track_every, int) or track_every < 1:
            raise ValueError(f"track_every must be a whole number >= 1, got {track_every!r}")
        self.track_every = track_every
        for name, value in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {value!r}")
        plan = _with_lr(plan or Plan(), lr)
        # The learning rate is the run's, whichever plan a step-down moves to.
        fallback_plans = (
            None if fallback_plans is None else [_with_lr(p, lr) for p in fallback_plans]
        )
        self.workload = workload_or_model if isinstance(workload_or_model, Workload) else None
        torch.manual_seed(seed)
        if self.workload is not None:
            self.model, _ = self.workload.build(seed=seed)
            loss_fn = loss_fn or self.workload.loss_fn
            batch_size = batch_size or self.workload.batch_size
        elif isinstance(workload_or_model, nn.Module):
            self.model = workload_or_model
            self.model.train()
        else:
            raise TypeError(
                f"Trainer needs a Workload or a torch.nn.Module, got {type(workload_or_model).__name__}"
            )
        self.batch_size = batch_size or 8
        if train_data is None and self.workload is None:
            raise ValueError(
                "Trainer needs train_data when given a model (a Workload makes its own batches)"
            )
        self.setup: TrainingSetup = apply_plan(self.model, plan, loss_fn=loss_fn)
        self.schedule, self.warmup_steps, self.max_steps = schedule, warmup_steps, max_steps
        self.scheduler = build_scheduler(
            self.setup.optimizer, schedule, warmup_steps=warmup_steps, max_steps=max_steps
        )
        self.train_data, self.eval_data = train_data, eval_data
        self.eval_every = eval_every
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.keep_checkpoints, self.resume = (
            checkpoint_every,
            keep_checkpoints,
            resume,
        )
        self.cap, self.fallback_plans, self.seed = cap, fallback_plans, seed
        self.progress, self.on_step, self.report_png = progress, on_step, report_png
        self.collate_fn = collate_fn or collate
        self.console = console
        self.stream = self._make_stream(train_data)
        self.step_count = 0
        self.losses: list[float] = []
        self.eval_losses: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ parts
    @property
    def plan(self) -> Plan:
        """The plan in force (after any step-down)."""
        return self.setup.plan

    @property
    def optimizer(self) -> Any:
        """The optimizer in force."""
        return self.setup.optimizer

    def _make_stream(self, data: Any) -> Any:
        if data is None:
            assert self.workload is not None
            return _WorkloadStream(self.workload, self.model, self.batch_size)
        if _is_map_style(data):
            seq = self.plan.sequence
            pad_multiple = seq.pad_to_multiple_of

            def collate_fn(samples: list[Any]) -> Batch:
                if self.collate_fn is collate:
                    return collate(samples, pad_to_multiple_of=pad_multiple)
                return self.collate_fn(samples)

            return BatchStream(
                data,
                self.batch_size,
                collate_fn=collate_fn,
                seed=self.seed,
                group_by_length=seq.group_by_length,
            )
        return _IterableStream(data)

    def _eval_batches(self) -> Iterator[Batch]:
        data = self.eval_data
        if _is_map_style(data):
            for lo in range(0, len(data), self.batch_size):
                samples = [data[i] for i in range(lo, min(lo + self.batch_size, len(data)))]
                yield self.collate_fn(samples)
        else:
            yield from data

    def evaluate(self) -> float:
        """Mean loss on ``eval_data`` (NaN without it)."""
        if self.eval_data is None:
            return float("nan")
        device = _device_of(self.model)
        return evaluate(
            self.model,
            (_to_device(b, device) for b in self._eval_batches()),
            loss_fn=self.setup.loss_fn,
            autocast=self.setup.precision.autocast,
            micro_batch_size=self.plan.micro_batch_for(self.batch_size),
        )

    def save(self) -> Path:
        """Write a checkpoint of the current state to ``checkpoint_dir``."""
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint_dir was given to the Trainer")
        scaler = getattr(self.setup.precision, "scaler", None)
        return save_checkpoint(
            self.checkpoint_dir,
            self.step_count,
            self.model,
            self.optimizer,
            scheduler=self.scheduler,
            keep=self.keep_checkpoints,
            state={
                "plan": self.plan.to_dict(),
                "data": self.stream.state_dict(),
                "losses": list(self.losses),
                "eval_losses": list(self.eval_losses),
                "scaler": scaler.state_dict() if scaler is not None else None,
            },
        )

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint: weights, optimizer, schedule, RNG, data position, plan."""
        state = read_state(path)
        saved_plan = Plan.from_dict(state["plan"])
        if saved_plan != self.plan:
            # The run had stepped down: go on with the plan that fitted.
            self.setup, rebuilt = switch_plan(self.setup, saved_plan)
            if rebuilt:
                self.scheduler = build_scheduler(
                    self.optimizer,
                    self.schedule,
                    warmup_steps=self.warmup_steps,
                    max_steps=self.max_steps,
                )
        state = load_checkpoint(path, self.model, self.optimizer, scheduler=self.scheduler)
        self.stream.load_state_dict(state.get("data") or {})
        scaler = getattr(self.setup.precision, "scaler", None)
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        self.step_count = int(state["step"])
        self.losses = list(state.get("losses", []))
        self.eval_losses = [tuple(e) for e in state.get("eval_losses", [])]

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainResult:
        """Train up to ``max_steps`` and return the :class:`TrainResult`.

        Raises:
            torch.OutOfMemoryError: when even the smallest plan runs out of memory.
        """
        if self.resume and self.checkpoint_dir is not None:
            latest = latest_checkpoint(self.checkpoint_dir)
            if latest is not None:
                self.load(latest)
        bar = TrainProgress(
            self.max_steps, console=self.console, enabled=self.progress, start=self.step_count
        )
        fallback = OOMFallback(
            self.setup,
            batch_size=self.batch_size,
            fallback_plans=self.fallback_plans,
            log=lambda m: bar.print(f"[yellow]{m}[/]") if self.progress else _log(m),
            on_switch=self._on_switch,
        )
        fallback.steps = self.step_count
        device = _device_of(self.model)
        tokens, checkpoint, start_step = 0, None, self.step_count
        window = _TrackWindow(self.track_every)
        t0 = time.perf_counter()
        with bar:
            while self.step_count < self.max_steps:
                indices, batch = self.stream.next_batch()
                batch = _to_device(batch, device)
                step_downs = len(fallback.step_downs)
                record = window.records(self.step_count - start_step)
                tracker = None
                if record or self.cap is not None:
                    tracker = track(self.model, self.optimizer, cap=self.cap)
                with tracker if tracker is not None else contextlib.nullcontext():
                    if tracker is not None:
                        tracker.add_inputs(batch)
                    loss = float(fallback.step(batch))
                if len(fallback.step_downs) > step_downs:
                    window.after_step_down()
                if tracker is not None:
                    window.seen(tracker, keep_report=record)
                    del tracker
                self.scheduler.step()
                self.step_count += 1
                self.losses.append(loss)
                tokens += _count_tokens(batch)
                elapsed = time.perf_counter() - t0
                bar.update(
                    self.step_count,
                    loss,
                    tokens / max(elapsed, 1e-9),
                    window.live_bytes,
                    window.peak_bytes,
                )
                if self.on_step is not None:
                    self.on_step(StepInfo(self.step_count, loss, batch, list(indices), self.plan))
                del batch
                if self._due(self.eval_data is not None, self.eval_every):
                    value = self.evaluate()
                    self.eval_losses.append((self.step_count, value))
                    bar.print(f"step {self.step_count}: eval loss {value:.4f}")
                if self._due(self.checkpoint_dir is not None, self.checkpoint_every):
                    checkpoint = str(self.save())
        seconds = time.perf_counter() - t0
        report = window.report
        if report is None:  # only when no step ran (a resumed run already at max_steps)
            raise ValueError("no step was run: max_steps is already reached by the checkpoint")
        report.meta.update(
            tracked_steps=window.tracked_steps,
            run_peak_bytes=window.peak_bytes,
            steps=self.step_count,
            batch_size=self.batch_size,
            plan=self.plan.to_dict(),
            losses=list(self.losses),
            num_parameters=sum(p.numel() for p in self.model.parameters()),
        )
        if self.progress:
            from rich.console import Console

            console = self.console or Console(stderr=True)
            console.print(report.table())
        if self.report_png is not None:
            report.plot(self.report_png, title=f"memfit train: {self.step_count} steps")
        if not self.losses:
            raise ValueError("no step was run: max_steps is already reached by the checkpoint")
        return TrainResult(
            first_loss=self.losses[0],
            final_loss=self.losses[-1],
            steps=self.step_count,
            peak_bytes=int(max(report.peak_bytes, window.peak_bytes)),
            losses=list(self.losses),
            eval_losses=list(self.eval_losses),
            report=report,
            plan=self.plan.to_dict(),
            step_downs=[s.to_dict() for s in fallback.step_downs],
            tokens=tokens,
            seconds=seconds if self.step_count > start_step else 0.0,
            checkpoint=checkpoint,
        )

    def _due(self, enabled: bool, every: int | None) -> bool:
        """Whether a periodic action (evaluation, checkpoint) runs after this step: every
        ``every`` steps and after the last one."""
        if not enabled:
            return False
        return self.step_count == self.max_steps or bool(every and self.step_count % every == 0)

    def _on_switch(self, setup: TrainingSetup, rebuilt: bool) -> None:
        self.setup = setup
        if rebuilt:
            self.scheduler = build_scheduler(
                setup.optimizer,
                self.schedule,
                warmup_steps=self.warmup_steps,
                max_steps=self.max_steps,
                start_step=self.step_count,
            )


class _TrackWindow:
    """Which steps a trainer tracks, and what it keeps of them: bounded, however long the run.

    Each tracked step gets a fresh tracker, dropped after the step; the report of the tracked
    step with the highest peak is kept, with running figures for the progress bar.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.report: MemoryReport | None = None
        self.peak_bytes = 0
        self.live_bytes = 0
        self.tracked_steps = 0
        self._extra = 0  # steps still to track after a step-down

    def records(self, step: int) -> bool:
        """Whether the ``step``-th step of this run (from 0) is tracked."""
        return step < 2 or (step + 1) % self.every == 0 or self._extra > 0

    def after_step_down(self) -> None:
        """Track the next two steps too: they run under the plan stepped down to."""
        self._extra = 3  # the step that stepped down (already done) counts itself off

    def seen(self, tracker: Any, *, keep_report: bool) -> None:
        """Fold a finished step's tracker in."""
        self._extra = max(0, self._extra - 1)
        self.peak_bytes = max(self.peak_bytes, tracker.peak_bytes)
        self.live_bytes = tracker.live_bytes
        if keep_report:
            self.tracked_steps += 1
            report = tracker.report()
            if self.report is None or report.peak_bytes >= self.report.peak_bytes:
                self.report = report


def _with_lr(plan: Plan, lr: float | None) -> Plan:
    if lr is None:
        return plan
    import dataclasses

    return plan.replace(optimizer=dataclasses.replace(plan.optimizer, lr=float(lr)))


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _log(message: str) -> None:
    import logging

    logging.getLogger("memfit.train").warning(message)
