"""The Trainer: a loop over one step and a list of callbacks.

Per step, :meth:`Trainer.fit` takes the next batch, enters every callback's
:meth:`~memfit.train.callbacks.Callback.step_context` (the memory tracker of a windowed step),
runs the step through the OOM fallback (:class:`~memfit.train.callbacks.OOMFallbackCallback`,
which runs ``TrainingSetup.step``, the one loop over the plan's Stepper), steps the LR schedule
and calls every callback's ``on_step_end``. The built-in callbacks, each in its own module of
:mod:`memfit.train.callbacks`:

* OOM fallback: step the plan down and redo a step that ran out of memory;
* memory report: windowed tracking (host memory bounded however long the run) and the report;
* progress: the progress bar and the final memory table;
* evaluation: the held-out loss every N steps and after the last;
* checkpoints: save every N steps and after the last (resume is :meth:`Trainer.load`).

The run's settings are a :class:`~memfit.train.config.TrainConfig`; the Trainer's keyword
arguments of the same names override its fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..apply.compose import TrainingSetup, apply_plan
from ..errors import MemfitError
from ..plan import Plan
from ..strategies.precision import weights_dtype
from ..workload import Batch, Workload
from .arguments import check_batch_covers_accumulation, check_trainer_arguments
from .callbacks import (
    Callback,
    CheckpointCallback,
    EvaluationCallback,
    MemoryReportCallback,
    OnStep,
    OOMFallbackCallback,
    ProgressCallback,
    StepInfo,
    TrainProgress,
    evaluate,
)
from .callbacks.checkpointing import load_trainer, save_trainer
from .checkpoint import adopt_checkpoints, latest_checkpoint
from .config import DEFAULT_BATCH_SIZE, TrainConfig
from .data import BatchStream, collate
from .lock import hold
from .manifest import params_sha256
from .oom import switch_plan
from .phases import PhaseRecorder
from .result import TrainResult
from .resume import resume_point
from .schedule import LR_SCHEDULES, build_scheduler, lr_factor
from .stopping import STOP, StopRequested, catch_signals, exit_code
from .streams import IterableStream, WorkloadStream, count_tokens, is_map_style, to_device

__all__ = [
    "LR_SCHEDULES",
    "StepInfo",
    "TrainProgress",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "build_scheduler",
    "evaluate",
    "lr_factor",
]

logger = logging.getLogger("memfit.train")


class TrainingDiverged(MemfitError, RuntimeError):
    """The loss became NaN or infinite with no loss scaler to skip the step; ``str(error)``
    names the step, the batch's samples and the last good checkpoint."""


