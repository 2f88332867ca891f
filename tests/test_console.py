"""The consoles' rules: a table laid out for the width it gets (key/value lines when it does
not fit, never one word per line), ``--quiet`` and ``--verbose``, third-party noise off."""

from __future__ import annotations

import io
import logging

import pytest
import typer
from rich.console import Console, Group
from rich.table import Table

from memfit import console as console_module
from memfit.console import SETTINGS, configure, fit_width, quiet_libraries, show

LONG = "micro-batch 4 x 2, checkpointing selective, bf16-mixed (foreach off), fused step"


def _table() -> Table:
    table = Table(title="Candidates weighed against a budget of 12.00 MiB (cost model: cpu)")
    for name in ("plan", "time", "peak", "params", "grads", "state", "acts", "other", "fits"):
        table.add_column(name, justify="right")
    table.add_row("★ " + LONG, "1.11x", "11.43 MiB", "705.00 KiB", "250.00 KiB", "500.00 KiB",
                  "6.08 MiB", "3.92 MiB", "yes", style="bold green")
    table.add_row("adamw", "0.68x", "31.20 MiB", "705.00 KiB", "0 B", "500.00 KiB", "22.20 MiB",
                  "7.83 MiB", "no")
    return table


def _render(renderable, width: int) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, width=width)  # a file, as when piped
    console.print(fit_width(renderable, console))
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("width", [40, 60, 80, 100])
def test_a_table_too_wide_becomes_key_value_lines(width):
    lines = _render(Group(_table(), "a note"), width)
    text = "\n".join(lines)
    assert all(len(line) <= width for line in lines), text
    assert "…" not in text  # no cell cut
    # Every row's first cell whole on its line, every header beside its whole value.
    assert f"★ {LONG}" in " ".join(text.split())
    for pair in ("peak 11.43 MiB", "grads 250.00 KiB", "fits yes", "peak 31.20 MiB"):
        assert pair in text, text
    assert lines[-1] == "a note"
    # Never one word per line: every line of pairs holds a header and its value at least.
    assert all(len(line.split()) >= 2 for line in lines if line.startswith("    "))


def test_a_table_that_fits_stays_a_table():
    lines = _render(_table(), 200)
    assert lines[1].startswith("┏") and any(LONG in line for line in lines)


def test_show_prints_nothing_under_quiet(monkeypatch):
    monkeypatch.setattr(SETTINGS, "quiet", True)
    buf = io.StringIO()
    show(_table(), Console(file=buf))
    assert buf.getvalue() == ""


def test_quiet_and_verbose_together_is_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(SETTINGS, "quiet", False)
    monkeypatch.setattr(SETTINGS, "verbose", False)
    with pytest.raises(typer.Exit) as e:
        configure(quiet=True, verbose=True)
    assert e.value.exit_code == 2


def test_third_party_loggers_are_quiet_unless_verbose(monkeypatch):
    for name in ("torchao", "torch.utils._pytree"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    monkeypatch.setattr(SETTINGS, "verbose", True)
    quiet_libraries()
    assert logging.getLogger("torchao").getEffectiveLevel() < logging.ERROR
    monkeypatch.setattr(SETTINGS, "verbose", False)
    quiet_libraries()
    for name in ("torchao", "torch.utils._pytree"):
        assert logging.getLogger(name).getEffectiveLevel() >= logging.ERROR


def test_fail_prints_brackets_as_written(capsys):
    with pytest.raises(typer.Exit):
        console_module.fail("pip install 'memfit[peft]'")
    assert "memfit[peft]" in capsys.readouterr().err
