"""The memory report of a tensor/pipeline run (:mod:`memfit.train.layout_run`), per rank.

Each rank tracks its own steps with memfit's tracker, in the windows the trainer's memory
report uses (:class:`~memfit.train.callbacks.memory.TrackWindow`: the first two steps of the
run, then every ``track_every``-th), and keeps, as the trainer does, the report of the
tracked step with the highest peak, the run's peak and the last live figure: host memory stays
bounded however long the run. A rank's report covers what that rank holds: its stages' (or
shards') parameters, gradients, optimizer state and the activations its schedule keeps.
:func:`rank_plot_path` names each rank's plot beside the one path ``--plot`` gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..accounting import MemoryReport, track
from .callbacks.memory import TrackWindow

__all__ = ["RankMemory", "rank_plot_path"]


def rank_plot_path(path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` draws its memory plot for ``--plot path``: ``mem.png`` becomes
    ``mem-rank0.png``, ``mem-rank1.png``, ... in the same folder."""
    p = Path(path)
    return p.with_name(f"{p.stem}-rank{rank}{p.suffix or '.png'}")


class RankMemory:
    """This rank's memory over a run: windowed tracking and the report of its highest step.

    Args:
        every: Track every N-th step besides the first two (``track_every``).
        start: Steps done before this run (a resumed run's windows count from its start).

    Attributes:
        report: The report of the tracked step with the highest peak (``None`` before one).
        peak_bytes: The highest peak of any tracked step.
        live_bytes: Live bytes at the end of the last tracked step.
        tracked_steps: Steps tracked.
    """

    def __init__(self, every: int, *, start: int = 0) -> None:
        self.window = TrackWindow(every)
        self.start = start
        self.report: MemoryReport | None = None
        self.peak_bytes = self.live_bytes = self.tracked_steps = 0

    @contextlib.contextmanager
    def step(
        self,
        step: int,
        parameters: Sequence[torch.Tensor],
        optimizer: Any,
        device: torch.device,
        inputs: Sequence[torch.Tensor],
    ) -> Iterator[None]:
        """Around step ``step`` (counted from the run's first, 0-based): tracked when its
        window says so, with ``parameters`` labelled as parameters and ``inputs`` as inputs;
        otherwise no tracker at all (no dispatch mode: full speed)."""
        if not self.window.records(step - self.start):
            yield
            self.window.step_done()
            return
        tracker = track(optimizer=optimizer, device=device)
        with tracker:
            tracker.label(parameters, "parameters")
            tracker.add_inputs(tuple(inputs))
            yield
        self.window.step_done()
        report = tracker.report()
        self.tracked_steps += 1
        self.peak_bytes = max(self.peak_bytes, int(report.peak_bytes))
        self.live_bytes = int(tracker.live_bytes)
        if self.report is None or report.peak_bytes >= self.report.peak_bytes:
            self.report = report

    def finish(self, **meta: Any) -> MemoryReport | None:
        """The rank's report with the run's figures (``meta``, the tracked steps and the run's
        peak) in its ``meta``; ``None`` when no step was tracked."""
        if self.report is not None:
            self.report.meta.update(tracked_steps=self.tracked_steps,
                                    run_peak_bytes=self.peak_bytes, **meta)
        return self.report
