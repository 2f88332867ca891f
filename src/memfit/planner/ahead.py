"""Work done in a second process while the planner goes on.

A prediction is two shallow dry runs, of depth 2 and depth 3, whose traces compose the full
depth's. On a machine with a second core, :class:`Ahead` runs work of that kind in a worker
process forked from the planner (so it imports nothing and builds nothing again): named tasks
(:meth:`Ahead.run`), on a candidate or not, whose results the planner takes when it needs
them (:meth:`Ahead.result`). The planner asks it for the deeper half of the workload's cost
profile while it measures the other half, then for the depth-3 run of each prediction while
it runs depth 2. A task not started when its result is wanted is withdrawn, and the caller
does it, so the answer is the one the planner gives alone.

A task under way can be sent items (:meth:`Ahead.tell`; it reads them from its
:class:`Inbox`): the depth-2 run's marks, against which the depth-3 run is watched as the
planner would watch it, so that a candidate over the budget stops there too.

What :mod:`multiprocessing` lacks for this is a queue the parent can still withdraw from, and
messages to a task under way; this module keeps that queue in the parent and hands the worker
one item at a time.

The worker is forked from the planner where that is safe (it then shares the planner's
imports, workload and candidates). It is not once this process has run a backward on a CUDA
build of torch (every GPU user's): autograd's device threads do not cross a fork, and a forked
child's first backward raises "Unable to handle autograd's threading in combination with
fork-based multiprocessing". :func:`fork_safe` asks a forked probe; where it fails, the worker
is started by a fork server (a fresh interpreter that never ran a backward) and its tasks and
candidates travel pickled. Off Linux, or on one core, :func:`start` gives ``None`` and the
planner works alone.

When the worker fails (it cannot start, a task raises, it dies), the answer is still the one
the planner gives alone, but slower: :class:`Ahead` says so once, and why
(:class:`WorkerFailed`, a warning).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .result import Candidate

__all__ = ["Ahead", "Inbox", "Withdrawn", "WorkerFailed", "fork_safe", "start"]


class WorkerFailed(RuntimeWarning):
    """The planner's worker failed; the planner does its share itself (the same answer)."""


