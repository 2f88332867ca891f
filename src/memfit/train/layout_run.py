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
  TrackWindow` picks (the first two, then every ``track_every``-th), each rank its own peak;
* ``bf16-mixed``: the whole schedule (its forwards and backwards interleave) under autocast.

What this path does not do is refused before launch by :func:`check_layout_run`, one sentence
each: checkpoints and resume, evaluation, a virtual cap, and plan techniques the layout does
not apply (activation checkpointing, fp16 or bf16-pure precision, offload, compile, ...).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

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


class LayoutRunError(ValueError):
    """A run setting or plan technique the tensor/pipeline path does not do."""


def is_layout_plan(plan: Plan | None) -> bool:
    """Whether ``plan`` splits the model by tensor or pipeline (so trains through a layout)."""
    return plan is not None and plan.parallel.splits_model


def check_layout_run(config: TrainConfig, plan: Plan) -> None:
    """Refuse, before any process starts, what the tensor/pipeline path does not do.

    Raises:
        LayoutRunError: naming each setting, one sentence each, and what to use instead.
    """
    par = plan.parallel
    what = f"a tensor {par.tensor} x pipeline {par.pipeline} x context {par.context} plan"
    problems = []
    if config.checkpoint_dir is not None or config.resume or config.checkpoint_every is not None:
        problems.append(
            f"{what} trains without checkpoints (--checkpoint-dir, --save-every and --resume "
            "are for data-parallel and single-process plans); leave them out")
    if config.cap is not None:
        problems.append(
            f"{what} has no out-of-memory step-down, so --cap is not applied; leave it out and "
            "compare the per-process peaks with the budget")
    if config.eval_every is not None:
        problems.append(f"{what} does not evaluate during training; leave eval_every unset")
    if not optim_registry.get(plan.optimizer.name).layout:
        problems.append(
            f"{what} builds torch's {', '.join(layout_optimizers())} over the ranks' shards, not "
            f"optimizer {plan.optimizer.name!r}; use one of those")
    ignored = _ignored_techniques(plan)
    if ignored:
        problems.append(
            f"{what} trains with the layout, the plan's precision (fp32 or bf16-mixed) and its "
            f"checkpointing (full or selective) alone "
            f"and would ignore the plan's "
            f"{', '.join(ignored)}; remove {'it' if len(ignored) == 1 else 'them'} from the plan")
    if problems:
        raise LayoutRunError("; ".join(problems))
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
    prediction runs in a fake one. ``None`` for bf16-mixed and checkpointing too: predict_layout
    models fp32 without them."""
    if plan.precision.mode != "fp32" or plan.checkpointing.mode != "none":
        return None
    try:
        from ..estimate.layout import predict_layout

        w = run.workload
        with torch.device("meta"):  # only its class and config are used
            model = w.build_model()
        prediction = predict_layout(model, plan.parallel, batch_size=w.batch_size,
                                    seq_len=w.seq_len, optimizer=plan.optimizer,
                                    foreach=plan.optimizer.foreach)
        return [int(p) for p in prediction.peak_bytes]
    except Exception:  # a figure for the report only: the run does not depend on it
        return None


@dataclass
class LayoutRunResult:
    """What a tensor/pipeline run did, as every rank knows it.

    Attributes:
        first_loss: The first step's loss (mean over the whole global batch).
        final_loss: The last step's.
        losses: Every step's.
        steps: Steps run.
        peak_bytes: This rank's measured peak (memfit's tracker, over the tracked steps).
        per_rank_peak_bytes: Every rank's, in rank order.
        coords: This rank's place in the mesh (``pp``, ``dp``, ``tp``).
        tokens: Tokens trained on (the global batches').
        seconds: Wall time of the steps.
        plan: The plan, as plain data.
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

    @property
    def tokens_per_second(self) -> float:
        """Training throughput over the whole world."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the data-parallel run's keys where they mean the same)."""
        return {
            "first_loss": self.first_loss,
            "final_loss": self.final_loss,
            "steps": self.steps,
            "peak_bytes": max(self.per_rank_peak_bytes),
            "per_rank_peak_bytes": list(self.per_rank_peak_bytes),
            "losses": list(self.losses),
            "plan": self.plan,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
        }


def _device() -> torch.device:
    from ..device import cuda_available

    if cuda_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def train_layout(
    run: TrainRun, plan: Plan, *, console: Any = None, progress: bool = True
) -> LayoutRunResult:
    """Train ``run`` under ``plan``'s tensor x pipeline x data layout in this process, one of
    the ``plan.parallel.world_size`` processes of the open process group (each calls this).

    Args:
        run: The run, as :func:`~memfit.train.run.prepare_run` builds it for one process
            (``world_size=1``: the plan's own degrees are used, not widened).
        plan: The plan (checked by :func:`check_layout_run`).
        console: A rich console for the progress bar (default: stderr).
        progress: Show the progress bar (rank 0 only).

    Returns:
        The :class:`LayoutRunResult`, with every rank's peak (gathered: a collective).

    Raises:
        LayoutError: when the layout cannot work for this model or batch.
        TrainingDiverged: when the loss becomes NaN or infinite.
    """
    import torch.distributed as dist

    from ..accounting import track
    from ..apply.stepper import run_step
    from ..distributed.data import batches_are_local
    from ..distributed.layout import LayoutStepper, build_layout
    from .callbacks.memory import TrackWindow
    from .data import BatchStream
    from .schedule import build_scheduler
    from .streams import count_tokens
    from .trainer import TrainingDiverged

    cfg, par = run.config, plan.parallel
    device = _device()
    batch_size = run.workload.batch_size
    # The same seeded model on every rank, built as the Trainer builds it.
    torch.manual_seed(cfg.seed)
    # Saved weights load in fp32: a layout's precisions (fp32, bf16-mixed) keep fp32 weights.
    model, _ = run.workload.build(seed=cfg.seed, pretrained=True)
    layout = build_layout(model, par, device=device, batch_size=batch_size)
    del model  # a rank keeps only its stages' modules
    _checkpoint_stages(layout.modules, plan)
    opt_cfg = plan.optimizer
    if cfg.lr is not None:  # the run's learning rate, as the Trainer applies it
        opt_cfg = dataclasses.replace(opt_cfg, lr=float(cfg.lr))
    optimizer = opt_cfg.build(layout.parameters())
    scheduler = build_scheduler(optimizer, cfg.schedule, warmup_steps=cfg.warmup_steps,
                                max_steps=cfg.max_steps)
    stream = BatchStream(run.train, batch_size, collate_fn=run.collate, seed=cfg.seed,
                         group_by_length=plan.sequence.group_by_length)
    window = TrackWindow(cfg.track_every)
    autocast = _autocast(plan, device)
    stepper = LayoutStepper(layout, optimizer, device)
    losses: list[float] = []
    peak, tokens = 0, 0
    bar = _Progress(cfg.max_steps, console) if progress else None
    t0 = time.perf_counter()
    try:
        for step in range(cfg.max_steps):
            _, batch = stream.next_batch()
            tokens += count_tokens(batch)
            # The replica's share, on the device before the tracker starts (it is an input).
            share = stepper.local_batch(batch)
            tracked = window.records(step)
            with (track(optimizer=optimizer, device=device) if tracked else _nothing()) as tracker:
                if tracker is not None:
                    tracker.label(layout.parameters(), "parameters")
                    tracker.add_inputs((share["input_ids"], share["labels"]))
                # The one loop: the layout's schedule runs the forwards and backwards (it
                # splits the micro-batches), then the optimizer steps and drops the gradients.
                with batches_are_local():
                    loss = float(run_step(
                        layout.modules[0], share, stepper=stepper, autocast=autocast,
                        loss_fn=None, micro_batch_size=layout.microbatches,
                        normalization=plan.loss_normalization, max_seq_len=plan.max_seq_len))
            if tracker is not None:
                peak = max(peak, int(tracker.report().peak_bytes))
            window.step_done()
            scheduler.step()
            if not math.isfinite(loss):
                raise TrainingDiverged(
                    f"the loss is {loss} at step {step + 1} and there is no loss scaler to skip "
                    "the step, so training stopped; no checkpoint was written")
            losses.append(loss)
            if bar is not None:
                bar.advance(loss)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return LayoutRunResult(
        first_loss=losses[0], final_loss=losses[-1], losses=losses, steps=len(losses),
        peak_bytes=peak, per_rank_peak_bytes=[int(p) for p in peaks],
        coords=dict(layout.coords), tokens=tokens, seconds=seconds, plan=plan.to_dict(),
    )


def _checkpoint_stages(modules: list[torch.nn.Module], plan: Plan) -> None:
    """The plan's activation checkpointing on each of the rank's modules. A stage keeps the
    model's own block names, so memfit's checkpointing finds its blocks as it finds the whole
    model's (a block recomputes its forward in backward)."""
    if plan.checkpointing.mode == "none":
        return
    from ..strategies.checkpointing import apply_checkpointing

    for module in modules:
        blocks = tuple(getattr(module, "block_names", ())) or plan.checkpointing.blocks
        apply_checkpointing(module, dataclasses.replace(plan.checkpointing, blocks=blocks))


def _autocast(plan: Plan, device: torch.device) -> Any:
    """The plan's autocast, around the whole schedule (its forwards and backwards interleave;
    torch's own pipelined training does the same): bf16-mixed, else a no-op."""
    if plan.precision.mode == "bf16-mixed":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return _nothing


class _nothing:
    """A context that yields ``None`` (an untracked step)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Progress:
    """A rich progress bar over the steps, with the last loss."""

    def __init__(self, total: int, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("loss {task.fields[loss]}"), console=console,
                             transient=True)
        self._task = self._bar.add_task("train", total=total, loss="-")
        self._bar.start()

    def advance(self, loss: float) -> None:
        self._bar.update(self._task, advance=1, loss=f"{loss:.4f}")

    def close(self) -> None:
        self._bar.stop()
