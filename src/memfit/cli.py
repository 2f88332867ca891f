"""The ``memfit`` command line: the typer app, wired to the commands in :mod:`memfit.commands`.

Each command's options and body live in its own module there (a thin layer over the Python
API); this module only names them, and :func:`main` runs the app.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import typer

from .commands.bench import bench_ladder
from .commands.plan import plan_command
from .commands.profile import profile
from .commands.train import TrainCommand, train
from .console import _QUICK_EXIT, err, fail, writes_guarded
from .extras import MissingExtra

__all__ = ["app", "bench_app", "main"]

app = typer.Typer(
    name="memfit",
    help="Make PyTorch training fit in a memory budget: measure, plan, train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks that reproduce memfit's published tables.", no_args_is_help=True
)


def _guarded(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command``, where a missing optional package found wherever the run reaches it (past
    the checks each command makes before any work) is still one sentence and exit 2."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except MissingExtra as e:
            fail(str(e))

    return run


app.add_typer(bench_app, name="bench")
# Each command ends in one sentence and exit 2 where an output cannot be written, or where
# an optional package it reaches is missing.
app.command("profile")(writes_guarded(_guarded(profile)))
app.command("plan")(writes_guarded(_guarded(plan_command)))
bench_app.command("ladder")(writes_guarded(_guarded(bench_ladder)))
app.command("train", cls=TrainCommand)(writes_guarded(_guarded(train)))


def main() -> None:
    """Entry point of the ``memfit`` command."""
    _QUICK_EXIT[0] = False
    try:
        app()
    except KeyboardInterrupt as e:
        # Ctrl-C outside a training run, or a second signal during one (the first stops it
        # cleanly): 128 + the signal, as a shell reports a process the signal ended.
        err.print("interrupted")
        sys.exit(getattr(e, "code", 130))
    except SystemExit as e:
        if _QUICK_EXIT[0]:
            _exit_now(e.code)
        raise
    if _QUICK_EXIT[0]:  # a command that returned normally (typer's standalone mode off)
        _exit_now(0)


def _exit_now(code: Any) -> None:
    """Flush the output and end the process with ``code`` at once (a command asked it with
    :func:`memfit.console.exit_without_teardown`); files were written and closed by the
    command itself."""
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else int(code))


if __name__ == "__main__":
    main()