def fork_safe(timeout: float = 60.0) -> bool:
    """Whether a child forked from this process now can run a backward: not once this process
    has run one on a CUDA build of torch (autograd's device threads do not cross a fork).
    Asked of a forked probe (a few milliseconds), since nothing in torch tells; ``False``
    where this platform does not fork."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    ctx = multiprocessing.get_context("fork")
    probe = ctx.Process(target=_probe_backward, daemon=True)
    probe.start()
    probe.join(timeout)
    if probe.is_alive():  # pragma: no cover - a hung probe
        probe.kill()
        probe.join()
        return False
    return probe.exitcode == 0


def _probe_backward() -> None:
    import torch

    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        os._exit(1)
    os._exit(0)

#: A task, by name, or by name and a candidate's position.
Key = str | tuple[str, int]


def start(
    candidates: Sequence[Candidate],
    tasks: Mapping[str, Callable[..., Any]],
    method: str = "fork",
) -> Ahead | None:
    """A worker for ``tasks`` (by name) on ``candidates`` (by position), or ``None`` where
    one cannot help: not Linux (elsewhere forking a process with threads, as torch's, is
    unsafe or unavailable), or a single usable core. ``method``: ``"fork"``, or
    ``"forkserver"`` (the tasks and candidates must then pickle)."""
    if not sys.platform.startswith("linux") or method not in multiprocessing.get_all_start_methods():
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    if cores < 2:
        return None
    return Ahead(candidates, tasks, method)


class Ahead:
    """A worker process that runs tasks on request (see the module docstring).

    A thread of this process starts the worker (a fork server's first start imports torch:
    the planner goes on meanwhile, and does itself what it needs before the worker is up),
    then waits for the worker's results and hands it the next task as soon as it is free.

    Args:
        candidates: Every candidate of the search; the worker knows them by position (it is
            forked after they exist).
        tasks: The work the worker can do on request (:meth:`run`), by name: each takes
            nothing, or a candidate and its :class:`Inbox`, and returns a picklable result
            (such as the deeper half of the workload's cost profile, or the depth-3 run of a
            candidate the planner predicts).
        method: ``"fork"`` (the default), or ``"forkserver"``, safe where this process ran
            a backward on a CUDA build (:func:`fork_safe`); the tasks and candidates must then
            pickle.

    Attributes:
        failure: Why the worker failed, once it has (``None`` until then); said once as a
            :class:`WorkerFailed` warning.
    """

    def __init__(
        self,
        candidates: Sequence[Candidate],
        tasks: Mapping[str, Callable[..., Any]],
        method: str = "fork",
    ) -> None:
        self._index = {id(c): i for i, c in enumerate(candidates)}
        self._candidates = list(candidates)
        self.method = method
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            # The server imports torch and the planner once; each worker forks from it.
            ctx.set_forkserver_preload(["memfit.planner.worker"])
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, self._candidates, dict(tasks)), daemon=True
        )
        # Frozen, the objects both processes share are left out of their collections: a
        # collection would write to each of them, and every page it writes is copied (on this
        # VM the worker's copies cost it half a second of kernel time). Unless the caller froze
        # them first, they are thawed when the worker stops.
        self._froze = method == "fork" and gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        self.failure: str | None = None
        self._said = False
        self._closed = False
        self.started = threading.Event()  # set once the worker is up, or failed to start
        self._queue: list[Key] = []  # asked for, not yet sent
        self._busy: Key | None = None  # sent, result not yet received
        self._done: dict[Key, Any] = {}  # received (None: the worker failed)
        self._drop: set[Key] = set()  # under way, result not wanted
        self._backlog: dict[Key, list[Any]] = {}  # told to a task not yet sent
        self._dead = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._start_then_read, args=(child,), daemon=True)
        self._reader.start()
        if method == "fork":
            self.started.wait()  # a fork takes milliseconds: the worker is there from the start

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait until the worker is up (or failed to start); whether it is up."""
        self.started.wait(timeout)
        with self._cond:
            return self.started.is_set() and not self._dead

    def run(self, name: str, c: Candidate | None = None) -> None:
        """Ask for the task ``name`` (on ``c``, if given), ahead of those asked for before."""
        self._say_failure()
        key = self._key(name, c)
        with self._cond:
            if key != self._busy and key not in self._queue and key not in self._done:
                self._queue.insert(0, key)
                self._send_next()

    def result(
        self, name: str, c: Candidate | None = None, *, poll: Callable[[], None] | None = None
    ) -> Any:
        """The task's result (waits for it if it is under way, calling ``poll`` every 50 ms
        meanwhile: it may raise to stop waiting); ``None`` if it was not started (it is
        withdrawn), failed, or the worker is gone: the caller does it."""
        key = self._key(name, c)
        try:
            with self._cond:
                if key in self._queue:
                    self._queue.remove(key)
                    self._backlog.pop(key, None)
                    return None
                while key == self._busy:
                    self._cond.wait(timeout=None if poll is None else 0.05)
                    if poll is not None:
                        poll()
                return self._done.pop(key, None)
        finally:
            self._say_failure()

    def peek(self, name: str, c: Candidate | None = None) -> Any:
        """The task's result if it is here (``None`` if not), without waiting or taking it."""
        with self._cond:
            return self._done.get(self._key(name, c))

    def discard(self, name: str, c: Candidate | None = None) -> None:
        """The task's result is no longer wanted: withdrawn if not started; stopped at its
        next read of its inbox and dropped when it comes (without waiting) if under way."""
        key = self._key(name, c)
        with self._cond:
            self._backlog.pop(key, None)
            if key in self._queue:
                self._queue.remove(key)
            elif key == self._busy:
                if key not in self._drop:
                    self._drop.add(key)
                    self._post(("cancel", key))
            else:
                self._done.pop(key, None)

    def tell(self, name: str, c: Candidate, item: Any) -> None:
        """Send ``item`` to the task ``name`` on ``c`` (its :class:`Inbox` reads the items in
        order): kept for it if it is asked for and not yet started, dropped if it is not
        asked for or already done."""
        key = self._key(name, c)
        with self._cond:
            if key == self._busy and key not in self._drop:
                self._post(("item", key, item))
            elif key in self._queue:
                self._backlog.setdefault(key, []).append(item)

    def _key(self, name: str, c: Candidate | None) -> Key:
        return name if c is None else (name, self._index[id(c)])

    def close(self) -> None:
        """Stop the worker (whatever it is doing is no longer needed)."""
        with self._cond:
            self._closed = True  # (a worker not yet up is stopped as it comes up)
            up = self._proc.pid is not None
        if up:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
        self._say_failure()
        if self._froze:
            self._froze = False
            gc.unfreeze()
        with contextlib.suppress(OSError):
            self._conn.close()
        self._reader.join(timeout=1.0)

    def _say_failure(self) -> None:
        # In the planner's thread (a warning from the reader thread would reach no one).
        if self.failure is not None and not self._said:
            self._said = True
            warnings.warn(
                f"the planner's worker process failed ({self.failure}); the planner does its "
                "share itself: the same answer, slower",
                WorkerFailed,
                stacklevel=3,
            )

    def _fail(self, why: str) -> None:
        # Called with the lock held: the first failure is the one said.
        if self.failure is None and not self._closed:
            self.failure = why

    def _start_then_read(self, child: Any) -> None:
        try:
            self._proc.start()
        except Exception as e:  # (tasks that do not pickle, a fork server that cannot start)
            with self._cond:
                self._fail(f"it could not start: {_one_line(e)}")
                self._died()
            self.started.set()
            return
        finally:
            child.close()
        with self._cond:
            if self._closed:  # closed while it started
                self._proc.kill()
            self.started.set()
            self._send_next()
        self._read()

    def _send_next(self) -> None:
        # Called with the lock held.
        if self._busy is None and self._queue and not self._dead and self.started.is_set():
            self._busy = busy = self._queue.pop(0)
            self._post(("work", busy, self._backlog.pop(busy, [])))

    def _post(self, message: tuple[Any, ...]) -> None:
        # Called with the lock held (this process's two threads both send).
        try:
            self._conn.send(message)
        except OSError:
            self._died()

    def _read(self) -> None:
        while True:
            try:
                key, result = self._conn.recv()
            except (EOFError, OSError, TypeError):
                with contextlib.suppress(Exception):
                    self._proc.join(timeout=1.0)  # (for its exit code)
                with self._cond:
                    code = self._proc.exitcode
                    self._fail("it stopped" + (f" with exit code {code}" if code else ""))
                    self._died()
                return
            with self._cond:
                if isinstance(result, _TaskFailed):
                    self._fail(f"its task {key[0] if isinstance(key, tuple) else key!r} "
                               f"raised {result.error}")
                    result = None
                if key in self._drop:
                    self._drop.discard(key)
                else:
                    self._done[key] = result
                self._busy = None
                self._send_next()
                self._cond.notify_all()

    def _died(self) -> None:
        # Called with the lock held. The worker is gone: what it held or was asked for is
        # done by the planner instead.
        self._dead = True
        self._queue.clear()
        self._busy = None
        self._cond.notify_all()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Withdrawn(Exception):
    """Raised in a task reading its inbox when the planner no longer wants its result."""


