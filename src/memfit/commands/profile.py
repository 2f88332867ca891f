"""``memfit profile`` under torch's launcher: every process measures its own memory.

``torchrun --nproc-per-node N -m memfit profile --model M [--plan P] [--json out.json]`` runs
the plan's training steps on every process (the plan gets ``N`` data-parallel processes when
it names none), each measured by memfit's tracker. Each process writes its report as
``out.rank{r}.json``; process 0 prints a table of rank x category and writes ``out.json``
with every rank's peak and categories.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..distributed.launch import init_worker
from ..plan import Plan
from ..units import format_bytes
from ..workload import Workload

__all__ = ["profile_under_launcher"]


def profile_under_launcher(
    workload: Workload, plan: Plan | None, steps: int, json_path: Path | None, console: Any
) -> list[dict[str, Any]]:
    """Measure this process's steps, gather every rank's figures, report them (rank 0).

    Returns:
        Per rank: ``rank``, ``peak_bytes``, ``peak_by_category``.

    Raises:
        ValueError: when the plan is for another number of processes.
    """
    import json

    from rich.table import Table

    from ..estimate.dryrun import measure
    from ..outputs import write_text

    rank, world = init_worker()
    plan = plan or Plan()
    if plan.parallel.data == 1:
        plan = plan.replace(parallel=dataclasses.replace(plan.parallel, data=world))
    elif plan.parallel.data != world:
        raise ValueError(f"the plan is for {plan.parallel.data} processes but {world} were started")
    report = measure(workload, plan, steps=max(steps, 3))
    mine = {
        "rank": rank,
        "peak_bytes": int(report.peak_bytes),
        "peak_by_category": dict(report.peak_by_category),
    }
    if json_path is not None:
        report.to_json(json_path.with_name(f"{json_path.stem}.rank{rank}{json_path.suffix}"))
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, mine)
    if rank == 0:
        categories = list(rows[0]["peak_by_category"])
        table = Table(title=f"{workload.name}: {plan.summary()} (measured per process)")
        for col in ["rank", "peak", *categories]:
            table.add_column(col, justify="right")
        for row in rows:
            table.add_row(
                str(row["rank"]),
                format_bytes(row["peak_bytes"]),
                *(format_bytes(row["peak_by_category"][c]) for c in categories),
            )
        console.print(table)
        if json_path is not None:
            data = {"model": workload.name, "plan": plan.to_dict(), "world_size": world,
                    "ranks": rows, "per_rank_peak_bytes": [r["peak_bytes"] for r in rows]}
            write_text(json_path, json.dumps(data, indent=2) + "\n")
            console.print(f"wrote {json_path} and one report per rank")
    dist.destroy_process_group()
    return rows
