"""``memfit plan``: find the fastest plan whose peak memory fits a budget, and say why."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..console import check_outputs, configure, exit_without_teardown, fail, out, show
from ..outputs import write_text
from ..plan import Plan
from ..units import format_bytes
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
    run_guarded,
)

__all__ = ["plan_command"]

_Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="A preset (gpt2-tiny, llama-1b, ...), a Hugging Face model folder (config.json, "
        "with or without weights) or its config.json, a hub id, or package.module:function.",
    ),
]
_Budget = Annotated[
    str,
    typer.Option(
        "--budget",
        help="Memory budget: 4GiB, 4GB, 4096MiB, 0.5TiB, bytes, or a device name (t4, a100, ...).",
    ),
]
_BatchSize = Annotated[
    int,
    typer.Option(
        "--batch-size", "-b", help="Samples per optimizer step (the effective batch)."
    ),
]
_SeqLen = Annotated[int, typer.Option("--seq-len", "-l", help="Tokens per sample.")]
_Allow = Annotated[
    str,
    typer.Option(
        "--allow",
        help="Comma-separated techniques that change training or need host memory: freeze, "
        "shorter-seq, 8bit, factored, bf16-pure, fp8, offload, lora, qlora.",
    ),
]
_Forbid = Annotated[
    str,
    typer.Option(
        "--forbid",
        help="Comma-separated default techniques to rule out: accumulation, checkpointing, full-checkpointing, mixed-precision, fused-step, foreach-off, fused-loss.",
    ),
]
_Device = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="Target device: its kernels and caching allocator for the dry runs, its speed "
        "for the cost model (cpu, h100, a100, a100-40gb, rtx4090, t4, or a custom GPU "
        "description). Default: the budget's device, else this machine.",
    ),
]
_Base = Annotated[
    Path | None,
    typer.Option("--plan", help="Start from this plan (its optimizer and settings are kept)."),
]
_Json = Annotated[Path | None, typer.Option("--json", help="Write the answer as JSON here.")]
_Save = Annotated[
    Path | None,
    typer.Option(
        "--save", help="Write the chosen plan here (JSON or YAML), for --plan elsewhere."
    ),
]
_HostBudget = Annotated[
    str | None,
    typer.Option(
        "--host-budget",
        help="Host memory the offload tiers may use (4GiB, ...): plans over it do not fit.",
    ),
]
_DiskDir = Annotated[
    Path | None,
    typer.Option(
        "--disk-dir",
        help="With --allow offload: a directory for optimizer state on disk, searched too.",
    ),
]
_Jobs = Annotated[
    int,
    typer.Option(
        "--jobs",
        help="Processes the search may use: 2 lets a worker on a second core run half "
        "of each prediction (same answer, sooner); 1 keeps to this process.",
    ),
]
_Emit = Annotated[
    str | None,
    typer.Option(
        "--emit",
        help="Print Python that runs the plan elsewhere: 'hf' (the Hugging Face Trainer: the "
        "plan, its TrainingArguments and a train(model, train_dataset) function). The answer "
        "is printed above it as comments: the whole output runs as Python (> run_plan.py).",
    ),
]
_LoraRank = Annotated[
    int | None,
    typer.Option(
        "--lora-rank",
        help="With --allow lora or qlora: the adapters' rank (default 16; it changes what "
        "is trained, so it is yours to choose, not searched).",
    ),
]
_WorldSize = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        help="Plan for N data-parallel processes (the budget is per process): chooses the "
        "ZeRO stage too and predicts each rank's peak without launching anything.",
    ),
]
_GpusPerNode = Annotated[
    int | None,
    typer.Option(
        "--gpus-per-node",
        help="With --world-size: devices per node. Searches data x tensor x pipeline "
        "layouts too (tensor parallelism within a node), with the schedule and "
        "micro-batches.",
    ),
]

_ExpertLoad = Annotated[
    float,
    typer.Option(
        "--expert-load",
        help="With --gpus-per-node, mixture-of-experts routing every rank must fit: 1 spreads "
        "tokens evenly; c > 1 gives expert 0 c times its share, and the rank holding it "
        "receives them (a worst case).",
    ),
]

_Maximize = Annotated[
    str | None,
    typer.Option(
        "--maximize",
        help="Find the largest value that fits instead: 'seq-len' (the longest context, at "
        "--batch-size) or 'batch-size' (the largest batch one pass holds, at --seq-len), with "
        "its fastest plan. The other --seq-len/--batch-size is where the search starts.",
    ),
]
_Budgets = Annotated[
    str | None,
    typer.Option(
        "--budgets",
        help="With --maximize: comma-separated budgets (8GiB,16GiB,24GiB,80GiB); prints one "
        "row per budget: budget, longest context (or largest batch), plan, predicted peak.",
    ),
]

_Data = data_option("plan for")
_Tokenizer = TokenizerOption
_TextField = TextFieldOption


def plan_command(
    model: _Model,
    budget: _Budget = None,  # type: ignore[assignment]  # required unless --budgets
    batch_size: _BatchSize = 8,
    seq_len: _SeqLen = 128,
    allow: _Allow = "",
    forbid: _Forbid = "",
    device: _Device = None,
    base: _Base = None,
    json_path: _Json = None,
    save: _Save = None,
    host_budget: _HostBudget = None,
    disk_dir: _DiskDir = None,
    jobs: _Jobs = 2,
    emit: _Emit = None,
    world_size: _WorldSize = None,
    gpus_per_node: _GpusPerNode = None,
    expert_load: _ExpertLoad = 1.0,
    data: _Data = None,
    tokenizer: _Tokenizer = None,
    text_field: _TextField = "text",
    lora_rank: _LoraRank = None,
    quiet: QuietOption = False,
    verbose: VerboseOption = False,
    maximize: _Maximize = None,
    budgets: _Budgets = None,
) -> None:
    """Find the fastest plan whose peak memory fits a budget."""
    # Nothing is left to finish once the answer is printed: the process then exits without
    # the interpreter's teardown, which after a search frees every object its dry runs left
    # behind, module by module (about a quarter of a second), only for the operating system to
    # take the memory back anyway.
    exit_without_teardown()
    configure(quiet=quiet, verbose=verbose)

    if emit is not None and emit != "hf":
        fail(f"--emit {emit!r} is not known; use 'hf' (the Hugging Face Trainer)")

    from ..workload import load_workload

    wanted = _check_maximize(budget, maximize, budgets, world_size, gpus_per_node, data)
    if budgets is not None and (save is not None or emit is not None):
        fail("--save and --emit write one plan; with --budgets there is one per budget: "
             "leave them out, or give one --budget")
    check_sizes(batch_size, seq_len)
    # --disk-dir is written by training under the plan, not here, but must exist by then.
    check_outputs({"--json": json_path, "--save": save}, existing_folders={"--disk-dir": disk_dir})
    base_plan = run_guarded(Plan.load, base) if base is not None else None
    # The optional packages --allow or the plan needs, before any work (planning runs only
    # dry runs: a peer's optimizer has a stand-in there).
    check_extras(allow.split(","), base_plan, where=f"--plan {base}", real=False)
    check_data_options(data, tokenizer, text_field)
    # With --emit, what a person reads becomes comments above the emitted code: the whole
    # output runs as Python (memfit plan ... --emit hf > run_plan.py).
    words = _comment_console() if emit else out
    lengths = None
    if data:
        # The budget must hold for the longest batch the data makes, not a typical one.
        share = max(batch_size // (world_size or 1), 1)
        lengths = data_lengths(data, tokenizer, text_field, share, seq_len, model,
                               console=words)
        seq_len = lengths.max
    workload = run_guarded(load_workload, model, batch_size, seq_len)
    if wanted is not None:
        # The SPEC, not the workload: maximize loads it again at each size it tries.
        _maximize(
            model if lengths is None else workload, wanted, json_path, save, emit,
            budget=budget, budgets=budgets, batch_size=batch_size, seq_len=seq_len,
            allow=allow.split(","), forbid=forbid.split(","), base=base_plan, device=device,
            host_budget=host_budget, disk_dir=None if disk_dir is None else str(disk_dir),
            jobs=jobs, lora_rank=lora_rank,
        )
        return
    result = _search(
        workload,
        budget,
        json_path,
        allow=allow.split(","),
        forbid=forbid.split(","),
        base=base_plan,
        device=device,
        host_budget=host_budget,
        disk_dir=None if disk_dir is None else str(disk_dir),
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        expert_load=expert_load,
        jobs=jobs,
        lora_rank=lora_rank,
    )
    _print_answer(result, words)
    _write_answer(result, json_path, save, emit, lengths, words)


def _search(workload: Any, budget: str, json_path: Path | None, **options: Any) -> Any:
    """The planner's answer, its progress on a status line; when nothing fits, its evidence
    written to ``json_path`` (when given) and the reason as the command's failure."""
    import json

    from ..console import status as status_line
    from ..planner import NothingFits, plan

    with status_line("planning...") as status:
        try:
            return run_guarded(
                plan, workload, budget, progress=lambda msg: status.update(msg), **options
            )
        except NothingFits as e:
            status.stop()
            if json_path is not None:
                write_text(json_path, json.dumps(e.result.to_dict(), indent=2) + "\n")
            fail(str(e))


