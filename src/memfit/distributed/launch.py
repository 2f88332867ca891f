"""Start local processes through torch's elastic launcher, and join them into a group.

``memfit train --nproc-per-node N`` re-runs itself as ``python -m memfit train ...`` in N
processes started by ``torch.distributed.run`` (what ``torchrun`` runs) in standalone mode: a
rendezvous on localhost with a port the launcher picks free, so a port in use cannot collide.
``torchrun --nproc-per-node N -m memfit train ...`` reaches the same code. What this module
adds: the decision whether we are a launcher or a worker, the worker's process group (gloo on
CPU, NCCL on CUDA), and a launcher failure turned into one sentence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch.distributed as dist

from ..errors import MemfitError

__all__ = [
    "ProcessesStopped",
    "finish_worker",
    "init_worker",
    "launch",
    "under_launcher",
    "worker_world_size",
]

#: Exit codes of a process that a signal stopped cleanly (``128 + SIGINT``, ``128 + SIGTERM``).
STOP_CODES = (130, 143)


class ProcessesStopped(MemfitError):
    """The launched processes ended because a signal stopped them cleanly, not by a failure:
    at least one exited with a stop code (130, 143) and the others with one too, or were
    ended by the launcher's SIGTERM after it (a worker's non-zero exit makes the launcher end
    the rest).

    Attributes:
        code: The stop code to exit with (143 after a SIGTERM, 130 after a SIGINT).
    """

    def __init__(self, code: int) -> None:
        super().__init__(f"stopped by a signal (exit code {code})")
        self.code = code


def under_launcher() -> bool:
    """Whether this process was started by torch's launcher (``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def worker_world_size() -> int:
    """The launcher's world size (1 outside it)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if under_launcher() else 1


def init_worker(backend: str | None = None) -> tuple[int, int]:
    """Join the launcher's process group (once); return ``(rank, world_size)``.

    Args:
        backend: ``gloo`` or ``nccl``; ``None``: NCCL when this process has a CUDA device,
            else gloo.
    """
    from ..device import cuda_available, set_device

    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend is None:
            backend = "nccl" if cuda_available() else "gloo"
        if backend == "nccl":
            set_device(local_rank)
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def finish_worker(ok: bool = True) -> None:
    """Leave the process group before the interpreter shuts down.

    Without it, gloo's worker threads can outlive the interpreter and abort the process at
    exit (``terminate called without an active exception``, SIGABRT) after a run that
    succeeded. Destroying a gloo group is local to this process (no collective), so this is
    safe on an error path too; an NCCL group is left to the launcher then, since its abort
    can wait on peers that have already gone.

    Args:
        ok: whether this process's work succeeded.
    """
    if dist.is_initialized() and (ok or dist.get_backend() == "gloo"):
        dist.destroy_process_group()


def launch(nproc: int, argv: Sequence[str]) -> str | None:
    """Run ``python -m memfit <argv>`` in ``nproc`` local processes through torch's elastic
    launcher (standalone: localhost rendezvous on a free port); wait for them. When one
    process fails or is killed, the launcher stops the others at once (none waits on a
    collective that will never come).

    Returns:
        ``None`` when every process succeeded, else one sentence naming the processes that
        failed and how.

    Raises:
        ProcessesStopped: when a signal stopped the run cleanly (the processes exited with
            130 or 143), or this launcher itself got SIGTERM or SIGINT (it then stops the
            processes with SIGTERM, which they answer as a stop: a checkpoint, then exit).
    """
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "memfit", *argv]
    )
    # One thread per process unless the user chose: N processes share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        run(args)
    except SignalException as e:
        raise ProcessesStopped(128 + int(e.sigval)) from None
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        ended = (*STOP_CODES, -signal.SIGTERM, -signal.SIGINT)
        stops = [c for c in codes if c in STOP_CODES]
        if stops and all(c in ended for c in codes):
            raise ProcessesStopped(stops[0]) from None
        how = []
        for rank, failure in sorted(e.failures.items()):
            code = failure.exitcode
            cause = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
            how.append(f"process {rank} {cause}")
        return (
            f"{'; '.join(how)}; the launcher stopped the other processes "
            f"({nproc} were started)"
        )
    return None
