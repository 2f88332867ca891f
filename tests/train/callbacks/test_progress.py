"""The training progress: plain lines where the output is a file or a CI log (a bar never
reaches one), at least every 30 s or every ``total // 20`` steps; a bar on a terminal."""

from __future__ import annotations

import io
import itertools

from rich.console import Console

from memfit.train.callbacks import progress as progress_module
from memfit.train.callbacks.progress import TrainProgress


class _Clock:
    """A stand-in for time.monotonic that the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _file_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=80), buf  # a file: not a terminal


def _run(monkeypatch, total: int, seconds_per_step: float, **kwargs) -> list[str]:
    clock = _Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    console, buf = _file_console()
    with TrainProgress(total, console=console, lines=console, **kwargs) as bar:
        for step in range(1, total + 1):
            clock.now += seconds_per_step
            bar.update(step, 2.0 / step, 1234.5, 10 << 20, 20 << 20)
    return buf.getvalue().splitlines()


def test_plain_lines_every_total_over_20_steps_first_and_last(monkeypatch):
    lines = _run(monkeypatch, total=100, seconds_per_step=0.1)
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert steps == [1, *range(6, 100, 5), 100]
    first = lines[0]
    assert first.startswith("step 1/100  loss 2.0000  1,234 tokens/s  mem 10.00 MiB (peak 20.00 MiB)")
    assert "elapsed 0:00:00" in first


def test_a_slow_run_prints_a_line_at_least_every_30_seconds(monkeypatch):
    # 1000 steps would print every 50 steps; at 7 s a step that is 350 s: the clock wins.
    lines = _run(monkeypatch, total=1000, seconds_per_step=7.0)
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert max(gaps) <= 5  # 5 steps = 35 s, the first past 30 s
    assert steps[-1] == 1000


def test_no_lines_and_no_bar_when_disabled(monkeypatch):
    console, buf = _file_console()
    with TrainProgress(10, console=console, lines=console, enabled=False) as bar:
        bar.update(1, 1.0, 1.0, 1, 1)
        bar.print("hello")
    assert buf.getvalue() == ""


def test_a_terminal_gets_the_bar_and_a_log_file_the_lines_at_once():
    # `memfit train > log.txt` at a terminal: the bar on standard error, the lines in the file.
    term = Console(file=io.StringIO(), force_terminal=True, width=100)
    log, buf = _file_console()
    with TrainProgress(4, console=term, lines=log) as bar:
        for step in range(1, 5):
            bar.update(step, 1.0, 10.0, 1, 1)
    assert bar._bar is not None
    assert [line.split()[1] for line in buf.getvalue().splitlines()] == ["1/4", "2/4", "3/4", "4/4"]


def test_messages_go_among_the_lines_when_there_is_no_bar():
    console, buf = _file_console()
    with TrainProgress(4, console=console, lines=console) as bar:
        bar.print("step 2: eval loss 1.2345")
    assert buf.getvalue() == "step 2: eval loss 1.2345\n"


def test_figures_a_caller_lacks_are_left_out():
    console, buf = _file_console()
    with TrainProgress(2, console=console, lines=console) as bar:
        bar.update(1, 0.5, None, None, None)
    assert buf.getvalue().startswith("step 1/2  loss 0.5000  elapsed 0:00:0")


def test_a_layout_runs_progress_writes_lines_to_a_piped_stdout(capsys):
    # Tensor/pipeline runs (memfit.train.layout_run) report through the same progress: with
    # standard output a pipe (pytest's capture), plain lines there.
    from memfit.train.layout_run import _Progress

    console, buf = _file_console()
    bar = _Progress(3, console)
    for loss in (3.0, 2.0, 1.0):
        bar.advance(loss)
    bar.say("step 3: eval loss 0.9000")
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[:2] for line in lines[:3]] == [
        ["step 1/3", "loss 3.0000"], ["step 2/3", "loss 2.0000"], ["step 3/3", "loss 1.0000"]]
    assert lines[3:] == ["step 3: eval loss 0.9000"]
    assert buf.getvalue() == ""  # no bar where standard error is not a terminal either