class Inbox:
    """The items :meth:`Ahead.tell` sent a task under way, in the worker.

    Calling it with ``k`` gives the ``k``-th item (from 0), waiting for it; ``None`` is the
    sender's "no more items" (and is given for every later ``k``).

    Raises:
        Withdrawn: when the planner discarded the task meanwhile.
    """

    def __init__(self, conn: Any, key: Key, backlog: list[Any]) -> None:
        self._conn, self._key = conn, key
        self._items = list(backlog)

    @property
    def position(self) -> int | None:
        """The task's candidate's position among the worker's candidates (``None``: none)."""
        return self._key[1] if isinstance(self._key, tuple) else None

    def __call__(self, k: int) -> Any:
        while k >= len(self._items) and (not self._items or self._items[-1] is not None):
            message = self._conn.recv()
            if message[1] != self._key:
                continue  # (an item for an earlier task, sent as it ended)
            if message[0] == "cancel":
                raise Withdrawn
            if message[0] == "item":
                self._items.append(message[2])
        if k < len(self._items) and self._items[k] is not None:
            return self._items[k]
        return None


def _serve(conn: Any, candidates: list[Candidate], tasks: dict[str, Callable[..., Any]]) -> None:
    """The worker's loop: a task's name (and candidate's position) in, its result out."""
    import torch

    torch.set_num_threads(1)  # dry runs compute nothing; threads forked mid-life may hang
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] != "work":
            continue  # an item or a cancel for a task that has ended
        _, key, backlog = message
        try:
            if isinstance(key, str):
                result = tasks[key]()
            else:
                result = tasks[key[0]](candidates[key[1]], Inbox(conn, key, backlog))
        except Withdrawn:
            result = None
        except Exception as e:  # the caller does it itself; the planner says why
            result = _TaskFailed(_one_line(e))
        conn.send((key, result))


class _TaskFailed:
    """A task's exception, as the worker sends it back (one line: the type and message)."""

    def __init__(self, error: str) -> None:
        self.error = error


def _one_line(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    return text[-1] if text else type(e).__name__
