"""The ``memfit`` command line: thin wrappers over the Python API."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer

from . import console
from .console import check_outputs, err, fail, out, quiet_libraries
from .outputs import make_parent, write_text

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
app.add_typer(bench_app, name="bench")

_fail = fail
_quiet_libraries = quiet_libraries


def _run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn``; turn bad input into one sentence and exit 2, a model's failure into exit 1."""
    from .estimate.dryrun import ModelError
    from .plan import PlanError
    from .workload import WorkloadError

    try:
        return fn(*args, **kwargs)
    except (WorkloadError, PlanError) as e:
        _fail(str(e))
    except ModelError as e:
        if os.environ.get("MEMFIT_DEBUG"):
            traceback.print_exception(e.__cause__)
        _fail(f"{e} (set MEMFIT_DEBUG=1 for its traceback)", code=1)
    except ValueError as e:
        _fail(str(e))


def _check_sizes(batch_size: int, seq_len: int, steps: int = 1) -> None:
    for flag, value in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--steps", steps)):
        if value < 1:
            _fail(f"{flag} must be a whole number >= 1, got {value}")


def _parse_cap(cap: str | None) -> int | None:
    if cap is None:
        return None
    from .units import parse_size

    try:
        return parse_size(cap)
    except ValueError as e:
        _fail(f"--cap: {e}")


@app.command()
def profile(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Preset name, path to a HF config.json, or package.module:function.",
        ),
    ],
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Samples per step.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", "-l", help="Tokens per sample.")] = 128,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Run on fake tensors: nothing is allocated.")
    ] = False,
    steps: Annotated[int, typer.Option("--steps", help="Full training steps to run.")] = 2,
    plan: Annotated[
        Path | None, typer.Option("--plan", help="A saved plan (JSON or YAML) to apply.")
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON here.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of memory over the step here.")
    ] = None,
    cap: Annotated[
        str | None,
        typer.Option("--cap", help="Virtual memory cap (e.g. 4GiB): fail like a GPU would."),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Modules to list.")] = 8,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="Target device whose memory to reproduce: h100, a100, a100-40gb, rtx4090, t4, "
            "cpu, or a custom GPU (a JSON/YAML file, or name=...,memory=...,mem_bandwidth=...,"
            "host_bandwidth=...,compute_capability=...,bf16=...). Default: this machine.",
        ),
    ] = None,
    expert_load: Annotated[
        float,
        typer.Option(
            "--expert-load",
            help="With --dry-run, mixture-of-experts routing: 1 spreads tokens evenly; c > 1 "
            "gives one expert c times its share (a worst case).",
        ),
    ] = 1.0,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="With --dry-run: predict each of N data-parallel processes (the plan's ZeRO "
            "stage, stage 0 by default) without launching them; --batch-size is the global batch.",
        ),
    ] = None,
) -> None:
    """Measure where a training step's memory goes, by category, phase and module."""
    _quiet_libraries()
    from .estimate.dryrun import measure
    from .plan import Plan
    from .workload import load_workload

    _check_sizes(batch_size, seq_len, steps)
    check_outputs({"--json": json_path, "--plot": plot})
    if top < 0:
        _fail(f"--top must be a whole number >= 0, got {top}")
    cap_bytes = _parse_cap(cap)
    from .targets import get_device

    target = _run_guarded(get_device, device)
    the_plan = _run_guarded(Plan.load, plan) if plan is not None else None
    workload = _run_guarded(load_workload, model, batch_size, seq_len)
    if world_size is not None:
        _profile_ranks(workload, the_plan, world_size, dry_run, steps, target, json_path)
        return
    from .distributed.launch import under_launcher

    if under_launcher() and not dry_run:
        from .distributed.profile import profile_under_launcher

        _run_guarded(profile_under_launcher, workload, the_plan, steps, json_path, out)
        return
    report = _with_progress(
        f"{'dry-running' if dry_run else 'running'} {workload.name} "
        f"(batch {batch_size}, length {seq_len}) for {target.name}",
        steps,
        lambda progress: _run_guarded(
            measure,
            workload,
            the_plan,
            steps=steps,
            dry=dry_run,
            cap=cap_bytes,
            device=target,
            progress=progress,
            expert_load=expert_load,
        ),
    )
    _print_report(report)
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
        report.plot(
            plot, title=f"memfit profile: {workload.name}, batch {batch_size}, length {seq_len}"
        )
        out.print(f"wrote {plot}")


