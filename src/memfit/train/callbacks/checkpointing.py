"""Checkpoints of a trainer: save every N steps and after the last, load to resume.

A checkpoint (:mod:`memfit.train.checkpoint`) holds the weights, the optimizer and schedule,
the RNG, and the trainer's own state: the plan in force (a step-down is kept across a resume),
the data position (with each data file's SHA-256, so that a file changed between save and
resume is named rather than silently trained on), the loss history and the loss scaler.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ...plan import Plan
from ..checkpoint import load_checkpoint, read_state, save_checkpoint
from ..manifest import CheckpointError, file_sha256
from .base import Callback, StepInfo, TrainerLike, due

__all__ = ["CheckpointCallback", "check_data", "data_fingerprint", "load_trainer", "save_trainer"]


def save_trainer(trainer: TrainerLike, folder: str | Path, *, keep: int = 3) -> Path:
    """Write a checkpoint of ``trainer``'s state to ``folder``; keep the newest ``keep``."""
    scaler = getattr(trainer.setup.precision, "scaler", None)
    return save_checkpoint(
        folder,
        trainer.step_count,
        trainer.model,
        trainer.optimizer,
        scheduler=trainer.scheduler,
        keep=keep,
        state={
            "plan": trainer.plan.to_dict(),
            "data": trainer.stream.state_dict(),
            "losses": list(trainer.losses),
            "eval_losses": list(trainer.eval_losses),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "data_files": data_fingerprint(trainer),
        },
    )


def data_fingerprint(trainer: object) -> dict[str, str]:
    """SHA-256 of each of the run's data files (``trainer.config.data``), hashed once per run
    (cached on ``trainer``): what a resume checks so that the data position means the same
    samples. ``trainer`` is anything with a ``config`` (the tensor/pipeline run's loop too)."""
    cached = getattr(trainer, "_data_fingerprint", None)
    if cached is None:
        files = getattr(getattr(trainer, "config", None), "data", None) or ()
        cached = {str(Path(f).resolve()): file_sha256(f) for f in files if Path(f).is_file()}
        trainer._data_fingerprint = cached  # type: ignore[attr-defined]
    return dict(cached)


def check_data(trainer: object, saved: dict[str, str] | None) -> None:
    """Refuse to resume on data files other than the checkpoint's (``saved``: its
    :func:`data_fingerprint`).

    Raises:
        CheckpointError: naming the file that is gone or changed.
    """
    if not saved:
        return
    now = data_fingerprint(trainer)
    for name, digest in saved.items():
        if name not in now:
            raise CheckpointError(
                f"data file {name!r} of the checkpointed run is not part of this run (or is "
                "gone); resume with the same data or start a new run"
            )
        if now[name] != digest:
            raise CheckpointError(
                f"data file {name!r} changed since the checkpoint was saved; resume with the "
                "same data or start a new run"
            )


def load_trainer(trainer: TrainerLike, path: str | Path) -> None:
    """Continue ``trainer`` from a checkpoint: its plan first (a run that had stepped down goes
    on with the plan that fitted), then weights, optimizer, schedule, RNG, data position."""
    state = read_state(path)
    check_data(trainer, state.get("data_files"))
    saved_world = int(state.get("world_size", 1))
    world = trainer.plan.parallel.data
    if saved_world != world:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was written by {saved_world} process(es) and this run "
            f"has {world}; resume with --nproc-per-node {saved_world}"
        )
    saved_plan = Plan.from_dict(state["plan"])
    if saved_plan != trainer.plan:
        trainer.switch_plan(saved_plan)
    state = load_checkpoint(
        path, trainer.model, trainer.optimizer, scheduler=trainer.scheduler, state=state
    )
    trainer.stream.load_state_dict(state.get("data") or {})
    scaler = getattr(trainer.setup.precision, "scaler", None)
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    trainer.step_count = int(state["step"])
    trainer.losses = list(state.get("losses", []))
    trainer.eval_losses = [tuple(e) for e in state.get("eval_losses", [])]


class CheckpointCallback(Callback):
    """Saves a checkpoint every ``every`` steps and after the last one.

    Args:
        folder: Where checkpoints go (``None``: this callback does nothing).
        every: Steps between checkpoints; ``None``: only after the last step.
        keep: Checkpoints kept; older ones are deleted.
        phases: The trainer's :class:`~memfit.train.phases.PhaseRecorder`: the first save is the
            job's ``save`` phase.

    Attributes:
        last: The path of the last checkpoint written, if any.
    """

    def __init__(
        self, folder: str | Path | None, *, every: int | None, keep: int = 3, phases: Any = None
    ) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.every, self.keep, self.phases = every, keep, phases
        self.last: str | None = None

    def on_step_end(self, trainer: TrainerLike, info: StepInfo) -> None:
        if self.folder is None or not due(info.step, trainer.max_steps, self.every):
            return
        phase = (
            self.phases.phase("save", trainer.model, trainer.optimizer)
            if self.phases is not None
            else contextlib.nullcontext()
        )
        with phase:
            self.last = str(save_trainer(trainer, self.folder, keep=self.keep))
