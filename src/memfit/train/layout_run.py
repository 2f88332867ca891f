"""``memfit train`` for a plan with tensor or pipeline parallelism: :func:`train_layout`.

A plan whose ``parallel.tensor`` or ``parallel.pipeline`` is above 1 does not run through the
:class:`~memfit.train.Trainer` (whose plan machinery is one model per process) but through
:func:`memfit.distributed.layout.build_layout`, in every process of the launched world:

* the model, the text and the batches are the ones :func:`~memfit.train.run.prepare_run`
  builds for a single process, the model seeded alike on every rank (the weights agree before
  the layout cuts and splits them);
* every rank draws the same global batch from the same seeded
  :class:`~memfit.train.data.BatchStream` and its data-parallel replica takes its slice
  (:func:`~memfit.distributed.data.local_batch`), as the data-parallel path splits batches;
* the plan's optimizer (torch's AdamW, Adam or SGD) over :meth:`Layout.parameters`, with the
  run's learning-rate schedule (:func:`~memfit.train.schedule.build_scheduler`);
* each step through :func:`~memfit.apply.stepper.run_step`, the loop every engine shares, with
  the layout's :class:`~memfit.distributed.layout.LayoutStepper` (the replica's share, the
  pipeline schedule's forwards and backwards, the optimizer's step);
* memory measured by memfit's tracker on the steps :class:`~memfit.train.callbacks.memory.
  TrackWindow` picks (the first two, then every ``track_every``-th), each rank its own peak
  and report, and its own plot (:mod:`memfit.train.layout_memory`);
* ``bf16-mixed``: the whole schedule (its forwards and backwards interleave) under autocast;
* checkpoints (``checkpoint_dir``, ``checkpoint_every``, ``keep_checkpoints``) sharded through
  ``torch.distributed.checkpoint`` and ``resume`` from the latest, bit for bit
  (:mod:`memfit.train.layout_checkpoint`);
* evaluation on the held-out samples every ``eval_every`` steps and after the last, through
  the pipeline schedule's forward-only pass (:mod:`memfit.train.layout_eval`).

What this path does not do is refused before launch by :func:`check_layout_run`, one sentence
each: a virtual cap, optimizers other than torch's, and plan techniques the layout does not
apply (fp16 or bf16-pure precision, offload, compile, ...).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import MemfitError
from ..optim import registry as optim_registry
from ..plan import Plan
from .config import DEFAULT_BATCH_SIZE, TrainConfig
from .run import TrainRun

__all__ = [
    "LayoutRunError",
    "LayoutRunResult",
    "check_layout_run",
    "is_layout_plan",
    "layout_optimizers",
    "predict_rank_peaks",
    "train_layout",
]


def layout_optimizers() -> tuple[str, ...]:
    """The optimizers the layout path builds (the registry's ``layout`` ones: torch's own,
    which step DTensor shards elementwise)."""
    return tuple(s.name for s in optim_registry.specs() if s.layout)


class LayoutRunError(MemfitError, ValueError):
    """A run setting or plan technique the tensor/pipeline path does not do."""


def is_layout_plan(plan: Plan | None) -> bool:
    """Whether ``plan`` splits the model by tensor or pipeline (so trains through a layout)."""
    return plan is not None and plan.parallel.splits_model


def check_layout_run(config: TrainConfig, plan: Plan) -> None:
    """Refuse, before any process starts, what the tensor/pipeline path does not do, and a
    resume that cannot run (the latest checkpoint of another layout, or at ``max_steps``).

    Raises:
        LayoutRunError: naming each setting, one sentence each, and what to use instead.
        CheckpointError: for a resume that cannot run.
    """
    par = plan.parallel
    what = f"a tensor {par.tensor} x pipeline {par.pipeline} x context {par.context} plan"
    problems = []
    if config.cap is not None:
        problems.append(
            f"{what} has no out-of-memory step-down, so --cap is not applied; leave it out and "
            "compare the per-process peaks with the budget")
    if not optim_registry.get(plan.optimizer.name).layout:
        problems.append(
            f"{what} builds torch's {', '.join(layout_optimizers())} over the ranks' shards, not "
            f"optimizer {plan.optimizer.name!r}; use one of those")
    if config.checkpoint_dir is not None and par.replicas > 1 and not par.sharded:
        # Under DDP (distributed/replicas.py) a resumed run was seen to leave the straight
        # run's losses from its second step on (data 2 x pipeline 2), and under tensor
        # parallelism DDP steps the shards as plain local tensors, which
        # torch.distributed.checkpoint's get_state_dict cannot map to the model's names.
        problems.append(
            f"{what} with {par.replicas} replicas at ZeRO stage {par.zero_stage} (DDP) has no "
            "checkpoints yet; use zero_stage 2 or 3 (FSDP2), or leave out --checkpoint-dir")
    ignored = _ignored_techniques(plan)
    if ignored:
        problems.append(
            f"{what} trains with the layout, the plan's precision (fp32 or bf16-mixed) and its "
            f"checkpointing (full or selective) alone "
            f"and would ignore the plan's "
            f"{', '.join(ignored)}; remove {'it' if len(ignored) == 1 else 'them'} from the plan")
    if problems:
        raise LayoutRunError("; ".join(problems))
    from .resume import resume_point

    point = resume_point(config.checkpoint_dir, config.resume, config.resume_from)
    if point is not None:
        from .layout_checkpoint import check_resume_before_launch

        check_resume_before_launch(point.path, par, config.max_steps)
    from ..distributed.layout import check_layout

    # The model's heads, widths, vocabulary and blocks against the degrees, and the batch
    # against the replicas and micro-batches: built on the meta device, nothing allocated.
    check_layout(_meta_model(config), par, batch_size=config.batch_size or DEFAULT_BATCH_SIZE,
                 world_size=par.world_size, seq_len=config.seq_len)


def _meta_model(config: TrainConfig) -> torch.nn.Module:
    """The run's model on the meta device (its class and config; no memory)."""
    from .run import run_tokenizer, text_workload

    batch = config.batch_size or DEFAULT_BATCH_SIZE
    workload = text_workload(config.model, run_tokenizer(config), batch, config.seq_len)
    with torch.device("meta"):
        return workload.build_model()


