"""The terminal: the consoles every command prints to, and how a command fails.

A floor below the commands (``cli.py`` and the per-command modules in ``memfit/commands/``),
so that they share these without importing each other.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

__all__ = [
    "check_outputs",
    "err",
    "exit_without_teardown",
    "fail",
    "out",
    "quiet_libraries",
    "writes_guarded",
]

#: Results go to standard output; progress and errors to standard error.
out = Console()
err = Console(stderr=True)


def quiet_libraries() -> None:
    """Keep the terminal for memfit: transformers chats about configs with random weights."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


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
    """Print one sentence on standard error and exit with ``code`` (2: bad input)."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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