def _profile_ranks(
    workload: Any, plan: Any, world: int, dry: bool, steps: int, target: Any, json_path: Any
) -> None:
    """``memfit profile --dry-run --world-size N``: every rank's predicted memory, a table of
    rank x category and, with ``--json``, one JSON with each rank's peak and categories."""
    import json

    from rich.table import Table

    from .estimate.distributed import predict_ranks
    from .plan import Plan
    from .units import format_bytes

    if not dry:
        _fail(
            "--world-size predicts processes without launching them and needs --dry-run; to "
            "measure real processes, run memfit train --nproc-per-node N"
        )
    if isinstance(world, bool) or world < 1:
        _fail(f"--world-size must be a whole number >= 1, got {world}")
    plan = plan or Plan()
    if plan.parallel.tensor > 1 or plan.parallel.pipeline > 1:
        _profile_layout(workload, plan, world, json_path)
        return
    if plan.parallel.data == 1:
        plan = plan.replace(parallel=dataclasses.replace(plan.parallel, data=world))
    elif plan.parallel.data != world:
        _fail(f"the plan is for {plan.parallel.data} processes but --world-size is {world}")
    with err.status(f"dry-running {world} ranks of {workload.name}"):
        pred = _run_guarded(predict_ranks, workload, plan, steps=max(steps, 3), device=target)
    categories = [c for c in next(iter(pred.reports.values())).peak_by_category]
    table = Table(title=f"{workload.name}: {plan.summary()} (predicted per rank)")
    for col in ["rank", "peak", *categories]:
        table.add_column(col, justify="right")
    for r in range(world):
        rep = pred.reports.get(r)
        cells = [format_bytes(rep.peak_by_category.get(c, 0)) if rep else "as rank 0" for c in categories]
        table.add_row(str(r), format_bytes(pred.peak_bytes[r]), *cells)
    out.print(table)
    if json_path is not None:
        data = {"model": workload.name, "plan": plan.to_dict(), "world_size": world, **pred.to_dict()}
        data["reports"] = {str(r): rep.to_dict(max_points=200) for r, rep in pred.reports.items()}
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


def _profile_layout(workload: Any, plan: Any, world: int, json_path: Any) -> None:
    """``memfit profile --dry-run --world-size N`` for a tensor/pipeline plan: each rank's
    predicted peak from dry runs of its own program (:func:`memfit.estimate.layout.
    predict_layout`)."""
    import json

    from rich.table import Table

    from .estimate.layout import predict_layout
    from .optim import registry as optim_registry
    from .units import format_bytes

    par = plan.parallel
    if par.world_size != world:
        _fail(
            f"the plan's data {par.data} x tensor {par.tensor} x pipeline {par.pipeline} is "
            f"{par.world_size} processes but --world-size is {world}; give --world-size "
            f"{par.world_size}"
        )
    if (plan.precision.mode != "fp32" or plan.checkpointing.mode != "none"
            or not optim_registry.get(plan.optimizer.name).layout):
        layout = ", ".join(s.name for s in optim_registry.specs() if s.layout)
        _fail(
            "a tensor/pipeline plan's ranks are dry-run in fp32 without checkpointing, with "
            f"one of {layout}; for other plans, memfit plan --world-size N --gpus-per-node G with "
            "--plan gives the layout model's per-rank figures"
        )
    with err.status(f"dry-running the {par.pipeline} pipeline stages of {workload.name}"):
        pred = _run_guarded(predict_layout, workload, par, optimizer=plan.optimizer)
    table = Table(title=f"{workload.name}: {plan.summary()} (predicted per rank)")
    for col in ("rank", "stage", "replica", "shard", "peak"):
        table.add_column(col, justify="right")
    for r, peak in enumerate(pred.peak_bytes):
        where = par.coordinates(r)
        table.add_row(str(r), *(str(where[k]) for k in ("stage", "replica", "shard")),
                      format_bytes(peak))
    out.print(table)
    if json_path is not None:
        data = {"model": workload.name, "plan": plan.to_dict(), "world_size": world,
                **pred.to_dict(), "predicted_rank_peak_bytes": list(pred.peak_bytes)}
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