def _ignored_techniques(plan: Plan) -> list[str]:
    """The plan's techniques that :func:`build_layout` does not apply, as the plan names them."""
    # Each technique says whether a tensor/pipeline layout builds it; named as the plan does.
    labels = [t.describe(plan) for t, _ in plan.techniques() if t.refuses(plan, "layout")]
    return list(dict.fromkeys(labels))  # the three offload techniques are one field


def predict_rank_peaks(run: TrainRun, plan: Plan) -> list[int] | None:
    """Every rank's predicted peak (:func:`~memfit.estimate.layout.predict_layout`), or
    ``None`` when it cannot predict this run. Call it before joining the process group: the
    prediction runs in a fake one. ``None`` for bf16-mixed: predict_layout models fp32 (with
    the plan's checkpointing, partitioned or not)."""
    if plan.precision.mode != "fp32":
        return None
    try:
        from ..estimate.layout import predict_layout

        w = run.workload
        with torch.device("meta"):  # only its class and config are used
            model = w.build_model()
        prediction = predict_layout(model, plan.parallel, batch_size=w.batch_size,
                                    seq_len=w.seq_len, optimizer=plan.optimizer,
                                    foreach=plan.optimizer.foreach,
                                    checkpointing=plan.checkpointing)
        return [int(p) for p in prediction.peak_bytes]
    except Exception:  # a figure for the report only: the run does not depend on it
        return None