def _print_answer(result: Any, out: Any = out) -> None:
    """The explanation table, the chosen plan and its predicted peak, memory and step time,
    on ``out`` (with ``--emit``, a console whose lines become Python comments)."""
    from ..planner import explain_table

    if result.layout is not None:
        from ..planner.layout import layout_table

        show(layout_table(result), out)
    else:
        show(explain_table(result), out)
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


def _write_answer(
    result: Any, json_path: Path | None, save: Path | None, emit: str | None, lengths: Any = None,
    out: Any = out,
) -> None:
    """The answer as JSON (with ``--data``'s lengths), the chosen plan as a file, and ``--emit
    hf``'s Python, when asked: then what ``out`` holds is printed first as comments, so that
    the whole output is a Python file (``memfit plan ... --emit hf > run_plan.py``)."""
    import json

    if json_path is not None:
        answer = result.to_dict()
        if lengths is not None:
            answer["data_lengths"] = lengths.to_dict()
        write_text(json_path, json.dumps(answer, indent=2) + "\n")
        out.print(f"wrote {json_path}")
    if save is not None:
        if save.suffix.lower() in (".yaml", ".yml"):
            result.plan.to_yaml(save)
        else:
            result.plan.to_json(save)
        out.print(f"wrote {save}")
    if emit == "hf":
        from ..integrations.hf import emit as emit_hf

        print(_as_comments(out) + emit_hf(result.plan), end="")


