"""The progress bar: step, loss, tokens/s, live and peak memory, ETA; and the final memory table."""

from __future__ import annotations

import datetime
import time
from typing import Any

from ..result import TrainResult
from .base import Callback, StepInfo, TrainerLike

__all__ = ["ProgressCallback", "TrainProgress"]


#: A plain progress line is printed at least this often (seconds) when the output is a file.
LINE_SECONDS = 30.0
#: ... and at least every this many steps when a run has many (``total // LINES_PER_RUN``).
LINES_PER_RUN = 20


class TrainProgress:
    """A rich progress bar on a terminal: step, loss, tokens/s, live and peak memory, ETA; and
    plain progress lines where the output is a file or a CI log, which a bar never reaches.

    A plain line (``step 40/300  loss 2.3104  1,234 tokens/s  mem 12.1 MiB (peak 20.3 MiB)
    elapsed 0:01:02``) is printed after the first step, then at least every
    :data:`LINE_SECONDS` seconds or every ``total // 20`` steps, and after the last step.

    Args:
        total: Steps of the run.
        console: The bar's rich console (default: stderr); a bar only where it is a terminal.
        enabled: ``False`` makes every method a no-op.
        start: Steps already done (a resumed run).
        lines: The console of the plain lines; default: standard output when it is not a
            terminal (``memfit train > log.txt``), else ``console`` when that is not one
            either (no line where a bar or a notebook shows the progress).
        every_steps: Steps between plain lines (default: ``total // 20``, at least 1).
        every_seconds: Seconds after which the next step prints a line anyway.
    """

    def __init__(
        self, total: int, *, console: Any = None, enabled: bool = True, start: int = 0,
        lines: Any = None, every_steps: int | None = None,
        every_seconds: float = LINE_SECONDS,
    ) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._lines: Any = None
        if not enabled:
            return
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.total = total
        self._lines = lines if lines is not None else _line_console(self.console)
        self._every = every_steps or max(total // LINES_PER_RUN, 1)
        self._seconds = every_seconds
        self._t0 = self._last_time = time.monotonic()
        self._last_step = start
        self._printed = False
        if self.console.is_terminal or self.console.is_jupyter:
            self._bar = _bar(self.console, total, start)
            self._task = self._bar.tasks[0].id

    def __enter__(self) -> TrainProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(
        self, step: int, loss: float, tokens_per_s: float | None, live: int | None,
        peak: int | None,
    ) -> None:
        """Show the state after ``step`` steps (``None``: a figure the caller does not have,
        left out)."""
        if not self.enabled:
            return
        from ...units import format_bytes

        mem = "-" if live is None else f"{format_bytes(live)} (peak {format_bytes(peak or live)})"
        speed = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", speed=speed, mem=mem)
        if self._lines is not None and self._line_due(step):
            elapsed = datetime.timedelta(seconds=round(time.monotonic() - self._t0))
            parts = [f"step {step}/{self.total}", f"loss {loss:.4f}"]
            if tokens_per_s is not None:
                parts.append(f"{tokens_per_s:,.0f} tokens/s")
            if live is not None:
                parts.append(f"mem {mem}")
            self._lines.print("  ".join([*parts, f"elapsed {elapsed}"]),
                              highlight=False, soft_wrap=True, markup=False)

    def _line_due(self, step: int) -> bool:
        """Whether the step just done prints a plain line (and if so, count from it)."""
        now = time.monotonic()
        due = (not self._printed or step >= self.total or step - self._last_step >= self._every
               or now - self._last_time >= self._seconds)
        if due:
            self._last_step, self._last_time, self._printed = step, now, True
        return due

    def print(self, message: str) -> None:
        """Print a line above the bar, or among the plain lines."""
        if self._bar is not None:
            self._bar.console.print(message, highlight=False)
        elif self._lines is not None:
            self._lines.print(message, highlight=False, soft_wrap=True)


def _line_console(bar_console: Any) -> Any:
    """Where plain progress lines go by default: standard output when it is a file or a pipe
    (a log), else the bar's console when that is not a terminal either; ``None``: a terminal
    or a notebook shows the bar."""
    import sys

    from rich.console import Console

    stdout = Console(file=sys.stdout)
    if not (stdout.is_terminal or stdout.is_jupyter):
        return stdout
    if not (bar_console.is_terminal or bar_console.is_jupyter):
        return bar_console
    return None


def _bar(console: Any, total: int, start: int) -> Any:
    """The rich progress bar (one task: the run's steps)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("mem {task.fields[mem]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    bar.add_task("train", total=total, completed=start, loss="-", speed="-", mem="-")
    return bar


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

            from ...console import fit_width

            console = self.console or Console(stderr=True)
            console.print(fit_width(result.report.table(), console))
