"""The terminal: the consoles every command prints to, and how a command fails.

A floor below the commands (``cli.py`` and the per-command modules such as
``train/command.py``), so that they share these without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

__all__ = ["check_outputs", "err", "fail", "out", "quiet_libraries"]

#: Results go to standard output; progress and errors to standard error.
out = Console()
err = Console(stderr=True)


def quiet_libraries() -> None:
    """Keep the terminal for memfit: transformers chats about configs with random weights."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one sentence on standard error and exit with ``code`` (2: bad input)."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def check_outputs(**paths: Path | None) -> None:
    """Fail at once (one sentence, exit 2) when an output file cannot be written, rather than
    after the work: ``check_outputs(json=path)`` names ``--json``. A missing parent folder is
    fine when it can be created."""
    for name, path in paths.items():
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        if path.is_dir():
            fail(f"{flag} {str(path)!r} is a folder; give a file path")
        ancestor = path.parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            fail(f"{flag} {str(path)!r} cannot be written: {str(ancestor)!r} is not a folder")
        if not os.access(ancestor, os.W_OK):
            fail(f"{flag} {str(path)!r} cannot be written: {str(ancestor)!r} is not writable")