@app.command("plan")
def plan_command(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Preset name, path to a HF config.json, or package.module:function.",
        ),
    ],
    budget: Annotated[
        str,
        typer.Option(
            "--budget",
            help="Memory budget: 4GiB, 4GB, 4096MiB, 0.5TiB, bytes, or a device name (t4, a100, ...).",
        ),
    ],
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size", "-b", help="Samples per optimizer step (the effective batch)."
        ),
    ] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", "-l", help="Tokens per sample.")] = 128,
    allow: Annotated[
        str,
        typer.Option(
            "--allow",
            help="Comma-separated techniques that change training or need host memory: freeze, "
            "shorter-seq, 8bit, factored, bf16-pure, offload.",
        ),
    ] = "",
    forbid: Annotated[
        str,
        typer.Option(
            "--forbid",
            help="Comma-separated default techniques to rule out: accumulation, checkpointing, full-checkpointing, mixed-precision, fused-step, foreach-off, fused-loss.",
        ),
    ] = "",
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="Target device: its kernels and caching allocator for the dry runs, its speed "
            "for the cost model (cpu, h100, a100, a100-40gb, rtx4090, t4, or a custom GPU "
            "description). Default: the budget's device, else this machine.",
        ),
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option("--plan", help="Start from this plan (its optimizer and settings are kept)."),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the answer as JSON here.")
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save", help="Write the chosen plan here (JSON or YAML), for --plan elsewhere."
        ),
    ] = None,
    host_budget: Annotated[
        str | None,
        typer.Option(
            "--host-budget",
            help="Host memory the offload tiers may use (4GiB, ...): plans over it do not fit.",
        ),
    ] = None,
    disk_dir: Annotated[
        Path | None,
        typer.Option(
            "--disk-dir",
            help="With --allow offload: a directory for optimizer state on disk, searched too.",
        ),
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            help="Processes the search may use: 2 lets a worker on a second core run half "
            "of each prediction (same answer, sooner); 1 keeps to this process.",
        ),
    ] = 2,
    emit: Annotated[
        str | None,
        typer.Option(
            "--emit",
            help="Also print how to run the plan elsewhere: 'hf' (TrainingArguments lines and "
            "the code for the Hugging Face Trainer).",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="Plan for N data-parallel processes (the budget is per process): chooses the "
            "ZeRO stage too and predicts each rank's peak without launching anything.",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            "--gpus-per-node",
            help="With --world-size: devices per node. Searches data x tensor x pipeline "
            "layouts too (tensor parallelism within a node), with the schedule and "
            "micro-batches.",
        ),
    ] = None,
) -> None:
    """Find the fastest plan whose peak memory fits a budget."""
    global _QUICK_EXIT
    _QUICK_EXIT = True
    _quiet_libraries()
    import json

    if emit is not None and emit != "hf":
        _fail(f"--emit {emit!r} is not known; use 'hf' (the Hugging Face Trainer)")

    from .plan import Plan
    from .planner import NothingFits, explain_table, plan
    from .units import format_bytes
    from .workload import load_workload

    _check_sizes(batch_size, seq_len)
    # --disk-dir is written by training under the plan, not here, but must exist by then.
    check_outputs({"--json": json_path, "--save": save}, existing_folders={"--disk-dir": disk_dir})
    base_plan = _run_guarded(Plan.load, base) if base is not None else None
    workload = _run_guarded(load_workload, model, batch_size, seq_len)
    from rich.status import Status

    with Status("planning...", console=err) as status:
        try:
            result = _run_guarded(
                plan,
                workload,
                budget,
                allow=allow.split(","),
                forbid=forbid.split(","),
                base=base_plan,
                device=device,
                progress=lambda msg: status.update(msg),
                host_budget=host_budget,
                disk_dir=None if disk_dir is None else str(disk_dir),
                world_size=world_size,
                gpus_per_node=gpus_per_node,
                jobs=jobs,
            )
        except NothingFits as e:
            status.stop()
            if json_path is not None:
                write_text(json_path, json.dumps(e.result.to_dict(), indent=2) + "\n")
            _fail(str(e))
    if result.layout is not None:
        from .planner.layout import layout_table

        out.print(layout_table(result))
    else:
        out.print(explain_table(result))
    cats = ", ".join(
        f"{k} {format_bytes(v)}" for k, v in result.predicted_peak_by_category.items() if v
    )
    total = ""
    if result.predicted_device_total_bytes > result.predicted_peak_bytes:
        total = (
            f"[bold]on {result.device}:[/] {format_bytes(result.predicted_peak_reserved_bytes)} "
            f"reserved by the caching allocator, "
            f"{format_bytes(result.predicted_device_total_bytes)} device total with the CUDA "
            f"context (fitted into {format_bytes(result.budget_bytes)})\n"
        )
    if result.predicted_host_bytes:
        total += f"[bold]on the host:[/] {format_bytes(result.predicted_host_bytes)} at its peak\n"
    out.print(
        f"[bold]plan:[/] {result.plan.summary()}\n"
        f"[bold]predicted peak:[/] {format_bytes(result.predicted_peak_bytes)} of tensors "
        f"({cats})\n{total}"
        f"[bold]predicted step time:[/] {result.predicted_step_time_ratio:.2f}x "
        + ("the ideal (the work spread evenly, no bubble, no communication)"
           if result.layout is not None else "the unoptimised plan")
        + f" (cost model: {result.device}); searched in {result.seconds:.1f} s",
        highlight=False,
    )
    if result.layout is not None and result.rank_peak_bytes is not None:
        out.print("[bold]per stage:[/] " + _stages_line(result), highlight=False)
    elif result.rank_peak_bytes is not None:
        out.print(
            "[bold]per process:[/] "
            + ", ".join(f"rank {r} {format_bytes(b)}" for r, b in enumerate(result.rank_peak_bytes[:8]))
            + (f", ... ({len(result.rank_peak_bytes)} ranks)" if len(result.rank_peak_bytes) > 8 else ""),
            highlight=False,
        )
    if json_path is not None:
        write_text(json_path, json.dumps(result.to_dict(), indent=2) + "\n")
        out.print(f"wrote {json_path}")
    if save is not None:
        make_parent(save)
        if save.suffix.lower() in (".yaml", ".yml"):
            result.plan.to_yaml(save)
        else:
            result.plan.to_json(save)
        out.print(f"wrote {save}")
    if emit == "hf":
        from .integrations.hf import emit as emit_hf

        print(emit_hf(result.plan), end="")


