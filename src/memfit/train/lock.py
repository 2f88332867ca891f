"""One writer per checkpoint folder: an exclusive lock held for a whole training run.

Two runs writing checkpoints into one folder lose work: each prunes the other's checkpoints,
re-saves the other's step numbers, and the cleanup of one's unfinished saves deletes the
other's save in progress. A run therefore holds ``.memfit.lock`` in its checkpoint folder
from its start (before any tokenising or planning) to its end, and a second run on the same
folder is refused at once, in one sentence naming the holder's process id and host.

The lock is :func:`fcntl.flock` on the lock file: the kernel releases it when its process
ends, however it ends (a ``kill -9`` included), so a lock left by a killed run is stale by
construction and the next run takes it over. The file holds the holder's pid, host and start
time as JSON, for the message; a run removes it as it lets go, so a finished run leaves the
folder as it found it. Where ``flock`` is unavailable (a platform without ``fcntl``) the file
alone is the lock: one whose pid still runs on this host refuses the run, any other is stale.

The lock is per process and re-entrant: the command takes it, and the
:class:`~memfit.train.Trainer` it runs (which takes it too, for Python users) finds it held.
The processes of one run (a launched data-parallel or tensor/pipeline run) inherit their
parent's lock through :data:`ENV`; a run started by torchrun directly is locked by rank 0.

What this adds to ``torch.distributed.checkpoint`` and safetensors, which write files but
leave the folder's ownership to the caller: the ownership.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .manifest import CheckpointError

__all__ = [
    "ENV",
    "LOCK_FILE",
    "CheckpointLocked",
    "hold",
    "holder",
    "lock_folder",
    "process_alive",
    "release",
]

LOCK_FILE = ".memfit.lock"
#: Set by the process that holds a folder's lock (``<folder>``) for the processes it starts.
ENV = "MEMFIT_CHECKPOINT_LOCK"


class CheckpointLocked(CheckpointError):
    """The checkpoint folder is held by another run; ``str(error)`` is one sentence."""


#: Folders this process holds: resolved path -> (open file descriptor, hold count).
_HELD: dict[Path, list[Any]] = {}


def _key(folder: str | os.PathLike[str]) -> Path:
    return Path(folder).expanduser().resolve()


def lock_folder(folder: str | os.PathLike[str]) -> None:
    """Take the checkpoint folder's lock for this process (again: a count), creating the
    folder if needed.

    Raises:
        CheckpointLocked: when another live process holds it.
        CheckpointError: when the folder or the lock file cannot be made.
    """
    key = _key(folder)
    if key in _HELD:
        _HELD[key][1] += 1
        return
    if os.environ.get(ENV) and _key(os.environ[ENV]) == key:
        # A process of a run whose launcher holds the lock: the run is one writer.
        _HELD[key] = [None, 1]
        return
    while True:
        try:
            key.mkdir(parents=True, exist_ok=True)
            fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"cannot lock the checkpoint folder {str(key)!r} ({e.strerror or e})"
            ) from None
        try:
            _flock(fd, key)
        except BaseException:
            os.close(fd)
            raise
        # The holder before us removes the file as it lets go: a lock on a removed file is
        # no lock, so take it again on the file now there.
        if _same_file(fd, key / LOCK_FILE):
            break
        os.close(fd)
    _write_holder(fd)
    _HELD[key] = [fd, 1]
    os.environ[ENV] = str(key)  # the run's launched processes write under this hold


def release(folder: str | os.PathLike[str]) -> None:
    """Give back one hold of the folder's lock; the last one unlocks it."""
    key = _key(folder)
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    fd = held[0]
    if fd is None:
        return
    if os.environ.get(ENV) == str(key):
        del os.environ[ENV]
    # Removed while still locked (a run that opened it meanwhile sees it gone and opens the
    # new one), so a finished run leaves the folder as it found it.
    with contextlib.suppress(OSError):
        os.unlink(key / LOCK_FILE)
    os.close(fd)


@contextlib.contextmanager
def hold(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """Hold the folder's lock for the block (nothing for ``None``, nor in a process other
    than rank 0 of a run started by a launcher: rank 0 holds it for the run).

    Raises:
        CheckpointLocked: when another run holds the folder.
    """
    if folder is None or os.environ.get("RANK", "0") != "0":
        yield
        return
    lock_folder(folder)
    try:
        yield
    finally:
        release(folder)


def holder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What the lock file says of its holder (``pid``, ``host``, ``since``); ``{}`` if
    unreadable."""
    try:
        data = json.loads((_key(folder) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _refusal(folder: Path) -> CheckpointLocked:
    who = holder(folder)
    pid, host = who.get("pid"), who.get("host")
    since = who.get("since")
    by = f"process {pid}" if pid else "another process"
    if host and host != socket.gethostname():
        by += f" on {host}"
    when = f" (since {time.strftime('%H:%M:%S', time.localtime(since))})" if since else ""
    return CheckpointLocked(
        f"the checkpoint folder {str(folder)!r} is in use by another memfit run, {by}{when}; "
        "wait for it to finish or give another --checkpoint-dir"
    )


def _flock(fd: int, folder: Path) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        _exclusive_file(fd, folder)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(folder) from None
    except OSError as e:  # a file system without locks (some network mounts)
        raise CheckpointError(
            f"cannot lock the checkpoint folder {str(folder)!r} ({e.strerror or e}); give a "
            "folder on a local disk"
        ) from None


def _exclusive_file(fd: int, folder: Path) -> None:  # pragma: no cover - not a POSIX system
    who = holder(folder)
    pid = who.get("pid")
    if pid and who.get("host") == socket.gethostname() and pid != os.getpid() and process_alive(pid):
        raise _refusal(folder)


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user's counts)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def _write_holder(fd: int) -> None:
    data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, (data + "\n").encode(), 0)
        os.fsync(fd)
