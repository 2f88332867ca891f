"""The worker process of :class:`memfit.estimate.pool.DryRunPool`: shallow dry runs on demand.

Reads jobs from standard input and writes ``(ok, answer)`` to what was standard output;
anything the dry runs print goes to standard error instead, so it cannot corrupt the replies.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .pool import read_message, write_message


def run_job(
    *,
    spec: str,
    batch_size: int,
    seq_len: int,
    depth: int,
    plan: Any,
    device: Any,
    scale: float,
    threads: int,
) -> tuple[Any, ...]:
    """One shallow dry run, summarised as :func:`memfit.estimate.compose.shallow_summary` does
    (with the caller's thread count: some updates size their chunks by it)."""
    import torch

    from ..workload import load_workload

    torch.set_num_threads(threads)
    from .compose import shallow_summary
    from .dryrun import dry_run

    workload = load_workload(spec, batch_size, seq_len)
    assert workload.with_depth is not None
    small = workload.with_depth(depth).replace(batch_size=batch_size)
    return shallow_summary(dry_run(small, plan, steps=2, device=device), scale)


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    jobs = sys.stdin.buffer
    from . import compose, dryrun  # noqa: F401  (imports done before the first job arrives)

    while True:
        try:
            job = read_message(jobs)
        except EOFError:
            return
        try:
            write_message(replies, (True, run_job(**job)))
        except Exception as e:  # the caller runs the job itself and meets the error there
            write_message(replies, (False, repr(e)))


if __name__ == "__main__":
    main()
