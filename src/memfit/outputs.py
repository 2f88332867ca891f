"""Output paths: whether a command can write them, checked before it does any work.

A profile, a plan search or a training run can take minutes; a ``--json`` path in a folder
that cannot exist should stop the command at once, not after the work. The commands
(``memfit profile/plan/train/bench``) and the scripts in ``benchmarks/`` check every path they
will write with :func:`check_outputs` first, and write through :func:`write_text`,
:func:`write_bytes` or :func:`atomic_file`, which create the missing folders the check allowed.

Every write is atomic: the content goes to a temporary file in the same folder, is flushed to
disk (``fsync``), then renamed over the path (:func:`os.replace`, atomic on POSIX). A write
that fails (a full disk, a quota, a permission lost mid-run) leaves the earlier file as it was
and raises :class:`OutputError` with one sentence naming the path and the cause; a crash at
any moment leaves the old file or the new one, never half of one.

The rule, for a file output: its folder must exist and be writable, and the path must not be
an existing folder (an ancestor that is a file is named as such). For a folder output
(``--checkpoint-dir``): missing folders are created when the nearest existing ancestor is a
writable folder, and a path that is an existing file is an error. Writability comes from :func:`os.access` on the path
or its nearest existing ancestor, so the check leaves nothing behind. A stdlib-only module (the
bottom floor): the command line and the benchmark scripts both import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NoReturn

from .errors import MemfitError

__all__ = [
    "WRITE_ERRNOS",
    "OutputError",
    "atomic_file",
    "check_outputs",
    "exit_if_unwritable",
    "fsync_file",
    "fsync_folder",
    "make_parent",
    "output_problem",
    "write_bytes",
    "write_failure",
    "write_text",
]

PathLike = str | os.PathLike[str]


class OutputError(MemfitError, ValueError):
    """An output path that cannot be written: one sentence naming the option and the path."""


def output_problem(path: PathLike, *, folder: bool = False, must_exist: bool = False) -> str | None:
    """What stops a command writing ``path``, as a sentence's end, or ``None`` when nothing does.

    Args:
        path: The output path as the user gave it.
        folder: The path is a folder the command writes files into (``--checkpoint-dir``),
            not a file.
        must_exist: With ``folder``: the folder must exist already (nothing creates it).

    Returns:
        ``None``, or the problem, e.g. ``"the folder /etc/hostname is a file"``.
    """
    p = Path(os.fspath(path)).expanduser()
    if os.path.exists(p):
        if folder and not os.path.isdir(p):
            return "it is a file, not a folder"
        if not folder and os.path.isdir(p):
            return "it is a folder; give a file name"
        # A folder output gets files created inside it (write and search permission).
        mode = os.W_OK | os.X_OK if folder else os.W_OK
        if not os.access(p, mode):
            return f"the {'folder' if folder else 'file'} is not writable"
        return None
    if folder and must_exist:
        return "the folder does not exist; create it first"
    if not folder and not os.path.exists(p.absolute().parent):
        # A file goes into a folder the user names: a missing one is most likely a typo, and
        # creating a tree of folders for one report would hide it.
        if not os.path.isdir(_nearest_existing(p.absolute().parent)):
            return f"{_nearest_existing(p.absolute().parent)} is a file, not a folder"
        return f"the folder {p.absolute().parent} does not exist; create it first"
    # The nearest existing ancestor: a folder output's missing parents are created with it.
    ancestor = p.absolute().parent
    while not os.path.exists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not os.path.isdir(ancestor):
        return f"{ancestor} is a file, not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"the folder {ancestor} is not writable"
    return None


def _nearest_existing(path: Path) -> Path:
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def check_outputs(
    files: Mapping[str, PathLike | None] | None = None,
    folders: Mapping[str, PathLike | None] | None = None,
    *,
    existing_folders: Mapping[str, PathLike | None] | None = None,
) -> None:
    """Raise :class:`OutputError` for the first output that cannot be written.

    Args:
        files: Option name (``"--json"``) -> the file it writes (``None``: not given).
        folders: Option name -> a folder it writes into, created if missing (with the
            files given inside it, whose folder need not exist yet).
        existing_folders: Option name -> a folder it writes into that must exist already.

    Raises:
        OutputError: ``"--json /no/such/p.json: the folder /no is not writable"``.
    """
    groups = (
        (folders or {}, {"folder": True}),
        (existing_folders or {}, {"folder": True, "must_exist": True}),
        (files or {}, {}),
    )
    # A file inside a folder output of the same call: that folder, checked first, is created
    # before the file is written.
    made = {
        Path(os.fspath(p)).expanduser().absolute()
        for p in (folders or {}).values()
        if p is not None
    }
    for paths, how in groups:
        for flag, path in paths.items():
            if path is None:
                continue
            target = Path(os.fspath(path)).expanduser().absolute()
            if not how and target.parent in made and not target.parent.exists():
                continue
            problem = output_problem(path, **how)
            if problem is not None:
                raise OutputError(f"{flag} {os.fspath(path)}: {problem}")


def exit_if_unwritable(
    files: Mapping[str, PathLike | None] | None = None,
    folders: Mapping[str, PathLike | None] | None = None,
    *,
    existing_folders: Mapping[str, PathLike | None] | None = None,
) -> None:
    """For scripts: :func:`check_outputs`, a failure printed as ``error: <sentence>`` on
    standard error and exit code 2 (bad input), as the ``memfit`` command does."""
    try:
        check_outputs(files, folders, existing_folders=existing_folders)
    except OutputError as e:
        _exit(str(e))


def _exit(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def make_parent(path: PathLike) -> Path:
    """Create the missing folders above the file ``path`` (which :func:`check_outputs` allowed);
    returns ``path`` as a :class:`~pathlib.Path`."""
    p = Path(os.fspath(path))
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` to the file ``path`` atomically, creating its missing parent folders
    first.

    Raises:
        OutputError: when the write fails; the earlier file at ``path`` is untouched.
    """
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to the file ``path`` atomically (see :func:`atomic_file`).

    Raises:
        OutputError: when the write fails; the earlier file at ``path`` is untouched.
    """
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
    return Path(os.fspath(path))


@contextlib.contextmanager
def atomic_file(path: PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that takes a file name (matplotlib's
    ``savefig``, safetensors): once the block ends, the file is flushed to disk and renamed
    over ``path``. The temporary name keeps ``path``'s suffix, so a writer that infers the
    format from it still does.

    Raises:
        OutputError: when the block or the rename fails with an :class:`OSError` (a full
            disk, a quota, a permission); the temporary file is removed and the earlier file
            at ``path`` is untouched. Other exceptions propagate, after the same cleanup.
    """
    final = make_parent(path)
    tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}{final.suffix}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, final)
        fsync_folder(final.parent)
    except OSError as e:
        _remove(tmp)
        raise OutputError(write_failure(final, e)) from None
    except BaseException:
        _remove(tmp)
        raise


def write_failure(path: PathLike, error: OSError) -> str:
    """One sentence for a write of ``path`` that failed with ``error``: the path, the cause
    in words, and that the earlier file (if any) is untouched."""
    causes: dict[int, str] = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.EROFS: "the file system is read-only",
        errno.EIO: "an input/output error",
    }
    why = causes.get(error.errno or 0) or error.strerror or str(error)
    kept = (
        "; the earlier file is unchanged"
        if os.path.exists(path)
        else "; nothing was written"
    )
    return f"could not write {os.fspath(path)}: {why}{kept}"


def fsync_file(path: PathLike) -> None:
    """Flush the file ``path``'s content to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_folder(path: PathLike) -> None:
    """Make the renames in the folder ``path`` durable (where the platform can open a
    folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


#: The causes of a failed write that are the user's to fix (not memfit's bugs).
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})