def _stages_line(result: Any) -> str:
    """Each pipeline stage's ranks and their largest predicted peak, in one line."""
    from .units import format_bytes

    par = result.plan.parallel
    per = par.data * par.tensor
    peaks = result.rank_peak_bytes
    return ", ".join(
        f"stage {s} (ranks {s * per}-{s * per + per - 1}) {format_bytes(max(peaks[s * per:(s + 1) * per]))}"
        for s in range(par.pipeline)
    )


@bench_app.command("ladder")
def bench_ladder(
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the rows as JSON here.")
    ] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Workload SPEC.")] = "bert-large",
    batch_size: Annotated[int, typer.Option("--batch-size", "-b")] = 32,
    seq_len: Annotated[int, typer.Option("--seq-len", "-l")] = 128,
    compute_depth: Annotated[
        int, typer.Option("--compute-depth", help="Blocks of the reduced model timed on CPU.")
    ] = 2,
    compute_seq: Annotated[
        int,
        typer.Option("--compute-seq", help="Sequence length of the reduced model timed on CPU."),
    ] = 32,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Write the table as Markdown here.")
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="Target device of the peaks (h100, a100, a100-40gb, rtx4090, t4, cpu, or a "
            "custom GPU description). GPU targets add reserved and device-total peaks and the "
            "cost model's compute ratio.",
        ),
    ] = "cpu",
    only: Annotated[
        str,
        typer.Option(
            "--only",
            help="Comma-separated rung names to run (the baseline always runs), e.g. "
            "'baseline + fused loss'.",
        ),
    ] = "",
) -> None:
    """Reproduce and extend the published BERT-large strategy ladder."""
    _quiet_libraries()
    import json

    from rich.status import Status

    from .bench.ladder import ladder_markdown, ladder_table, run_ladder

    _check_sizes(batch_size, seq_len)
    check_outputs({"--json": json_path, "--markdown": markdown})
    for flag, value in (("--compute-depth", compute_depth), ("--compute-seq", compute_seq)):
        if value < 1:
            _fail(f"{flag} must be a whole number >= 1, got {value}")
    from .targets import get_device

    target = _run_guarded(get_device, device)
    with Status("ladder...", console=err) as status:
        rows = _run_guarded(
            run_ladder,
            model,
            batch_size=batch_size,
            seq_len=seq_len,
            short_seq=max(1, seq_len // 2),
            compute_depth=compute_depth,
            compute_seq=compute_seq,
            device=target,
            progress=lambda msg: status.update(msg),
            only=[n.strip() for n in only.split(",") if n.strip()] or None,
        )
    out.print(ladder_table(rows))
    if json_path is not None:
        write_text(json_path, json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
        out.print(f"wrote {json_path}")
    if markdown is not None:
        write_text(markdown, ladder_markdown(rows) + "\n")
        out.print(f"wrote {markdown}")


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
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        try:
            return fn(lambda done, _total: bar.update(task, completed=done))
        except torch.OutOfMemoryError as e:
            bar.stop()
            _fail(str(e))


def _print_report(report: Any) -> None:
    from .units import format_bytes

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
    out.print(report.table())
    target = meta.get("target_device", report.device)
    out.print(f"peak: [bold]{format_bytes(report.peak_bytes)}[/] of tensors", highlight=False)
    if report.overhead_bytes or (report.peak_reserved_bytes or 0) > report.peak_bytes:
        out.print(
            f"on {target}: [bold]{format_bytes(report.peak_reserved_bytes or 0)}[/] reserved by "
            f"the caching allocator (model), + {format_bytes(report.overhead_bytes)} CUDA "
            f"context and workspaces = [bold]{format_bytes(report.device_total_bytes)}[/] "
            "device total (what nvidia-smi shows)",
            highlight=False,
        )


def _register_train() -> None:
    # The train command lives with the trainer (memfit/train/command.py); the CLI only names it
    # (train/command.py imports nothing from here: shared helpers are in memfit/console.py).
    from .train.command import train

    app.command("train")(train)


_register_train()


#: Set by a command that leaves nothing to finish once it returns (``plan``): the process
#: then exits without the interpreter's teardown, which after a search frees every object
#: its dry runs left behind, module by module (about a quarter of a second), only for the
#: operating system to take the memory back anyway.
_QUICK_EXIT = False


def main() -> None:
    """Entry point of the ``memfit`` command."""
    console._QUICK_EXIT[0] = False
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except SystemExit as e:
        if _QUICK_EXIT or console._QUICK_EXIT[0]:
            _exit_now(e.code)
        raise
    if console._QUICK_EXIT[0]:  # a command that returned normally (typer's standalone mode off)
        _exit_now(0)


def _exit_now(code: Any) -> None:
    """Flush the output and end the process with ``code`` at once (see :data:`_QUICK_EXIT`);
    files were written and closed by the command itself."""
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else int(code))


if __name__ == "__main__":
    main()