@dataclass
class LayoutRunResult:
    """What a tensor/pipeline run did, as every rank knows it.

    Attributes:
        first_loss: The first step's loss (mean over the whole global batch; of the whole run,
            also when resumed).
        final_loss: The last step's.
        losses: Every step's (a resumed run's from its first).
        steps: Steps done in all.
        peak_bytes: This rank's measured peak (memfit's tracker, over the tracked steps).
        per_rank_peak_bytes: Every rank's, in rank order.
        coords: This rank's place in the mesh (``pp``, ``dp``, ``tp``).
        tokens: Tokens trained on in this run (the global batches').
        seconds: Wall time of this run's steps.
        plan: The plan, as plain data.
        eval_losses: ``(step, loss)`` of each evaluation (the held-out loss, every rank's alike).
        checkpoint: The last checkpoint written, if any.
        report: This rank's :class:`~memfit.accounting.MemoryReport` (its tracked step with
            the highest peak), ``None`` when no step was tracked.
        rank_reports: Every rank's report as plain data (:meth:`MemoryReport.to_dict`, 200
            timeline points), in rank order.
        stopped_by: ``"SIGTERM"`` (``"SIGINT"``) when a signal to this process ended the run
            early (after a checkpoint), ``"SIGTERM (another process)"`` when one to another
            did, else ``None``.
        eval_batches: ``(step, batches)`` of each evaluation: the batches it read (at most
            ``eval_max_batches``; fewer, and no ``eval_losses`` entry, when a signal cut it).
        resumed_from: The checkpoint the run continued from, if it resumed.
        steps_run: Steps this run ran (``steps`` less a resumed run's start).
    """

    first_loss: float
    final_loss: float
    losses: list[float]
    steps: int
    peak_bytes: int
    per_rank_peak_bytes: list[int]
    coords: dict[str, int]
    tokens: int
    seconds: float
    plan: dict[str, Any] = field(default_factory=dict)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoint: str | None = None
    report: Any = None
    rank_reports: list[dict[str, Any] | None] = field(default_factory=list)
    stopped_by: str | None = None
    eval_batches: list[tuple[int, int]] = field(default_factory=list)
    resumed_from: str | None = None
    steps_run: int | None = None

    @property
    def tokens_per_second(self) -> float:
        """Training throughput over the whole world."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the data-parallel run's keys where they mean the same; the
        memory report is the rank's with the highest peak, every rank's follows)."""
        peaks = self.per_rank_peak_bytes
        top = self.rank_reports[peaks.index(max(peaks))] if self.rank_reports else None
        return {
            "first_loss": self.first_loss,
            "final_loss": self.final_loss,
            "steps": self.steps,
            "steps_run": self.steps_run,
            "resumed_from": self.resumed_from,
            "peak_bytes": max(peaks),
            "per_rank_peak_bytes": list(peaks),
            "peak_by_category": dict(top["peak_by_category"]) if top else {},
            "losses": list(self.losses),
            "eval_losses": [list(e) for e in self.eval_losses],
            "plan": self.plan,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "checkpoint": self.checkpoint,
            "memory_report": top,
            "per_rank_memory_reports": list(self.rank_reports),
            "stopped_by": self.stopped_by,
            "eval_batches": [list(e) for e in self.eval_batches],
        }


def _device() -> torch.device:
    from ..device import cuda_available

    if cuda_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def train_layout(
    run: TrainRun, plan: Plan, *, console: Any = None, progress: bool = True,
    report_png: str | Path | None = None,
) -> LayoutRunResult:
    """Train ``run`` under ``plan``'s tensor x pipeline x data layout in this process, one of
    the ``plan.parallel.world_size`` processes of the open process group (each calls this).

    With the run's ``checkpoint_dir``: a checkpoint every ``checkpoint_every`` steps and after
    the last (:mod:`memfit.train.layout_checkpoint`), and with ``resume`` the latest one is
    continued bit for bit. With evaluation samples (``run.eval``): the held-out loss every
    ``eval_every`` steps and after the last (:mod:`memfit.train.layout_eval`); a fine-tune's
    saved weights are evaluated first, as step 0. A SIGTERM to any process ends the run on
    every process after the step in flight, with a checkpoint (``result.stopped_by``).

    Args:
        run: The run, as :func:`~memfit.train.run.prepare_run` builds it for one process
            (``world_size=1``: the plan's own degrees are used, not widened).
        plan: The plan (checked by :func:`check_layout_run`).
        console: A rich console for the progress bar (default: stderr).
        progress: Show the progress bar (rank 0 only).
        report_png: Each rank draws its memory report beside this path
            (:func:`~memfit.train.layout_memory.rank_plot_path`: ``mem-rank0.png``, ...).

    Returns:
        The :class:`LayoutRunResult`, with every rank's peak and report (gathered: a
        collective).

    Raises:
        LayoutError: when the layout cannot work for this model or batch.
        TrainingDiverged: when the loss becomes NaN or infinite.
        CheckpointError: for a checkpoint that cannot be written, or resumed (corrupt, another
            layout, changed data).
        ValueError: when a resumed run has no step left to run.
    """
    import torch.distributed as dist

    loop = _LayoutLoop(run, plan)
    loop.resume()
    start = loop.step_count
    bar = _Progress(run.config.max_steps, console, start=loop.step_count) if progress else None
    try:
        seconds, tokens = loop.train(bar)
    finally:
        if bar is not None:
            bar.close()
    rank = dist.get_rank()
    report = loop.memory.finish(
        rank=rank, coords=dict(loop.layout.coords), steps=loop.step_count,
        batch_size=run.workload.batch_size, plan=plan.to_dict(), losses=list(loop.losses),
        num_parameters=sum(_local_numel(p) for p in loop.layout.parameters()))
    if report is not None and report_png is not None:
        from .layout_memory import rank_plot_path

        report.plot(rank_plot_path(report_png, rank),
                    title=f"memfit train: {loop.step_count} steps, rank {rank} "
                          f"(pp {loop.layout.coords['pp']}, dp {loop.layout.coords['dp']}, "
                          f"tp {loop.layout.coords['tp']})")
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = (loop.memory.peak_bytes, report.to_dict(max_points=200) if report else None)
    dist.all_gather_object(gathered, mine)
    return LayoutRunResult(
        first_loss=loop.losses[0], final_loss=loop.losses[-1], losses=list(loop.losses),
        steps=loop.step_count, peak_bytes=loop.memory.peak_bytes,
        per_rank_peak_bytes=[int(g[0]) for g in gathered], coords=dict(loop.layout.coords),
        tokens=tokens, seconds=seconds, plan=plan.to_dict(), eval_losses=list(loop.eval_losses),
        checkpoint=loop.last_checkpoint, report=report, rank_reports=[g[1] for g in gathered],
        stopped_by=loop.stopped_by, resumed_from=loop.resumed_from,
        steps_run=loop.step_count - start, eval_batches=list(loop.eval_batches),
    )


