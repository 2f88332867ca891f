"""``memfit profile``: measure where a training step's memory goes, by category, phase and
module, in this process, on fake tensors (``--dry-run``), per predicted rank
(``--dry-run --world-size N``) or in every process of torch's launcher.

Under the launcher, ``torchrun --nproc-per-node N -m memfit profile --model M [--plan P]
[--json out.json]`` runs the plan's training steps on every process (the plan gets ``N``
data-parallel processes when it names none), each measured by memfit's tracker
(:func:`profile_under_launcher`). Each process writes its report as ``out.rank{r}.json``;
process 0 prints a table of rank x category and writes ``out.json`` with every rank's peak and
categories.

``memfit profile --job`` profiles a whole job instead of its steps: each phase's peak (load,
first and steady step, evaluation, checkpoint save and load, resumed step) and the phase that
sets the run's peak, predicted with ``--dry-run`` (:func:`memfit.train.job.predict_job`) or
measured by the trainer (:func:`memfit.train.job.measure_job`); ``--steps`` does not apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import torch.distributed as dist
import typer

from ..console import (
    SETTINGS,
    check_outputs,
    configure,
    err,
    fail,
    fit_width,
    out,
    show,
    status,
)
from ..distributed.launch import init_worker
from ..outputs import write_text
from ..plan import Plan, PlanError
from ..units import format_bytes
from ..workload import Workload
from .checks import (
    QuietOption,
    TextFieldOption,
    TokenizerOption,
    VerboseOption,
    check_data_options,
    check_extras,
    check_sizes,
    data_lengths,
    data_option,
    parse_cap,
    run_guarded,
)

__all__ = ["profile", "profile_under_launcher"]

_Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="A preset (gpt2-tiny, llama-1b, ...), a Hugging Face model folder (config.json, "
        "with or without weights) or its config.json, a hub id, or package.module:function.",
    ),
]
_BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Samples per step.")]
_SeqLen = Annotated[int, typer.Option("--seq-len", "-l", help="Tokens per sample.")]
_DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Run on fake tensors: nothing is allocated.")
]
_Steps = Annotated[int, typer.Option("--steps", help="Full training steps to run.")]
_PlanPath = Annotated[
    Path | None, typer.Option("--plan", help="A saved plan (JSON or YAML) to apply.")
]
_Json = Annotated[Path | None, typer.Option("--json", help="Write the report as JSON here.")]
_Plot = Annotated[
    Path | None, typer.Option("--plot", help="Write a PNG of memory over the step here.")
]
_Cap = Annotated[
    str | None,
    typer.Option("--cap", help="Virtual memory cap (e.g. 4GiB): fail like a GPU would."),
]
_Top = Annotated[int, typer.Option("--top", help="Modules to list.")]
_Snapshot = Annotated[
    Path | None,
    typer.Option(
        "--snapshot",
        help="Write the run's allocations as a PyTorch memory snapshot (a pickle that "
        "https://pytorch.org/memory_viz opens), modelled for the target's caching allocator.",
    ),
]
_Html = Annotated[
    Path | None,
    typer.Option(
        "--html",
        help="Write the run's memory timeline as one self-contained HTML page (drawn by "
        "memfit, no network needed; the caching allocator modelled for the target), with the "
        "--snapshot data as a download for PyTorch's viewer.",
    ),
]
_Device = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="Target device whose memory to reproduce: h100, a100, a100-40gb, rtx4090, t4, "
        "cpu, or a custom GPU (a JSON/YAML file, or name=...,memory=...,mem_bandwidth=...,"
        "host_bandwidth=...,compute_capability=...,bf16=...). Default: this machine.",
    ),
]
_ExpertLoad = Annotated[
    float,
    typer.Option(
        "--expert-load",
        help="With --dry-run, mixture-of-experts routing: 1 spreads tokens evenly; c > 1 "
        "gives one expert c times its share (a worst case; with --world-size and a plan's "
        "parallel expert > 1, the rank holding that expert receives it).",
    ),
]
_WorldSize = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        help="With --dry-run: predict each of N data-parallel processes (the plan's ZeRO "
        "stage, stage 0 by default) without launching them; --batch-size is the global batch.",
    ),
]

_Job = Annotated[
    bool,
    typer.Option(
        "--job",
        help="Profile the whole job, phase by phase: model load, first and steady step, "
        "evaluation, checkpoint save, checkpoint load, resumed step; names the phase that sets "
        "the run's peak. With --dry-run: predicted for --device on fake tensors; without: "
        "measured by the trainer on this machine.",
    ),
]

_Data = data_option("profile")
_Tokenizer = TokenizerOption
_TextField = TextFieldOption


def profile(
    model: _Model,
    batch_size: _BatchSize = 8,
    seq_len: _SeqLen = 128,
    dry_run: _DryRun = False,
    steps: _Steps = 2,
    plan: _PlanPath = None,
    json_path: _Json = None,
    plot: _Plot = None,
    cap: _Cap = None,
    top: _Top = 8,
    device: _Device = None,
    expert_load: _ExpertLoad = 1.0,
    world_size: _WorldSize = None,
    snapshot: _Snapshot = None,
    html: _Html = None,
    data: _Data = None,
    tokenizer: _Tokenizer = None,
    text_field: _TextField = "text",
    job: _Job = False,
    quiet: QuietOption = False,
    verbose: VerboseOption = False,
) -> None:
    """Measure where a training step's memory goes, by category, phase and module."""
    configure(quiet=quiet, verbose=verbose)
    from ..estimate.predictor import Measured
    from ..workload import load_workload

    check_sizes(batch_size, seq_len, steps)
    check_outputs({"--json": json_path, "--plot": plot, "--snapshot": snapshot, "--html": html})
    if top < 0:
        fail(f"--top must be a whole number >= 0, got {top}")
    cap_bytes = parse_cap(cap)
    from ..targets import get_device

    target = run_guarded(get_device, device)
    the_plan = run_guarded(Plan.load, plan) if plan is not None else None
    check_extras((), the_plan, where=f"--plan {plan}", real=not dry_run)
    check_data_options(data, tokenizer, text_field)
    if data:
        # Measure the longest batch the data makes: the one a budget must hold.
        share = max(batch_size // (world_size or 1), 1)
        seq_len = data_lengths(data, tokenizer, text_field, share, seq_len, model).max
    workload = run_guarded(load_workload, model, batch_size, seq_len)
    for flag, path in (("--snapshot", snapshot), ("--html", html)):
        if path is not None and world_size is not None:
            fail(f"{flag} writes one process's timeline; leave out --world-size")
    if job:
        _check_job_options(world_size, snapshot, html, plot, cap, dry_run, device)
        _profile_job(workload, the_plan, dry_run, target, expert_load, json_path)
        return
    if world_size is not None:
        _profile_ranks(workload, the_plan, world_size, dry_run, steps, target, json_path,
                       expert_load)
        return
    from ..distributed.launch import under_launcher

    if under_launcher() and not dry_run:
        run_guarded(profile_under_launcher, workload, the_plan, steps, json_path, out)
        return
    prediction = _with_progress(
        f"{'dry-running' if dry_run else 'running'} {workload.name} "
        f"(batch {batch_size}, length {seq_len}) for {target.name}",
        steps,
        lambda progress: run_guarded(
            Measured(
                dry=dry_run,
                steps=steps,
                cap=cap_bytes,
                progress=progress,
                expert_load=expert_load,
                keep_trace=snapshot is not None or html is not None,
            ).predict,
            workload,
            the_plan,
            target,
        ),
    )
    report = prediction.report
    _print_report(report)
    title = f"memfit profile: {workload.name}, batch {batch_size}, length {seq_len}"
    _write_report(report, json_path, plot, title)
    if snapshot is not None:
        _write_snapshot(report, snapshot)
    if html is not None:
        _write_snapshot(report, html, page=True, title=title)


def _check_job_options(
    world_size: int | None, snapshot: Path | None, html: Path | None, plot: Path | None,
    cap: str | None, dry_run: bool, device: str | None,
) -> None:
    """``--job`` profiles one process's phases, each under its own tracker: refuse what it
    does not do, in one sentence."""
    for flag, given in (("--world-size", world_size), ("--snapshot", snapshot),
                        ("--html", html), ("--plot", plot), ("--cap", cap)):
        if given is not None:
            fail(f"--job profiles one process's phases and takes no {flag}; leave it out")
    if not dry_run and device is not None:
        fail("--job without --dry-run measures this machine; add --dry-run to predict "
             f"{device}")


def _profile_job(
    workload: Workload, plan: Plan | None, dry: bool, target: Any, expert_load: float,
    json_path: Path | None,
) -> None:
    """``memfit profile --job``: each phase's peak, predicted (``--dry-run``) or measured by
    the trainer, as a table naming the peak phase and, with ``--json``, a ``job`` object."""
    import json

    from ..train.job import measure_job, predict_job

    what = "dry-running" if dry else "running"
    with status(f"{what} the phases of a job of {workload.name} for {target.name}"):
        if dry:
            phases = run_guarded(
                predict_job, workload, plan, device=target, expert_load=expert_load
            )
        else:
            phases = run_guarded(measure_job, workload, plan)
    mode = "predicted on fake tensors" if dry else "measured by the trainer"
    title = (f"{workload.name}, batch {workload.batch_size}, length {workload.seq_len}: "
             f"the job's phases ({mode}, target {target.name if dry else 'this machine'})")
    show(phases.table(title))
    top = phases.peak_phase
    out.print(f"the run's peak is set by [bold]{top}[/]: "
              f"[bold]{format_bytes(phases.peak_bytes)}[/] of tensors", highlight=False)
    if json_path is not None:
        data = {"model": workload.name, "batch_size": workload.batch_size,
                "seq_len": workload.seq_len, "dry_run": dry,
                "target_device": target.name if dry else None,
                "plan": (plan or Plan()).to_dict(), "job": phases.to_dict()}
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


def _write_snapshot(report: Any, path: Path, *, page: bool = False, title: str = "") -> None:
    """The run's PyTorch memory snapshot: the pickle (``--snapshot``), or memfit's page of the
    run's timeline carrying it (``--html``, headed ``title``)."""
    from ..accounting.snapshot import write_html, write_snapshot

    flag = "--html" if page else "--snapshot"
    if report.trace is None:
        fail(f"this run kept no allocation trace, so {flag} has nothing to write")
    try:
        if page:
            write_html(report.trace, path, title=title)
        else:
            write_snapshot(report.trace, path)
    except OSError as e:
        fail(f"{flag} {path}: cannot write it ({e.strerror or e})")
    if page:
        out.print(f"wrote the memory timeline to {path} (open it in a browser; no network "
                  "needed)")
    else:
        out.print(f"wrote the memory snapshot to {path} (open it at https://pytorch.org/memory_viz)")


def _write_report(report: Any, json_path: Path | None, plot: Path | None, title: str) -> None:
    """The dry run's data-dependent policies, then the report's JSON and PNG when asked."""
    for use in report.meta.get("data_dependent") or ():
        where = f" in {use['module']}" if use["module"] else ""
        out.print(
            f"dry-run policy: {use['op']}{where}: {use['policy']} ({use['count']}x)",
            highlight=False,
        )
    if json_path is not None:
        report.to_json(json_path)
        out.print(f"wrote {json_path}")
    if plot is not None:
        report.plot(plot, title=title)
        out.print(f"wrote {plot}")


def _profile_ranks(
    workload: Any, plan: Any, world: int, dry: bool, steps: int, target: Any, json_path: Any,
    expert_load: float = 1.0,
) -> None:
    """``memfit profile --dry-run --world-size N``: every rank's predicted memory, a table of
    rank x category and, with ``--json``, one JSON with each rank's peak and categories.
    ``expert_load``: the routing every rank's dry run assumes (with ``parallel.expert > 1``
    the first rank of each expert group receives expert 0's extra load: the worst rank)."""
    import json

    from rich.table import Table

    from ..estimate.predictor import Ranks

    if not dry:
        fail(
            "--world-size predicts processes without launching them and needs --dry-run; to "
            "measure real processes, run memfit train --nproc-per-node N"
        )
    if isinstance(world, bool) or world < 1:
        fail(f"--world-size must be a whole number >= 1, got {world}")
    plan = plan or Plan()
    if plan.parallel.splits_model:
        _profile_layout(workload, plan, world, json_path, target)
        return
    try:
        plan = plan.over_processes(world)
    except PlanError:
        fail(f"the plan is for {plan.parallel.data} processes but --world-size is {world}")
    with status(f"dry-running {world} ranks of {workload.name}"):
        prediction = run_guarded(Ranks(steps=max(steps, 3), expert_load=expert_load).predict,
                                 workload, plan, target)
    pred = prediction.extra["ranks"]  # the ranks' own reports, for their categories
    categories = [c for c in next(iter(pred.reports.values())).peak_by_category]
    table = Table(title=f"{workload.name}: {plan.summary()} (predicted per rank)")
    device_cols = ["nccl", "device total"] if target.is_cuda else []
    for col in ["rank", "peak", *categories, *device_cols]:
        table.add_column(col, justify="right")
    for r in range(world):
        rep = pred.reports.get(r)
        cells = [format_bytes(rep.peak_by_category.get(c, 0)) if rep else "as rank 0" for c in categories]
        if device_cols:
            cells += [format_bytes(pred.nccl_bytes[r]), format_bytes(pred.device_total_bytes[r])]
        table.add_row(str(r), format_bytes(pred.peak_bytes[r]), *cells)
    show(table)
    if json_path is not None:
        data = {"model": workload.name, "plan": plan.to_dict(), "world_size": world, **pred.to_dict()}
        data["reports"] = {str(r): rep.to_dict(max_points=200) for r, rep in pred.reports.items()}
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


def _profile_layout(workload: Any, plan: Any, world: int, json_path: Any, target: Any) -> None:
    """``memfit profile --dry-run --world-size N`` for a tensor/pipeline plan: each rank's
    predicted peak from dry runs of its own program (:func:`memfit.estimate.layout.
    predict_layout`), and on a CUDA target its NCCL communicators and device total."""
    import json

    from rich.table import Table

    from ..estimate.nccl import nccl_rank_bytes
    from ..estimate.predictor import ALLOCATED_SHARE, Layout
    from ..optim import registry as optim_registry

    par = plan.parallel
    if par.world_size != world:
        fail(
            f"the plan's data {par.data} x tensor {par.tensor} x pipeline {par.pipeline} x "
            f"context {par.context} is "
            f"{par.world_size} processes but --world-size is {world}; give --world-size "
            f"{par.world_size}"
        )
    if (plan.precision.mode != "fp32"
            or plan.checkpointing.mode not in ("none", "full", "selective")
            or not optim_registry.get(plan.optimizer.name).layout):
        layout = ", ".join(s.name for s in optim_registry.specs() if s.layout)
        fail(
            "a tensor/pipeline plan's ranks are dry-run in fp32, with checkpointing none, full or "
            "selective, with "
            f"one of {layout}; for other plans, memfit plan --world-size N --gpus-per-node G with "
            "--plan gives the layout model's per-rank figures"
        )
    with status(f"dry-running the {par.pipeline} pipeline stages of {workload.name}"):
        prediction = run_guarded(Layout().predict, workload, plan, target)
    pred = prediction.extra["layout"]  # each rank's peak and the layout's record
    nccl = run_guarded(nccl_rank_bytes, par, target)
    # On a GPU: the allocator's reserve (the layout replay's share) + context + communicators.
    totals = [
        (-(-int(p) * 100 // round(ALLOCATED_SHARE * 100)) + target.overhead_bytes + n)
        if target.is_cuda else int(p)
        for p, n in zip(pred.peak_bytes, nccl, strict=True)
    ]
    table = Table(title=f"{workload.name}: {plan.summary()} (predicted per rank)")
    device_cols = ("nccl", "device total") if target.is_cuda else ()
    for col in ("rank", "stage", "replica", "chunk", "shard", "peak", *device_cols):
        table.add_column(col, justify="right")
    for r, peak in enumerate(pred.peak_bytes):
        where = par.coordinates(r)
        extra = [format_bytes(nccl[r]), format_bytes(totals[r])] if device_cols else []
        table.add_row(str(r), *(str(where[k]) for k in ("stage", "replica", "chunk", "shard")),
                      format_bytes(peak), *extra)
    show(table)
    if json_path is not None:
        data = {"model": workload.name, "plan": plan.to_dict(), "world_size": world,
                **pred.to_dict(), "predicted_rank_peak_bytes": list(pred.peak_bytes),
                "nccl_bytes": nccl, "predicted_device_total_bytes": totals}
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


def _with_progress(description: str, total: int, fn: Any) -> Any:
    """Run ``fn(progress)`` under a progress bar advanced by ``progress(done, total)``."""
    import torch
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=SETTINGS.quiet) as bar:
        task = bar.add_task(description, total=total)
        try:
            return fn(lambda done, _total: bar.update(task, completed=done))
        except torch.OutOfMemoryError as e:
            bar.stop()
            fail(str(e))


def _print_report(report: Any) -> None:
    meta = report.meta
    mode = "dry run (fake tensors)" if meta.get("dry_run") else "real run"
    backends = {k: v for k, v in meta.get("attention_backends", {}).items() if v}
    attention = (
        "; attention: " + ", ".join(f"{k} x{v}" for k, v in backends.items()) if backends else ""
    )
    out.print(
        f"[bold]{meta.get('model')}[/]: {meta.get('num_parameters', 0):,} parameters, "
        f"{mode}, {meta.get('steps')} steps, target {meta.get('target_device', report.device)}"
        f"{attention}",
        highlight=False,
    )
    show(report.table())
    target = meta.get("target_device", report.device)
    out.print(f"peak: [bold]{format_bytes(report.peak_bytes)}[/] of tensors", highlight=False)
    if report.overhead_bytes or (report.peak_reserved_bytes or 0) > report.peak_bytes:
        out.print(
            f"on {target}: [bold]{format_bytes(report.peak_reserved_bytes or 0)}[/] reserved by "
            f"the caching allocator (model), + {format_bytes(report.overhead_bytes)} CUDA "
            f"context and workspaces = [bold]{format_bytes(report.device_total_bytes)}[/] "
            f"device total (what nvidia-smi shows){_band(meta, 'predicted_device_total_bytes')}",
            highlight=False,
        )


def _band(meta: dict[str, Any], key: str) -> str:
    """`` (-0.5% to +3.1%, measured on GPUs)``: a figure's error band, when it has one."""
    band = (meta.get("error_band") or {}).get(key)
    if not band or (band["low"] == 0 and band["high"] == 0):
        return ""
    return f" ({band['low']:+.1%} to {band['high']:+.1%}, as measured on GPUs)"


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

    from ..estimate.predictor import Measured

    rank, world = init_worker()
    plan = plan or Plan()
    plan = plan.over_processes(world)  # PlanError is a ValueError: the launcher's sentence
    report = Measured(dry=False, steps=max(steps, 3)).predict(workload, plan, None).report
    assert report is not None
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
        console.print(fit_width(table, console))
        if json_path is not None:
            data = {"model": workload.name, "plan": plan.to_dict(), "world_size": world,
                    "ranks": rows, "per_rank_peak_bytes": [r["peak_bytes"] for r in rows]}
            write_text(json_path, json.dumps(data, indent=2) + "\n")
            console.print(f"wrote {json_path} and one report per rank")
    dist.destroy_process_group()
    return rows
