"""A second process for shallow dry runs, so that a prediction's depths run side by side.

A composed prediction (:mod:`memfit.estimate.compose`) dry-runs the workload at two shallow
depths; neither needs the other, and a dry run on fake tensors keeps one core busy with
Python. :class:`DryRunPool` runs one of them in a worker process while the caller runs the
other, so on a machine with two cores a prediction takes about as long as its deeper run.

The worker is a fresh interpreter (``python -m memfit.estimate._worker``), not a fork (torch's
thread pools do not survive one) nor a ``multiprocessing`` spawn (which re-imports the
caller's main script). It rebuilds the workload from its SPEC (a preset, a config path or a
``module:function``), so a workload made in Python without a SPEC runs in the caller. The
worker's answer is the same report summary the caller would compute; anything that goes wrong
in it (a crash, an error of the model) makes the caller run that depth itself, where the
error, if any, surfaces as it always has.

What Python's and torch's process pools lack here: a worker that starts importing while the
caller is still busy, and that falls back to the caller without a trace when it fails.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from typing import Any

__all__ = ["DryRunPool", "read_message", "write_message"]

_HEADER = struct.Struct("!Q")


def write_message(stream: Any, obj: Any) -> None:
    """Write ``obj`` to ``stream`` as a length-prefixed pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream: Any) -> Any:
    """Read one length-prefixed pickle from ``stream`` (``EOFError`` at its end)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the stream ended")
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the stream ended inside a message")
    return pickle.loads(data)


class DryRunPool:
    """One worker process for shallow dry runs (see the module docstring).

    Use as a context manager; :meth:`submit` a job, then :meth:`result` it. When the worker
    is gone, ``submit`` returns ``False`` and the caller runs the job itself.
    """

    def __init__(self, warmup: dict[str, Any] | None = None) -> None:
        """Start the worker; ``warmup`` (a job, answer discarded) runs first, so that its
        first real job does not pay for imports and first calls."""
        env = dict(os.environ)
        # The worker imports what the caller can (this memfit, a module:function workload's
        # module): the caller's import path, in its order.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", "memfit.estimate._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._pending = False
        self._unread = 0  # warm-up answers still to discard
        if warmup is not None and self.submit(warmup):
            self._pending = False
            self._unread = 1

    @property
    def alive(self) -> bool:
        """Whether the worker can take a job."""
        return self._proc is not None and self._proc.poll() is None

    def submit(self, job: dict[str, Any]) -> bool:
        """Send ``job`` (keyword arguments of :func:`memfit.estimate._worker.run_job`) to the
        worker; ``False`` when it cannot take it (the caller runs it)."""
        if not self.alive or self._pending:
            return False
        assert self._proc is not None and self._proc.stdin is not None
        try:
            write_message(self._proc.stdin, job)
        except (OSError, pickle.PicklingError, AttributeError, TypeError):
            self.close()
            return False
        self._pending = True
        return True

    def result(self) -> Any | None:
        """The answer to the job submitted, or ``None`` when the worker failed (it is then
        closed, and the caller runs that job and every later one itself)."""
        if not self._pending or self._proc is None or self._proc.stdout is None:
            return None
        self._pending = False
        try:
            for _ in range(self._unread):
                read_message(self._proc.stdout)
            self._unread = 0
            ok, value = read_message(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            self.close()
            return None
        return value if ok else None

    def close(self) -> None:
        """Stop the worker."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> DryRunPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
