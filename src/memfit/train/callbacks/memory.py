"""The run's memory report, tracked in windows so that host memory stays bounded.

A tracker records every operation while it is open (its storages, births and deaths): kept open
for a whole run, it grows by about a megabyte a step on a small GPT. So the trainer tracks a
window of steps: the first two, every ``every``-th, and the steps after a step-down, each by a
fresh tracker that is dropped when its step ends. What is kept between windows is bounded: the
report of the tracked step with the highest peak, the running peak and the last live figure.
Steps outside a window run with no dispatch mode at all (no overhead) unless a virtual ``cap``
is set: the cap needs a tracker on every step, but only windowed steps build a report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...accounting import MemoryReport, track
from ...workload import Batch
from ..result import TrainResult
from .base import Callback, TrainerLike

__all__ = ["MemoryReportCallback", "TrackWindow"]


class TrackWindow:
    """Which steps of a run are tracked: the first ``first``, every ``every``-th, and
    ``after_step_down`` steps after a step-down (counting the step that stepped down).

    Args:
        every: Track every N-th step (1-based: with 100, the 100th, 200th, ...).
        first: Steps tracked at the start.
        after_step_down: Steps tracked from a step-down on (the redone step and those after).
    """

    def __init__(self, every: int, *, first: int = 2, after_step_down: int = 3) -> None:
        self.every, self.first, self.after = every, first, after_step_down
        self._extra = 0  # steps still to track after a step-down

    def records(self, step: int) -> bool:
        """Whether the ``step``-th step of this run (from 0) is tracked."""
        return step < self.first or (step + 1) % self.every == 0 or self._extra > 0

    def stepped_down(self) -> None:
        """A step-down happened in the step in flight: track the next steps too (they run
        under the plan stepped down to)."""
        self._extra = self.after

    def step_done(self) -> None:
        """The step in flight ended."""
        self._extra = max(0, self._extra - 1)


class MemoryReportCallback(Callback):
    """Tracks windowed steps with :func:`memfit.track` and keeps the run's memory report.

    Args:
        every: Track every N-th step besides the first two and those after a step-down.
        cap: Virtual memory cap in bytes (every step then runs under a tracker, which raises
            ``torch.OutOfMemoryError`` beyond it; the OOM fallback steps down).
        report_png: Write the report's plot here at the end.
        phases: The trainer's :class:`~memfit.train.phases.PhaseRecorder`, handed each tracked
            step (its first, steady and resumed steps are phases of the job).

    Attributes:
        report: The report of the tracked step with the highest peak (``None`` before one).
        peak_bytes: The highest peak of any tracked step (every step with a ``cap``).
        live_bytes: Live bytes at the end of the last tracked step.
        tracked_steps: Steps whose report was built.
    """

    def __init__(
        self, *, every: int, cap: int | None = None, report_png: str | Path | None = None,
        phases: Any = None,
    ) -> None:
        self.window = TrackWindow(every)
        self.phases = phases
        self.cap, self.report_png = cap, report_png
        self.report: MemoryReport | None = None
        self.peak_bytes = self.live_bytes = self.tracked_steps = 0
        self._start = 0

    def on_fit_start(self, trainer: TrainerLike) -> None:
        self._start = trainer.step_count

    def step_context(self, trainer: TrainerLike, batch: Batch) -> contextlib.AbstractContextManager[Any]:
        return self._tracked(trainer, batch)

    @contextlib.contextmanager
    def _tracked(self, trainer: TrainerLike, batch: Batch) -> Iterator[None]:
        record = self.window.records(trainer.step_count - self._start)
        if not record and self.cap is None:
            yield  # no tracker, no dispatch mode: the step runs at full speed
            self.window.step_done()
            return
        steps_before = trainer.step_count
        tracker = track(trainer.model, trainer.optimizer, cap=self.cap)
        with tracker:
            tracker.add_inputs(batch)
            yield
        self.window.step_done()
        if self.phases is not None and record:
            self.phases.step_tracked(steps_before, tracker)
        self.peak_bytes = max(self.peak_bytes, tracker.peak_bytes)
        self.live_bytes = tracker.live_bytes
        if record:
            self.tracked_steps += 1
            report = tracker.report()
            if self.report is None or report.peak_bytes >= self.report.peak_bytes:
                self.report = report

    def on_plan_switch(self, trainer: TrainerLike, rebuilt: bool) -> None:
        self.window.stepped_down()

    def finish(self, trainer: TrainerLike) -> MemoryReport:
        """The run's report, with the run's figures in its ``meta``.

        Raises:
            ValueError: when no step was run (a resumed run already at ``max_steps``).
        """
        if self.report is None:
            raise ValueError("no step was run: max_steps is already reached by the checkpoint")
        self.report.meta.update(
            tracked_steps=self.tracked_steps,
            run_peak_bytes=self.peak_bytes,
            steps=trainer.step_count,
            batch_size=trainer.batch_size,
            plan=trainer.plan.to_dict(),
            losses=list(trainer.losses),
            num_parameters=sum(p.numel() for p in trainer.model.parameters()),
        )
        return self.report

    def on_fit_end(self, trainer: TrainerLike, result: TrainResult | None) -> None:
        if result is not None and self.report_png is not None:
            result.report.plot(self.report_png, title=f"memfit train: {trainer.step_count} steps")
