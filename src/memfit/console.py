"""The terminal: the consoles every command prints to, and how a command fails.

A floor below the commands (``cli.py`` and the per-command modules in ``memfit/commands/``),
so that they share these without importing each other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

__all__ = [
    "SETTINGS",
    "check_outputs",
    "configure",
    "err",
    "exit_without_teardown",
    "fail",
    "fit_width",
    "out",
    "quiet_libraries",
    "show",
    "status",
    "writes_guarded",
]

#: Results go to standard output; progress and errors to standard error.
out = Console()
err = Console(stderr=True)


@dataclass
class OutputSettings:
    """What the command's ``--quiet`` and ``--verbose`` asked for."""

    quiet: bool = False
    """Results only: no progress (bars, status lines, progress lines) and no tables; errors
    still print."""
    verbose: bool = False
    """Third-party libraries' own warnings and logs are shown (silenced by default)."""


#: This process's settings (one command runs per process); :func:`configure` sets them.
SETTINGS = OutputSettings()

#: Loggers whose warnings are not memfit's to show: torchao's optional kernels that do not load
#: on this machine ("Failed to load ... _C_mxfp8 ... .so"), torch's pytree deprecation notes
#: (torchao registers enums the old way), transformers' chatter about random weights.
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "transformers", "datasets", "peft")


def configure(*, quiet: bool = False, verbose: bool = False) -> None:
    """Apply a command's ``--quiet`` and ``--verbose``, then :func:`quiet_libraries` (unless
    verbose). Fails (exit 2) when both are given."""
    if quiet and verbose:
        fail("--quiet and --verbose ask for opposite things; give one of them")
    SETTINGS.quiet, SETTINGS.verbose = quiet, verbose
    quiet_libraries()


def quiet_libraries() -> None:
    """Keep the terminal for memfit: third-party import noise (torchao's optional kernels,
    torch's deprecation logs, transformers' notes on configs with random weights) is silenced,
    unless ``--verbose`` was given (:func:`configure`)."""
    if SETTINGS.verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        # Only raised: a library (or the user) that asked for less keeps it.
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))


@contextlib.contextmanager
def status(message: str) -> Iterator[Any]:
    """A transient status line on standard error (rich's), or a stand-in that shows nothing
    under ``--quiet``; either way ``.update(text)`` changes what it says."""
    if SETTINGS.quiet:
        yield _Silent()
        return
    with err.status(message) as line:
        yield line


class _Silent:
    """A status line that shows nothing."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None

    def stop(self) -> None:
        return None


def show(renderable: Any, console: Console | None = None) -> None:
    """Print ``renderable`` (a table, a group of them with notes) laid out for the width the
    console has (:func:`fit_width`): a table wider than that comes as key/value lines, never
    one word per line. Nothing under ``--quiet``: tables explain, the result lines say."""
    if SETTINGS.quiet:
        return
    console = console or out
    console.print(fit_width(renderable, console))


def fit_width(renderable: Any, console: Console) -> Any:
    """``renderable`` for ``console``'s width: each table that fits stays a table; one that
    would need more than the width becomes key/value lines (:func:`_records`). Groups are
    looked into; anything else is returned as it is."""
    from rich.console import Group
    from rich.measure import Measurement
    from rich.table import Table

    if isinstance(renderable, Group):
        return Group(*(fit_width(r, console) for r in renderable.renderables))
    if not isinstance(renderable, Table):
        return renderable
    # Measured without the console's width (which would clamp it): the width it wants.
    wide = console.options.update_width(1 << 20)
    if Measurement.get(console, wide, renderable).maximum <= console.width:
        return renderable
    return _records(renderable, console.width)


def _records(table: Any, width: int) -> Any:
    """A table as lines: its title, then per row its first cell on a line of its own and the
    other columns as ``header value`` pairs after it, indented, as many to a line as
    ``width`` holds (a pair is never split)."""
    from rich.console import Group
    from rich.text import Text

    columns = table.columns
    cells = [list(c.cells) for c in columns]
    lines: list[Any] = []
    if table.title:
        lines.append(Text.from_markup(table.title) if isinstance(table.title, str) else table.title)
    for i, row in enumerate(table.rows):
        style = row.style or ""
        first = cells[0][i] if columns else ""
        lines.append(_text(first, style))
        pairs = [
            f"{_plain(columns[j].header)} {_plain(cells[j][i])}"
            for j in range(1, len(columns))
            if _plain(cells[j][i])
        ]
        lines += [Text(line, style=style) for line in _pack(pairs, width, "    ", ";  ")]
    for text in (table.caption,):
        if text:
            lines.append(_text(text, ""))
    return Group(*lines)


def _pack(items: list[str], width: int, indent: str, sep: str) -> list[str]:
    """``items`` joined by ``sep`` into lines of at most ``width`` characters, each starting
    with ``indent`` (an item longer than a line gets a line of its own)."""
    lines: list[str] = []
    line = ""
    for item in items:
        joined = f"{line}{sep}{item}" if line else item
        if line and len(indent) + len(joined) > width:
            lines.append(indent + line)
            line = item
        else:
            line = joined
    if line:
        lines.append(indent + line)
    return lines


def _plain(cell: Any) -> str:
    """A cell's text without markup."""
    from rich.text import Text

    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain if isinstance(cell, str) else str(cell)


def _text(cell: Any, style: Any) -> Any:
    from rich.text import Text

    if isinstance(cell, Text):
        return cell
    return Text.from_markup(str(cell), style=style) if isinstance(cell, str) else Text(str(cell))


#: Set by :func:`exit_without_teardown`; read by :func:`memfit.cli.main`.
_QUICK_EXIT = [False]


def exit_without_teardown() -> None:
    """Ask :func:`memfit.cli.main` to end the process without the interpreter's teardown once
    the command returns (its files written and closed).

    A distributed worker asks it after leaving its process group: objects the run keeps (a
    sharded model's device mesh) still hold the gloo group's threads, and destroying those in
    the interpreter's teardown can abort a finished worker (``terminate called without an
    active exception``, SIGABRT), which the launcher reports as a failed run.
    """
    _QUICK_EXIT[0] = True


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one sentence on standard error and exit with ``code`` (2: bad input). The
    sentence is printed as written (``pip install 'memfit[peft]'`` is not markup)."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def check_outputs(
    files: Mapping[str, Path | None] | None = None,
    folders: Mapping[str, Path | None] | None = None,
    *,
    existing_folders: Mapping[str, Path | None] | None = None,
) -> None:
    """Fail at once (one sentence naming the option and the path, exit 2) when an output
    cannot be written, before the command does any work: ``check_outputs({"--json": path})``.
    The rule is :func:`memfit.outputs.check_outputs`'s (a file's folder must exist; a folder
    output is created with its parents)."""
    from .outputs import OutputError
    from .outputs import check_outputs as check

    try:
        check(files, folders, existing_folders=existing_folders)
    except OutputError as e:
        fail(str(e))


def writes_guarded(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` (a typer command function), ended by one sentence and exit code 2 where a
    write fails deep inside it: :class:`~memfit.outputs.OutputError` from memfit's atomic
    writers, or an :class:`OSError` of a full disk, a quota or a lost permission raised by a
    library's own writer (safetensors, matplotlib) with the file it was writing. The earlier
    file is untouched either way (every output is written atomically)."""
    from .outputs import WRITE_ERRNOS, OutputError, write_failure

    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except OutputError as e:
            fail(str(e))
        except OSError as e:
            if e.errno not in WRITE_ERRNOS or e.filename is None:
                raise
            fail(write_failure(e.filename, e))

    return guarded
