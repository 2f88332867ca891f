"""The one stop flag of a run: SIGTERM and SIGINT ask every part of a run to stop.

A scheduler pre-empts a job with SIGTERM, a person at the terminal presses Ctrl-C (SIGINT).
Either should end the run soon and cleanly, wherever it is: so every long loop of a run reads
this one flag, at a point where stopping loses nothing but the work not yet done
(issue 37: evaluation used to read it only after a whole pass, which never came):

* the training loop, after each step (:meth:`memfit.train.Trainer.fit`, and the
  tensor/pipeline run's loop in :mod:`memfit.train.layout_run`), then saves a checkpoint where
  a checkpoint folder is given;
* evaluation, before each batch (:func:`memfit.train.callbacks.evaluation.eval_losses`,
  :func:`memfit.train.layout_eval.evaluate_layout`);
* data preparation, per file and per record (:mod:`memfit.train.data`,
  :mod:`memfit.train.chat`) and between the phases of :func:`memfit.train.run.prepare_run`,
  which raises :class:`StopRequested` (nothing is trained yet, so nothing is saved);
* saving: a checkpoint being written when the first signal comes is finished (it is the
  checkpoint the stop needs); files are written into a temporary folder and renamed, so a
  second signal, which interrupts at once, leaves the previous checkpoint intact.

The first SIGTERM or SIGINT sets the flag; a second one raises :class:`Interrupted` (a
``KeyboardInterrupt``) at once: a hard stop, as Ctrl-C did before. ``memfit train`` exits with ``128 + signal``: 143 after a
SIGTERM, 130 after a SIGINT (:func:`exit_code`).

Signals are delivered to a process, not to an object, so the flag is one per process
(:data:`STOP`); :func:`catch_signals` clears it when the outermost run starts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "STOP",
    "Interrupted",
    "StopFlag",
    "StopRequested",
    "catch_signals",
    "check_stop",
    "exit_code",
    "stop_requested",
]

#: The signals that stop a run gracefully.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """A signal asked the run to stop before it trained anything (during data preparation or
    planning). A ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except
    Exception`` on the way (a planner trying candidates) swallows it.

    Attributes:
        signal_name: The signal's name (``"SIGTERM"``).
        code: The exit code a command ends with: ``128 + signal number``.
    """

    def __init__(self, signal_name: str, code: int) -> None:
        super().__init__(f"stopped by {signal_name}")
        self.signal_name = signal_name
        self.code = code


class Interrupted(KeyboardInterrupt):
    """A second SIGTERM or SIGINT: the run ends at once, without a checkpoint.

    Attributes:
        code: The exit code: ``128 +`` the second signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"a second {signal.Signals(signum).name}")
        self.code = exit_code(signum)


class StopFlag:
    """Whether, and by which signal, the run was asked to stop.

    Attributes:
        signal_name: ``"SIGTERM"``, ``"SIGINT"``, ``"SIGTERM (another process)"``, or ``None``
            while no stop was asked.
        signum: The signal's number (``None`` while no stop was asked).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        """Whether a stop was asked."""
        return self.signal_name is not None

    def request(self, signum: int, name: str | None = None) -> None:
        """Ask the run to stop, as signal ``signum`` does (``name``: how the result names it;
        default the signal's own name). The first request is kept."""
        if self.signal_name is None:
            self.signum = int(signum)
            self.signal_name = name or signal.Signals(signum).name

    def clear(self) -> None:
        """Forget a stop (a new run starts)."""
        self.signal_name, self.signum = None, None

    def check(self) -> None:
        """Raise :class:`StopRequested` when a stop was asked (for work that has nothing to
        save: data preparation, planning)."""
        if self.signal_name is not None:
            raise StopRequested(self.signal_name, exit_code(self.signum))


#: The process's stop flag, set by the handlers :func:`catch_signals` installs.
STOP = StopFlag()

# How many catch_signals blocks are open (only the outermost installs and clears).
_DEPTH = [0]
# Whether a second signal interrupts at once (set by the outermost block).
_HARD = [True]
_LOCK = threading.Lock()


def stop_requested() -> bool:
    """Whether a signal asked the run to stop (``STOP.requested``)."""
    return STOP.requested


def check_stop() -> None:
    """Raise :class:`StopRequested` when a signal asked the run to stop."""
    STOP.check()


def exit_code(signum: int | None) -> int:
    """The exit code of a run stopped by signal ``signum``: ``128 + signum`` (the shell's own
    convention: 143 for SIGTERM, 130 for SIGINT); 0 for ``None`` (not stopped)."""
    return 0 if signum is None else 128 + int(signum)


def _handler(signum: int, frame: Any) -> None:
    if STOP.requested and _HARD[0]:
        # A second signal: the user (or the scheduler) will not wait for a clean stop.
        raise Interrupted(signum)
    STOP.request(signum)


@contextlib.contextmanager
def catch_signals(*, second_interrupts: bool = True) -> Iterator[StopFlag]:
    """Within the block, SIGTERM and SIGINT set :data:`STOP` instead of ending the process
    (a second one raises :class:`Interrupted`, a ``KeyboardInterrupt``); the previous handlers
    are put back after it, and the flag is cleared (work done after a run, such as building
    another dataset, is not stopped by the run's signal).

    Blocks nest: only the outermost clears the flag and installs the handlers, so that a
    command can catch signals around data preparation and the trainer's own block inside it
    keeps what was caught (read the flag inside the block). Outside the main thread (where
    Python cannot install handlers) the flag is still read, and only set by
    :meth:`StopFlag.request`.

    Args:
        second_interrupts: Whether a second signal interrupts at once (the outermost block
            decides). ``False`` for a process under torch's launcher: a Ctrl-C reaches every
            process of the group and the launcher then forwards it to its workers too, so a
            worker gets two signals for one stop; the launcher ends a worker that does not
            stop with SIGKILL after its own timeout.

    Yields:
        The flag (:data:`STOP`).
    """
    with _LOCK:
        outermost = _DEPTH[0] == 0
        _DEPTH[0] += 1
    previous: dict[int, Any] = {}
    try:
        if outermost:
            STOP.clear()
            _HARD[0] = second_interrupts
            if threading.current_thread() is threading.main_thread():
                for sig in SIGNALS:
                    previous[sig] = signal.signal(sig, _handler)
        yield STOP
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with _LOCK:
            _DEPTH[0] -= 1
            if outermost:
                STOP.clear()