def _comment_console() -> Any:
    """A console that keeps what it is given (plain text, two columns narrower than standard
    output, for the ``# `` each line gets)."""
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=max(out.width - 2, 40), highlight=False)


def _as_comments(console: Any) -> str:
    """What a :func:`_comment_console` holds, each line a Python comment (``""`` for another
    console)."""
    import io

    if not isinstance(console.file, io.StringIO):
        return ""
    lines = console.file.getvalue().splitlines()
    return "".join(f"# {line.rstrip()}".rstrip() + "\n" for line in lines) + ("\n" if lines else "")


def _stages_line(result: Any) -> str:
    """Each pipeline stage's ranks and their largest predicted peak, in one line."""
    par = result.plan.parallel
    per = par.data * par.tensor * par.context  # a stage's ranks are consecutive
    peaks = result.rank_peak_bytes
    return ", ".join(
        f"stage {s} (ranks {s * per}-{s * per + per - 1}) {format_bytes(max(peaks[s * per:(s + 1) * per]))}"
        for s in range(par.pipeline)
    )


def _check_maximize(
    budget: str | None,
    maximize: str | None,
    budgets: str | None,
    world_size: int | None,
    gpus_per_node: int | None,
    data: Any,
) -> str | None:
    """``--maximize`` and ``--budgets`` checked before any work (one sentence and exit 2 for
    a bad one): what is maximized (``seq_len``, ``batch_size``, ``None``)."""
    from ..planner.maximize import parse_what
    from ..targets import parse_budget

    if budget is None and budgets is None:
        fail("--budget is required: a size such as 24GiB, or a device name (t4, a100, ...)")
    wanted = None if maximize is None else run_guarded(parse_what, maximize)
    if budgets is not None:
        if wanted is None:
            fail("--budgets asks for the longest context (or largest batch) per budget; add "
                 "--maximize seq-len or --maximize batch-size, or give one --budget")
        if budget is not None:
            fail("give --budget or --budgets, not both")
        names = [b.strip() for b in budgets.split(",")]
        if not all(names):
            fail(f"--budgets {budgets!r} has an empty entry; give sizes separated by commas, "
                 "such as 8GiB,16GiB,24GiB")
        for name in names:
            run_guarded(parse_budget, name)
    if wanted is not None and (world_size is not None or gpus_per_node is not None):
        fail("--maximize searches one process; leave out --world-size and --gpus-per-node")
    if wanted == "seq_len" and data:
        fail("--data fixes the sequence length at its longest batch, which --maximize seq-len "
             "searches; leave out --data (or use --maximize batch-size)")
    return wanted


def _maximize(
    model: Any,
    what: str,
    json_path: Path | None,
    save: Path | None,
    emit: str | None,
    *,
    budget: str | None,
    budgets: str | None,
    **options: Any,
) -> None:
    """``--maximize``: the largest value per budget, its plan printed (a table with
    ``--budgets``) and written as asked (``maximized`` in the JSON: see
    :meth:`memfit.planner.maximize.Maximized.to_dict` and
    :func:`memfit.planner.maximize.budgets_json`)."""
    import json

    from ..console import fit_width, status
    from ..planner import NothingFits
    from ..planner.maximize import budgets_json, budgets_table, maximize, maximize_budgets

    with status("maximizing...") as line:
        progress = lambda msg: line.update(msg)  # noqa: E731
        if budgets is None:
            try:
                found = run_guarded(maximize, model, budget, what=what, progress=progress,
                                    **options)
            except NothingFits as e:
                if json_path is not None:
                    write_text(json_path, json.dumps(e.result.to_dict(), indent=2) + "\n")
                fail(str(e))
        else:
            names = [b.strip() for b in budgets.split(",")]
            answers = run_guarded(maximize_budgets, model, names, what=what, progress=progress,
                                  **options)
    if budgets is None:
        _print_answer(found.result)
        out.print(f"[bold]{found.sentence()}[/] (searched in {found.seconds:.1f} s: "
                  f"{found.plan_calls} planner calls, {found.predictions} predictions)",
                  highlight=False)
        if json_path is not None:
            write_text(json_path, json.dumps(found.to_dict(), indent=2) + "\n")
            out.print(f"wrote {json_path}")
        _write_answer(found.result, None, save, emit)
        return
    # The table is the answer here: laid out for the width there is, shown under --quiet too.
    out.print(fit_width(budgets_table(names, answers, what), out))
    if json_path is not None:
        write_text(json_path, json.dumps(budgets_json(names, answers, what), indent=2) + "\n")
        out.print(f"wrote {json_path}")
