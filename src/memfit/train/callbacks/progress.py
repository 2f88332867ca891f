"""The progress bar: step, loss, tokens/s, live and peak memory, ETA; and the final memory table."""

from __future__ import annotations

import time
from typing import Any

from ..result import TrainResult
from .base import Callback, StepInfo, TrainerLike

__all__ = ["ProgressCallback", "TrainProgress"]


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
        from ...units import format_bytes

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


class ProgressCallback(Callback):
    """Shows a :class:`TrainProgress` bar during the run and the memory report's table after it.

    Args:
        enabled: ``False``: nothing is shown (messages go to the ``memfit.train`` logger).
        console: The rich console (default: stderr).
    """

    def __init__(self, *, enabled: bool = True, console: Any = None) -> None:
        self.enabled = enabled
        self.console = console
        self.bar: TrainProgress | None = None
        self._tokens = 0
        self._t0 = 0.0

    def on_fit_start(self, trainer: TrainerLike) -> None:
        self.bar = TrainProgress(
            trainer.max_steps, console=self.console, enabled=self.enabled, start=trainer.step_count
        ).__enter__()
        self._tokens, self._t0 = 0, time.perf_counter()

    def on_step_end(self, trainer: TrainerLike, info: StepInfo) -> None:
        if self.bar is None or not self.enabled:
            return
        self._tokens += info.tokens
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        memory = trainer.memory
        self.bar.update(
            info.step, info.loss, self._tokens / elapsed, memory.live_bytes, memory.peak_bytes
        )

    def print(self, message: str) -> bool:
        """Print ``message`` above the bar; ``False`` when nothing is shown."""
        if self.bar is None or not self.enabled:
            return False
        self.bar.print(message)
        return True

    def on_fit_end(self, trainer: TrainerLike, result: TrainResult | None) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None
        if result is not None and self.enabled:
            from rich.console import Console

            (self.console or Console(stderr=True)).print(result.report.table())