class Trainer:
    """Train a model under a memory plan, with OOM step-down, checkpoints and a memory report.

    Example::

        trainer = Trainer(model, plan, dataset, config=TrainConfig(batch_size=16, max_steps=200))
        trainer = Trainer(model, plan, dataset, batch_size=16, max_steps=200)  # the same
        result = trainer.fit()
        print(result.final_loss, result.peak_bytes)

    Args:
        workload_or_model: A :class:`~memfit.workload.Workload` (built with the seed; its loss
            and, without ``train_data``, its batch maker are used) or an ``nn.Module``.
        plan: The plan (default: the config's ``plan``, else plain AdamW in fp32). Its
            ``sequence`` settings shape batches of a dataset (length grouping, pad multiple).
        train_data: A map-style dataset of samples (dicts of 1-D tensors, e.g.
            :class:`~memfit.train.data.TextDataset`), batched by a seeded
            :class:`~memfit.train.data.BatchStream`; or an iterable of ready batches (a
            ``DataLoader``), re-iterated when exhausted.
        eval_data: Evaluation data of the same kinds (each evaluation reads its first
            ``eval_max_batches`` batches).
        config: The run's settings (default: ``TrainConfig()``); the loop reads ``batch_size``,
            ``max_steps``, ``lr``, ``schedule``, ``warmup_steps``, ``seed``, ``eval_every``,
            ``eval_max_batches``, ``checkpoint_dir``, ``checkpoint_every``,
            ``keep_checkpoints``, ``resume``, ``cap`` and ``track_every`` (see
            :class:`~memfit.train.config.TrainConfig` for each, with its cost), and ``plan``
            when no plan is given.
        lr, schedule, warmup_steps, max_steps, eval_every, eval_max_batches, checkpoint_dir,
            checkpoint_every, keep_checkpoints, resume, cap, seed, batch_size, track_every:
            Each, when given
            (not ``None``), overrides the config's field of that name. Without a config the
            defaults are :class:`~memfit.train.config.TrainConfig`'s: 300 steps, 10 warm-up
            steps, batch 16 (a workload's own batch size for a workload). ``cap`` is bytes or
            a size string.
        fallback_plans: Plans to try when a step runs out of memory (e.g. the planner's
            frontier): those that keep the optimizer first, in order, then
            :func:`~memfit.train.oom.step_down`, then those that need a new optimizer (see
            :meth:`~memfit.train.oom.OOMFallback.next_plan`).
        progress: Show the progress bar, step-down notices and the final memory table.
        loss_fn: ``loss_fn(output, batch)``; default: the workload's, else the output's
            ``.loss``.
        collate_fn: Turns a list of samples into a batch (default: dynamic padding with pad
            id 0; padded positions never reach the loss).
        on_step: Called with a :class:`~memfit.train.callbacks.StepInfo` after every step.
        callbacks: More :class:`~memfit.train.callbacks.Callback` objects, run after the
            built-in ones.
        report_png: Write the memory report's plot here at the end.
        console: The rich console for progress and messages (default: stderr).

    Raises:
        ValueError: (:class:`~memfit.train.config.ConfigError`) for a bad setting, in one
            sentence; a :class:`~memfit.errors.MemfitValueError` for a model without
            ``train_data`` or a batch smaller than the plan's ``grad_accum_steps``.
        MemfitTypeError: (a ``TypeError``) for an argument of the wrong kind: something that
            is neither a workload nor a module, a plan that is not a :class:`Plan`, ...

    Attributes:
        resumed_from: The checkpoint the last :meth:`fit` continued from, if it resumed.
    """

    resumed_from: str | None = None

    def __init__(
        self,
        workload_or_model: Workload | nn.Module,
        plan: Plan | None = None,
        train_data: Any = None,
        *,
        eval_data: Any = None,
        config: TrainConfig | None = None,
        lr: float | None = None,
        schedule: str | None = None,
        warmup_steps: int | None = None,
        max_steps: int | None = None,
        eval_every: int | None = None,
        eval_max_batches: int | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = None,
        resume: bool | str | None = None,
        cap: int | str | None = None,
        seed: int | None = None,
        batch_size: int | None = None,
        track_every: int | None = None,
        fallback_plans: Sequence[Plan] | None = None,
        progress: bool = True,
        loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
        callbacks: Sequence[Callback] = (),
        report_png: str | Path | None = None,
        console: Any = None,
    ) -> None:
        check_trainer_arguments(locals())  # before any work (issue 37)
        given = dict(
            lr=lr,
            schedule=schedule,
            warmup_steps=warmup_steps,
            max_steps=max_steps,
            eval_every=eval_every,
            eval_max_batches=eval_max_batches,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            resume=resume,
            cap=cap,
            seed=seed,
            batch_size=batch_size,
            track_every=track_every,
        )
        cfg = (config or TrainConfig()).replace(**{k: v for k, v in given.items() if v is not None})
        self.config = cfg
        self.workload = workload_or_model if isinstance(workload_or_model, Workload) else None
        plan = _with_lr(plan if plan is not None else (cfg.load_plan() or Plan()), cfg.lr)
        check_batch_covers_accumulation(
            cfg.batch_size or (self.workload.batch_size if self.workload else DEFAULT_BATCH_SIZE),
            plan,
        )
        # The learning rate is the run's, whichever plan a step-down moves to.
        fallback = None if fallback_plans is None else [_with_lr(p, cfg.lr) for p in fallback_plans]
        self.seed, self.max_steps = cfg.seed, cfg.max_steps
        torch.manual_seed(cfg.seed)
        #: The job's phases measured so far (``TrainResult.phases``; see :mod:`memfit.train.job`).
        self.phases = PhaseRecorder()
        with self.phases.phase("load", device=torch.get_default_device()):
            self.model = self._model(workload_or_model, plan)
            if self.workload is not None:
                loss_fn = loss_fn or self.workload.loss_fn
            self.setup: TrainingSetup = apply_plan(self.model, plan, loss_fn=loss_fn)
        self.batch_size = cfg.batch_size or (
            self.workload.batch_size if self.workload is not None else DEFAULT_BATCH_SIZE
        )
        self.scheduler = self._scheduler()
        self.collate_fn = collate_fn or collate
        self.train_data, self.eval_data = train_data, eval_data
        self.stream = self._make_stream(train_data)
        self.step_count = 0
        self.losses: list[float] = []
        self.eval_losses: list[tuple[int, float]] = []
        # The built-in callbacks, in the order their hooks run.
        self.oom = OOMFallbackCallback(fallback)
        self.memory = MemoryReportCallback(
            every=cfg.track_every, cap=cfg.cap_bytes, report_png=report_png, phases=self.phases
        )
        self.progress = ProgressCallback(enabled=progress, console=console)
        # A fine-tune of saved weights is also evaluated before its first step (step 0).
        at_start = self.workload is not None and self.workload.weights is not None
        self.evaluation = EvaluationCallback(
            eval_data, every=cfg.eval_every, collate_fn=self.collate_fn, at_start=at_start,
            phases=self.phases, max_batches=cfg.eval_batch_limit,
        )
        self.checkpoints = CheckpointCallback(cfg.checkpoint_dir, every=cfg.checkpoint_every,
                                              keep=cfg.keep_checkpoints, phases=self.phases)
        self.callbacks: list[Callback] = [self.oom, self.memory, self.progress]
        if on_step is not None:
            self.callbacks.append(OnStep(on_step))
        self.callbacks += [self.evaluation, self.checkpoints, *callbacks]

    def _model(self, workload_or_model: Workload | nn.Module, plan: Plan) -> nn.Module:
        """The model to train, in train mode: the workload's, built with the seed (its saved
        weights, when it has them, loaded straight into the plan's weight dtype: a bf16-pure
        fine-tune never holds the model in fp32), or the module given."""
        if self.workload is None:
            assert isinstance(workload_or_model, nn.Module)
            workload_or_model.train()
            return workload_or_model
        model, _ = self.workload.build(
            seed=self.config.seed, pretrained=True, dtype=weights_dtype(plan.precision.mode)
        )
        return model

    # ------------------------------------------------------------------ state
    @property
    def plan(self) -> Plan:
        """The plan in force (after any step-down)."""
        return self.setup.plan

    @property
    def optimizer(self) -> Any:
        """The optimizer in force."""
        return self.setup.optimizer

    @property
    def device(self) -> torch.device:
        """The model's device (batches are moved there)."""
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    @property
    def cap(self) -> int | None:
        """The virtual memory cap in bytes, or ``None``."""
        return self.config.cap_bytes

    @property
    def checkpoint_dir(self) -> Path | None:
        """The checkpoint folder, or ``None``."""
        folder = self.config.checkpoint_dir
        return Path(folder) if folder is not None else None

    def _scheduler(self, start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        cfg = self.config
        return build_scheduler(
            self.setup.optimizer,
            cfg.schedule,
            warmup_steps=cfg.warmup_steps,
            max_steps=cfg.max_steps,
            start_step=start_step,
        )

    def _make_stream(self, data: Any) -> Any:
        if data is None:
            assert self.workload is not None
            return WorkloadStream(self.workload, self.model, self.batch_size)
        if not is_map_style(data):
            return IterableStream(data)
        seq = self.plan.sequence

        def collate_fn(samples: list[Any]) -> Batch:
            if self.collate_fn is collate:
                return collate(samples, pad_to_multiple_of=seq.pad_to_multiple_of)
            return self.collate_fn(samples)

        return BatchStream(
            data,
            self.batch_size,
            collate_fn=collate_fn,
            seed=self.seed,
            group_by_length=seq.group_by_length,
        )

    def adopt_setup(self, setup: TrainingSetup, rebuilt: bool) -> None:
        """Train on with ``setup`` (after a plan switch); a rebuilt optimizer gets a schedule
        that continues from the current step."""
        self.setup = setup
        if rebuilt:
            self.scheduler = self._scheduler(start_step=self.step_count)

    def switch_plan(self, plan: Plan) -> None:
        """Move to ``plan`` on the same model (remove-then-apply; the optimizer is kept when
        the plans allow it). See :func:`~memfit.train.oom.switch_plan`."""
        setup, rebuilt = switch_plan(self.setup, plan)
        self.adopt_setup(setup, rebuilt)

    # ------------------------------------------------------------------ messages
    def say(self, message: str) -> None:
        """Show a line above the progress bar (nothing without a bar)."""
        self.progress.print(message)

    def warn(self, message: str) -> None:
        """Show a notice above the progress bar, or log it without a bar."""
        if not self.progress.print(f"[yellow]{message}[/]"):
            logger.warning(message)

    # ------------------------------------------------------------------ parts
    def evaluate(self) -> float:
        """Mean loss on ``eval_data`` under the plan in force (NaN without it)."""
        return self.evaluation.evaluate(self)

    def save(self) -> Path:
        """Write a checkpoint of the current state to the checkpoint folder."""
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint_dir was given to the Trainer")
        with self.phases.phase("save", self.model, self.optimizer):
            return save_trainer(self, self.checkpoint_dir, keep=self.config.keep_checkpoints)

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint: weights, optimizer, schedule, RNG, data position, plan."""
        with self.phases.phase("load_checkpoint", self.model, self.optimizer):
            load_trainer(self, path)

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainResult:
        """Train up to ``max_steps`` and return the :class:`TrainResult`.

        A SIGTERM or SIGINT (:mod:`memfit.train.stopping`) ends the run soon and cleanly: an
        evaluation stops before its next batch, a step in progress is finished, and a
        checkpoint is saved when there is a checkpoint folder; ``result.stopped_by`` names the
        signal (``"SIGTERM"``) and ``memfit train`` exits with ``128 + signal`` (143, 130). A
        second signal interrupts at once (``KeyboardInterrupt``).

        Raises:
            torch.OutOfMemoryError: when even the smallest plan runs out of memory.
            TrainingDiverged: when the loss is NaN or infinite and no loss scaler skips the step
                (the last good checkpoint is kept).
            CheckpointError: (a ``ValueError``) for a corrupt checkpoint, a data file changed
                since it was saved, or a checkpoint that cannot be written.
            ValueError: when a resumed run has no step left to run.
            StopRequested: when a signal came before the first step of this ``fit`` (nothing
                was trained, so nothing is saved).
        """
        # One writer per checkpoint folder, for the whole run (re-entrant: memfit train took
        # it already, before any work).
        with hold(self.checkpoint_dir):
            return self._fit()

    def _fit(self) -> TrainResult:
        cfg = self.config
        point = resume_point(self.checkpoint_dir, cfg.resume, cfg.resume_from)
        if point is not None:
            self.load(point.path)
            adopt_checkpoints(point.path.parent)  # pruned as this run's own from now on
            self.resumed_from = str(point.path)
        started: list[Callback] = []
        result: TrainResult | None = None
        with catch_signals():
            try:
                for callback in self.callbacks:
                    callback.on_fit_start(self)
                    started.append(callback)
                result = self._loop()
            finally:
                for callback in started:
                    callback.on_fit_end(self, result)
        assert result is not None  # _loop returned, or its error propagated above
        return result

    def _stop_agreed(self) -> bool:
        """Whether to stop after this step: a signal to this process, or (data parallelism)
        to any process, since every process must stop at the same step (a save is a
        collective)."""
        if self.setup.parallel is not None:
            from ..distributed.data import any_rank

            if any_rank(STOP.requested, self.device) and not STOP.requested:
                STOP.request(signal.SIGTERM, "SIGTERM (another process)")
        return STOP.requested

    def _check_loss(self, loss: float, indices: list[int]) -> None:
        if math.isfinite(loss) or getattr(self.setup.precision, "scaler", None) is not None:
            return  # a scaler skips the step of a non-finite loss and training goes on
        where = f"samples {indices[:8]}{' ...' if len(indices) > 8 else ''}" if indices else (
            f"batch {self.step_count + 1}"
        )
        last = self.checkpoints.last or (
            str(latest_checkpoint(self.checkpoint_dir)) if self.checkpoint_dir else None
        )
        kept = f"; the last good checkpoint is {last}" if last else "; no checkpoint was written"
        raise TrainingDiverged(
            f"the loss is {loss} at step {self.step_count + 1} ({where}) and there is no loss "
            f"scaler to skip the step, so training stopped{kept}"
        )

    def _loop(self) -> TrainResult:
        device, start_step, tokens = self.device, self.step_count, 0
        t0 = time.perf_counter()
        while self.step_count < self.max_steps:
            if self.step_count == start_step and self._stop_agreed():
                # A signal before the first step (an evaluation at step 0 was cut short).
                raise StopRequested(str(STOP.signal_name), exit_code(STOP.signum))
            indices, batch = self.stream.next_batch()
            batch = to_device(batch, device)
            with contextlib.ExitStack() as stack:
                for callback in self.callbacks:
                    stack.enter_context(callback.step_context(self, batch))
                loss = float(self.oom.step(self, batch))
            self._check_loss(loss, list(indices))
            self.scheduler.step()
            self.step_count += 1
            self.losses.append(loss)
            n = count_tokens(batch)
            tokens += n
            info = StepInfo(self.step_count, loss, batch, list(indices), self.plan, n)
            del batch
            for callback in self.callbacks:
                callback.on_step_end(self, info)
            del info
            if self._stop_agreed():
                if self.checkpoint_dir is not None and not self._saved_this_step():
                    self.checkpoints.last = str(self.save())
                break
        seconds = time.perf_counter() - t0
        if not self.losses or self.step_count == start_step:
            raise ValueError(
                f"no step was run: the checkpoint {self.resumed_from or ''} is at step "
                f"{self.step_count} and max_steps is {self.max_steps}; raise --max-steps "
                f"(max_steps) above {self.step_count} to train on"
            )
        report = self.memory.finish(self)
        return TrainResult(
            first_loss=self.losses[0],
            final_loss=self.losses[-1],
            steps=self.step_count,
            peak_bytes=int(max(report.peak_bytes, self.memory.peak_bytes)),
            losses=list(self.losses),
            eval_losses=list(self.eval_losses),
            report=report,
            plan=self.plan.to_dict(),
            step_downs=[s.to_dict() for s in self.oom.step_downs],
            tokens=tokens,
            seconds=seconds,
            checkpoint=self.checkpoints.last,
            params_sha256=params_sha256(self.model),
            stopped_by=STOP.signal_name,
            eval_batches=list(self.evaluation.batches_run),
            phases=self.phases.record,
            resumed_from=self.resumed_from,
            steps_run=self.step_count - start_step,
        )

    def _saved_this_step(self) -> bool:
        last = self.checkpoints.last
        return last is not None and Path(last).name == f"step-{self.step_count:08d}"


def _with_lr(plan: Plan, lr: float | None) -> Plan:
    if lr is None:
        return plan
    return plan.replace(optimizer=dataclasses.replace(plan.optimizer, lr=float(lr)))
