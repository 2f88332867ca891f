"""What a training run gives back: :class:`TrainResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..accounting import MemoryReport

__all__ = ["TrainResult"]


@dataclass
class TrainResult:
    """The outcome of :meth:`Trainer.fit`.

    Attributes:
        first_loss: Loss of the first step of the whole run (also when resumed).
        final_loss: Loss of the last step.
        steps: Optimizer steps done in all.
        peak_bytes: Peak device memory measured by :func:`memfit.track` over this ``fit``'s
            tracked steps (every step with a cap).
        losses: Every step's loss.
        eval_losses: ``(step, loss)`` of each evaluation.
        report: The :class:`~memfit.accounting.MemoryReport` of the tracked step with the
            highest peak (``report.plot(path)`` draws it).
        plan: The plan in force at the end (after step-downs), as a dict.
        step_downs: The step-downs taken after out-of-memory errors (dicts).
        tokens: Input tokens trained on in this ``fit``.
        seconds: Wall time of this ``fit``'s loop.
        checkpoint: The last checkpoint written, if any.
        params_sha256: SHA-256 over the final parameters in ``named_parameters()`` order,
            each tensor's bytes (equal for two runs whose weights are equal bit for bit).
        stopped_by: ``"SIGTERM"`` or ``"SIGINT"`` when a signal ended the run early (after a
            checkpoint, when there is a checkpoint folder), else ``None``.
        eval_batches: ``(step, batches)`` of each evaluation this ``fit`` ran: the batches it
            evaluated (at most ``eval_max_batches``); an evaluation a signal cut short has
            fewer, and no entry in ``eval_losses``.
        resumed_from: The checkpoint this ``fit`` continued from, if it resumed.
        steps_run: Optimizer steps this ``fit`` ran (``steps`` less a resumed run's start).
        phases: The job's phases this trainer measured, each the first time it happened
            (a :class:`~memfit.train.phases.JobPhases`: ``load``, ``first_step``,
            ``steady_step``, ``eval``, ``save`` in a fresh run; ``load_checkpoint`` and
            ``resume`` in a resumed one), to compare with :func:`~memfit.train.job.predict_job`.
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
    params_sha256: str = ""
    stopped_by: str | None = None
    phases: Any = None
    resumed_from: str | None = None
    steps_run: int | None = None
    eval_batches: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.steps_run is None:
            self.steps_run = self.steps

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
            "steps_run": self.steps_run,
            "resumed_from": self.resumed_from,
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
            "params_sha256": self.params_sha256,
            "stopped_by": self.stopped_by,
            "eval_batches": [list(e) for e in self.eval_batches],
            "phases": self.phases.to_dict() if self.phases is not None else None,
        }