def _local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of ``p`` (a DTensor's local shard)."""
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


class _LayoutLoop:
    """One rank's run: the layout, its optimizer, schedule, data, memory and the run's state.

    Built as the Trainer builds its run: the same seeded model on every rank (cut and split by
    :func:`~memfit.distributed.layout.build_layout`), the plan's optimizer over the rank's
    parameters with the run's learning rate and schedule, a seeded
    :class:`~memfit.train.data.BatchStream` of global batches.
    """

    def __init__(self, run: TrainRun, plan: Plan) -> None:
        from ..distributed.layout import LayoutStepper, build_layout
        from .data import BatchStream
        from .layout_memory import RankMemory
        from .schedule import build_scheduler

        self.run, self.plan, self.config = run, plan, run.config
        cfg, par = run.config, plan.parallel
        self.device = _device()
        batch_size = run.workload.batch_size
        # The same seeded model on every rank, built as the Trainer builds it.
        torch.manual_seed(cfg.seed)
        # Saved weights load in fp32: a layout's precisions (fp32, bf16-mixed) keep fp32 weights.
        model, _ = run.workload.build(seed=cfg.seed, pretrained=True)
        self.layout = build_layout(model, par, device=self.device, batch_size=batch_size)
        del model  # a rank keeps only its stages' modules
        _checkpoint_stages(self.layout, plan)
        opt_cfg = plan.optimizer
        if cfg.lr is not None:  # the run's learning rate, as the Trainer applies it
            opt_cfg = dataclasses.replace(opt_cfg, lr=float(cfg.lr))
        self.optimizer = opt_cfg.build(self.layout.parameters())
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule,
                                         warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps)
        self.stream = BatchStream(run.train, batch_size, collate_fn=run.collate, seed=cfg.seed,
                                  group_by_length=plan.sequence.group_by_length)
        self.autocast = _autocast(plan, self.device)
        self.stepper = LayoutStepper(self.layout, self.optimizer, self.device)
        self.step_count = 0
        self.losses: list[float] = []
        self.eval_losses: list[tuple[int, float]] = []
        self.eval_batches: list[tuple[int, int]] = []
        self.last_checkpoint: str | None = None
        self.stopped_by: str | None = None
        self.memory = RankMemory(cfg.track_every)
        self.say: Any = None  # the progress bar's line above it, on rank 0
        self.resumed_from: str | None = None  # the checkpoint resume() continued from

    # ------------------------------------------------------------------ checkpoints
    def resume(self) -> None:
        """Continue from a checkpoint, when ``resume`` or ``resume_from`` asks and there is one
        (:func:`~memfit.train.resume.resume_point`): weights, optimizer, schedule, this rank's
        RNG, data position, losses."""
        from .callbacks.checkpointing import check_data
        from .checkpoint import adopt_checkpoints, read_state
        from .layout_checkpoint import load_layout_checkpoint
        from .layout_memory import RankMemory
        from .resume import resume_point

        cfg = self.config
        point = resume_point(cfg.checkpoint_dir, cfg.resume, cfg.resume_from)
        if point is None:
            return
        latest = point.path
        adopt_checkpoints(latest.parent)
        self.resumed_from = str(latest)
        state = read_state(latest)  # every file checked against the manifest, once
        check_data(self, state.get("data_files"))
        state = load_layout_checkpoint(latest, self.layout.modules, self.optimizer,
                                       parallel=self.plan.parallel, scheduler=self.scheduler,
                                       state=state)
        self.stream.load_state_dict(state.get("data") or {})
        self.step_count = int(state["step"])
        self.losses = [float(x) for x in state.get("losses", [])]
        self.eval_losses = [(int(s), float(v)) for s, v in state.get("eval_losses", [])]
        self.memory = RankMemory(cfg.track_every, start=self.step_count)
        if self.step_count >= cfg.max_steps:
            raise ValueError(
                f"no step was run: the checkpoint {latest} is at step {self.step_count} and "
                f"max_steps is {cfg.max_steps}; raise --max-steps above {self.step_count} to "
                "train on")

    def save(self) -> None:
        """A checkpoint of the current step (a collective)."""
        from .callbacks.checkpointing import data_fingerprint
        from .layout_checkpoint import save_layout_checkpoint

        path = save_layout_checkpoint(
            self.config.checkpoint_dir or ".", self.step_count, self.layout.modules,
            self.optimizer, parallel=self.plan.parallel, scheduler=self.scheduler,
            keep=self.config.keep_checkpoints,
            state={"plan": self.plan.to_dict(), "data": self.stream.state_dict(),
                   "losses": list(self.losses), "eval_losses": list(self.eval_losses),
                   "data_files": data_fingerprint(self)})
        self.last_checkpoint = str(path)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> None:
        """The held-out loss now, appended to ``eval_losses`` (a collective): at most
        ``eval_max_batches`` batches, and none after a signal to any process (then nothing
        is appended, and ``eval_batches`` says how far it got)."""
        import itertools

        from ..distributed.data import any_rank
        from .layout_eval import eval_batches, evaluate_layout
        from .stopping import STOP

        w, limit = self.run.workload, self.config.eval_batch_limit
        if self.say is not None:
            bound = f"at most {limit} batches" if limit else "all batches"
            self.say(f"step {self.step_count}: evaluating ({bound})")
        batches = eval_batches(self.run.eval, w.batch_size, self.run.collate, w.seq_len)
        counted = {"n": 0}

        def bounded() -> Any:
            for batch in itertools.islice(batches, limit):
                counted["n"] += 1
                yield batch

        # Every rank runs the same batches (a pipeline's forward is a collective): all stop
        # before the same one.
        value = evaluate_layout(self.layout, bounded(), local_batch=self.stepper.local_batch,
                                autocast=self.autocast,
                                stop=lambda: any_rank(STOP.requested, self.device))
        n = counted["n"]
        self.eval_batches.append((self.step_count, n))
        total = -(-len(self.run.eval) // w.batch_size)
        if STOP.requested and n < (total if limit is None else min(limit, total)):
            if self.say is not None:
                self.say(f"step {self.step_count}: evaluation stopped by {STOP.signal_name} "
                         f"after {n} batches")
            return
        self.eval_losses.append((self.step_count, value))
        if self.say is not None:
            self.say(f"step {self.step_count}: eval loss {value:.4f} ({n} batches)")

    # ------------------------------------------------------------------ steps
    def train(self, bar: _Progress | None) -> tuple[float, int]:
        """Steps up to ``max_steps``, with evaluations and checkpoints when due; returns the
        wall time and the tokens trained on. A SIGTERM or SIGINT to any process
        (:mod:`memfit.train.stopping`) ends the run on every process after the step in
        flight (an evaluation before its next batch), with a checkpoint when there is a
        checkpoint folder, as the Trainer does."""
        from ..distributed.data import any_rank
        from .callbacks.base import due
        from .stopping import STOP, catch_signals

        cfg = self.config
        self.say = bar.say if bar is not None else None
        at_start = self.run.workload.weights is not None and self.step_count == 0
        tokens, t0 = 0, time.perf_counter()
        with catch_signals():
            if self.run.eval is not None and at_start:  # a fine-tune's saved weights first
                self.evaluate()
            while self.step_count < cfg.max_steps:
                loss, n = self.step()
                tokens += n
                if bar is not None:
                    bar.advance(loss)
                if self.run.eval is not None and due(self.step_count, cfg.max_steps,
                                                     cfg.eval_every):
                    self.evaluate()
                saved = cfg.checkpoint_dir is not None and due(
                    self.step_count, cfg.max_steps, cfg.checkpoint_every)
                if saved:
                    self.save()
                # Every process stops at the same step (a save is a collective).
                if any_rank(STOP.requested, self.device):
                    STOP.request(signal.SIGTERM, "SIGTERM (another process)")  # kept if set
                    self.stopped_by = STOP.signal_name
                    if cfg.checkpoint_dir is not None and not saved:
                        self.save()
                    break
        return time.perf_counter() - t0, tokens

    def step(self) -> tuple[float, int]:
        """One optimizer step through :func:`~memfit.apply.stepper.run_step`; returns its loss
        and the global batch's tokens."""
        from ..apply.stepper import run_step
        from ..distributed.data import batches_are_local
        from .streams import count_tokens
        from .trainer import TrainingDiverged

        layout, plan = self.layout, self.plan
        _, batch = self.stream.next_batch()
        tokens = count_tokens(batch)
        # The replica's share, on the device before the tracker starts (it is an input).
        share = self.stepper.local_batch(batch)
        tracked = self.memory.step(self.step_count, layout.parameters(), self.optimizer,
                                   self.device, (share["input_ids"], share["labels"]))
        # The one loop: the layout's schedule runs the forwards and backwards (it splits the
        # micro-batches), then the optimizer steps and drops the gradients.
        with tracked, batches_are_local():
            loss = float(run_step(
                layout.modules[0], share, stepper=self.stepper, autocast=self.autocast,
                loss_fn=None, micro_batch_size=layout.microbatches,
                normalization=plan.loss_normalization, max_seq_len=plan.max_seq_len))
        self.scheduler.step()
        if not math.isfinite(loss):
            kept = (f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                    else "no checkpoint was written")
            raise TrainingDiverged(
                f"the loss is {loss} at step {self.step_count + 1} and there is no loss scaler "
                f"to skip the step, so training stopped; {kept}")
        self.step_count += 1
        self.losses.append(loss)
        return loss, tokens


def _checkpoint_stages(layout: Any, plan: Plan) -> None:
    """The plan's activation checkpointing on each of the rank's modules
    (:func:`~memfit.apply.layout.checkpoint_layout_modules`: a stage keeps the model's own
    block names, so memfit's checkpointing finds its blocks as it finds the whole model's),
    and with ``parallel.partition_activations`` ZeRO-R's partitioned checkpoints over the
    tensor-parallel group."""
    from ..apply.layout import checkpoint_layout_modules

    tp = layout.mesh["tp"] if plan.parallel.partition_activations else None
    checkpoint_layout_modules(layout.modules, plan.checkpointing, plan.parallel, tp)


def _autocast(plan: Plan, device: torch.device) -> Any:
    """The plan's autocast, around the whole schedule (its forwards and backwards interleave;
    torch's own pipelined training does the same): bf16-mixed, else a no-op."""
    if plan.precision.mode == "bf16-mixed":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return _nothing


class _nothing:
    """A context that does nothing (fp32's autocast)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Progress:
    """The run's progress on rank 0: a rich bar on a terminal, plain lines (step, loss,
    elapsed) in a log (:class:`~memfit.train.callbacks.progress.TrainProgress`)."""

    def __init__(self, total: int, console: Any, *, start: int = 0) -> None:
        from .callbacks.progress import TrainProgress

        self._step = start
        self._progress = TrainProgress(total, console=console, start=start).__enter__()

    def advance(self, loss: float) -> None:
        self._step += 1
        self._progress.update(self._step, loss, None, None, None)

    def say(self, message: str) -> None:
        """A line above the bar or among the lines (an evaluation's loss)."""
        self._progress.print(message)

    def close(self) -> None:
        self._progress.__exit__(None, None, None)
