"""The terminal: the consoles every command prints to, and how a command fails.

A floor below the commands (``cli.py`` and the per-command modules such as
``train/command.py``), so that they share these without importing each other.
"""

from __future__ import annotations

import os
from typing import NoReturn

import typer
from rich.console import Console

__all__ = ["err", "fail", "out", "quiet_libraries"]

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
