"""``memfit train``: plan for a memory budget, then train a causal LM on text under that plan.

A thin command over the Python API: the options and the ``--config`` YAML file make a
:class:`~memfit.train.config.TrainConfig`, :func:`~memfit.train.run.prepare_run` builds the run
(model, text, plan) and its :class:`~memfit.train.Trainer` trains. With no arguments it trains
memfit's built-in ``byte-gpt`` on the Python standard library's sources under a 48 MiB budget.

:mod:`memfit.cli` registers it (``app.command("train")(train)``); it imports nothing from there
(the consoles and the failure rule it shares with the other commands are in
:mod:`memfit.console`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn

import torch
import typer
import typer.core

from ..outputs import check_outputs as check_paths
from ..outputs import write_text
from ..train.config import ConfigError, TrainConfig, field_help
from ..train.layout_run import check_layout_run, is_layout_plan
from ..train.lock import hold
from ..train.manifest import CheckpointError
from ..train.resume import ResumePoint, resume_point
from ..train.run import TrainRun, prepare_run
from ..train.stopping import Interrupted, StopRequested, catch_signals, exit_code
from ..train.trainer import TrainingDiverged
from ..workload import WorkloadError
from .checks import QuietOption, VerboseOption, check_extras

__all__ = ["TrainCommand", "build_config", "train"]


class TrainCommand(typer.core.TyperCommand):
    """``memfit train``'s click command: ``--resume`` is a flag that may take a word after it
    (``--resume latest-good``), which click's flags cannot; the word is moved into the hidden
    ``--resume-mode`` option before parsing."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, resume_word(args))


def resume_word(args: list[str]) -> list[str]:
    """``args`` with ``--resume WORD`` written as ``--resume --resume-mode WORD`` (a word not
    starting with a dash; an unknown one is refused by the config's check, in one
    sentence)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        out.append(args[i])
        if args[i] == "--resume" and i + 1 < len(args) and not args[i + 1].startswith("-"):
            out += ["--resume-mode", args[i + 1]]
            i += 1
        elif args[i].startswith("--resume="):
            out[-1:] = ["--resume", "--resume-mode", args[i].split("=", 1)[1]]
        i += 1
    return out


def _help(name: str, note: str = "overrides the config") -> str:
    """The option's help: the first sentence of the config field's docstring, and a note."""
    text = field_help(name)
    first = text.split(". ")[0].rstrip(".")
    return f"{first} ({note})." if first else note


# ---------------------------------------------------------------------------------- command
def train(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="A YAML run file whose keys are TrainConfig's fields (model, data, tokenizer, batch_size, seq_len, max_steps, lr, budget, ...).")] = None,
    model: Annotated[str | None, typer.Option("--model", metavar="SPEC", help="A preset (byte-gpt, gpt2-tiny, llama-1b, ...) or a config.json, trained from random weights; or a Hugging Face model folder (config.json and safetensors) or hub id, fine-tuned from its weights (overrides the config).")] = None,
    data: Annotated[list[Path] | None, typer.Option("--data", metavar="FILE", help="A .txt, .jsonl, .json, .csv or .parquet file: text, chat messages or prompt/completion records; repeat for more (overrides the config).")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", metavar="PATH", help="A tokenizer folder (read by transformers' AutoTokenizer) or a tokenizer.json; default: the model folder's own tokenizer, else memfit's byte tokenizer (overrides the config).")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help=_help("batch_size", "default 16"))] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help=_help("seq_len", "default 128"))] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help=_help("max_steps"))] = None,
    seed: Annotated[int | None, typer.Option("--seed", help=_help("seed", "default 0"))] = None,
    budget: Annotated[str | None, typer.Option("--budget", help=_help("budget", "e.g. 48MiB, 4GiB, t4"))] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    cap: Annotated[str | None, typer.Option("--cap", help=_help("cap", "e.g. 48MiB"))] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the run's memory here.")] = None,
    plan_path: Annotated[Path | None, typer.Option("--plan", help=_help("plan", "a saved plan file"))] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help=_help("checkpoint_dir"))] = None,
    save_every: Annotated[int | None, typer.Option("--save-every", help=_help("checkpoint_every", "needs --checkpoint-dir"))] = None,
    keep: Annotated[int | None, typer.Option("--keep", help=_help("keep_checkpoints", "default 3"))] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint in --checkpoint-dir (refused, with the remedies, when it is damaged); --resume latest-good continues from the newest whole one, passing over damaged ones. The checkpoint is verified before any work.")] = False,
    resume_mode: Annotated[str | None, typer.Option("--resume-mode", hidden=True, help="The word after --resume (latest or latest-good); memfit rewrites '--resume WORD' into it.")] = None,
    resume_from: Annotated[Path | None, typer.Option("--resume-from", metavar="PATH", help=_help("resume_from", "new checkpoints go to --checkpoint-dir, by default PATH's folder"))] = None,
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", help=_help("nproc_per_node", "started through torch's elastic launcher"))] = None,
    text_field: Annotated[str | None, typer.Option("--text-field", help=_help("text_field", "default text"))] = None,
    eval_max_batches: Annotated[int | None, typer.Option("--eval-max-batches", help=_help("eval_max_batches", "default 16, the tokens of 16 training steps; 0: the whole held-out split"))] = None,
    quiet: QuietOption = False,
    verbose: VerboseOption = False,
) -> None:
    """Train a causal LM on text under a memory budget: plan, train, report memory.

    SIGTERM or Ctrl-C (SIGINT) stops the run at the next step or evaluation batch (data
    preparation at the next record), saves a checkpoint when there is a checkpoint folder,
    prints and writes the results, and exits with 128 + the signal: 143 after SIGTERM, 130
    after SIGINT. A second signal stops at once. Other exit codes: 0 done, 1 out of memory or
    a diverged loss, 2 bad input.
    """
    from ..console import check_outputs, configure, fail
    from ..distributed.launch import under_launcher, worker_world_size

    configure(quiet=quiet, verbose=verbose)
    check_outputs({"--json": json_path, "--plot": plot}, {"--checkpoint-dir": checkpoint_dir})
    flags = {
        "model": model,
        "data": [str(p) for p in data] if data else None,
        "tokenizer": tokenizer,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "max_steps": max_steps,
        "seed": seed,
        "budget": budget,
        "cap": cap,
        "plan": str(plan_path) if plan_path else None,
        "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None,
        "checkpoint_every": save_every,
        "keep_checkpoints": keep,
        "resume": resume_mode if resume_mode is not None else (resume or None),
        "resume_from": str(resume_from) if resume_from else None,
        "nproc_per_node": nproc_per_node,
        "text_field": text_field,
        "eval_max_batches": eval_max_batches,
    }
    world = worker_world_size()
    if world > 1 and nproc_per_node is None:
        flags["nproc_per_node"] = world  # started by torchrun directly
    try:
        settings = build_config(config, {k: v for k, v in flags.items() if v is not None})
        # The optional packages the run needs (--allow's techniques, the plan's), before any
        # process starts or any work is done.
        check_extras(settings.allow, settings.load_plan(), where=_plan_source(plan_path, config))
        _check_plan_degree(settings)  # before any process starts (and again in each, harmless)
        _check_config_outputs(settings, config, given_checkpoint_dir=checkpoint_dir is not None)
        if under_launcher() and settings.nproc_per_node != world:
            raise ValueError(
                f"--nproc-per-node {settings.nproc_per_node} differs from the launcher's "
                f"{world} processes; give one or the other"
            )
    except (WorkloadError, ValueError) as e:
        fail(str(e))
    # One writer per checkpoint folder, taken before any work and held to the end (launched
    # processes inherit it); then the checkpoint to resume, verified.
    try:
        with hold(settings.checkpoint_dir):
            # Rank 0 (or the launcher) verifies; every process's load verifies its own again.
            point = (
                resume_point(settings.checkpoint_dir, settings.resume, settings.resume_from)
                if os.environ.get("RANK", "0") == "0"
                else None
            )
            _run(settings, world, point, plot=plot, json_path=json_path, argv=_argv(locals()))
    except CheckpointError as e:
        fail(str(e))


def _run(
    settings: TrainConfig, world: int, point: ResumePoint | None, *, plot: Path | None,
    json_path: Path | None, argv: list[str],
) -> None:
    """The run, with the checkpoint folder held: launch the processes, or train in this one."""
    from ..console import err, out
    from ..distributed.launch import under_launcher

    if settings.nproc_per_node > 1 and not under_launcher():
        _launch(settings.nproc_per_node, argv)
    if point is not None and int(os.environ.get("RANK", "0")) == 0:
        out.print(point.describe(), highlight=False)
    if world > 1:
        given = settings.load_plan()
        if is_layout_plan(given):
            assert given is not None
            code = _work_layout(settings, given, world, plot=plot, json_path=json_path, out=out,
                                err=err)
        else:
            code = _work_data_parallel(settings, world, plot=plot, json_path=json_path, out=out,
                                       err=err)
    else:
        code = _work(settings, 0, world, plot=plot, json_path=json_path, out=out, err=err)
    if code:
        raise typer.Exit(code)


def _launch(nproc: int, argv: list[str]) -> NoReturn:
    """Run ``argv`` in ``nproc`` processes and end with their outcome: 0, 1 for a failure
    (named), or the stop code (143, 130) when a signal stopped them."""
    from ..console import fail
    from ..distributed.launch import ProcessesStopped, launch

    try:
        failed = launch(nproc, argv)
    except ProcessesStopped as e:
        raise typer.Exit(e.code) from None  # the processes printed how they stopped
    if failed is not None:
        fail(failed, code=1)
    raise typer.Exit(0)


def _work_data_parallel(
    settings: TrainConfig, world: int, *, plot: Path | None, json_path: Path | None, out: Any,
    err: Any,
) -> int:
    """:func:`_work` in one of ``world`` launched processes: join the group, train, leave."""
    from ..console import exit_without_teardown
    from ..distributed.launch import finish_worker, init_worker

    given = settings.load_plan()
    rank = init_worker(given.parallel.backend if given is not None else None)[0]
    try:
        code = _work(settings, rank, world, plot=plot, json_path=json_path, out=out, err=err)
        _all_done()
    except BaseException:
        finish_worker(ok=False)
        raise
    finish_worker()
    exit_without_teardown()
    return code


def _all_done() -> None:
    """Wait until every process has written its results: one that exits with a stop code
    (143) makes the launcher end the others, since a non-zero exit is a failure to it."""
    import torch.distributed as dist

    dist.barrier()


def _launched() -> bool:
    """Whether torch's launcher started this process (it forwards signals to it)."""
    from ..distributed.launch import under_launcher

    return under_launcher()


@contextlib.contextmanager
def _hard_stop(err: Any) -> Iterator[None]:
    """A second signal (:class:`~memfit.train.stopping.Interrupted`) ends the command at once
    with its own code (typer would turn the ``KeyboardInterrupt`` into exit code 1)."""
    try:
        yield
    except Interrupted as e:
        err.print(f"interrupted by {e}; no checkpoint was written for it", highlight=False)
        raise typer.Exit(e.code) from None


def _stopped_early(err: Any, e: StopRequested) -> NoReturn:
    """End the command for a signal that came before training: a line, the signal's code."""
    err.print(f"{e}; nothing was trained", highlight=False)
    raise typer.Exit(e.code)


def _work(
    settings: TrainConfig, rank: int, world: int, *, plot: Path | None, json_path: Path | None,
    out: Any, err: Any,
) -> int:
    """Plan, train and report in this process (one of ``world``); returns the exit code:
    0, or ``128 + signal`` when a signal stopped the run (after the results are written)."""
    with catch_signals(second_interrupts=not _launched()) as stop, _hard_stop(err):
        _train_and_report(settings, rank, world, plot=plot, json_path=json_path, out=out, err=err)
        return exit_code(stop.signum)


def _train_and_report(
    settings: TrainConfig, rank: int, world: int, *, plot: Path | None, json_path: Path | None,
    out: Any, err: Any,
) -> None:
    from ..console import SETTINGS, fail, status

    if rank != 0:  # one voice: the other processes print only their errors
        out, err = _quiet(out), _quiet(err)
    try:
        # Planner progress goes to a transient status line: it is noise once a plan is chosen.
        with status("preparing the run") as line:
            run = prepare_run(settings, say=lambda m: line.update(str(m)), world_size=world)
    except (WorkloadError, ValueError) as e:
        fail(str(e))
    except StopRequested as e:
        _stopped_early(err, e)
    _print_plan(out, run)
    try:
        result = run.trainer(report_png=plot if rank == 0 else None, console=err,
                             progress=rank == 0 and not SETTINGS.quiet).fit()
    except (torch.OutOfMemoryError, TrainingDiverged) as e:
        fail(str(e), code=1)
    except (WorkloadError, ValueError) as e:
        fail(str(e))
    except StopRequested as e:
        _stopped_early(err, e)
    peaks = _gather_peaks(result.peak_bytes, world)
    _print_result(out, run, result)
    if world > 1:
        out.print("per-process peaks: " + ", ".join(_fmt(p) for p in peaks), highlight=False)
    if plot is not None and rank == 0:
        out.print(f"wrote {plot}")
    if json_path is not None and rank == 0:
        data = _result_json(run, result)
        data.update(world_size=world, per_rank_peak_bytes=peaks)
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


def _plan_source(plan_path: Path | None, config: Path | None) -> str:
    """How the run's plan was given, for a sentence about it."""
    if plan_path is not None:
        return f"--plan {plan_path}"
    return f"{config.name}'s plan" if config is not None else "the plan"


def _check_config_outputs(
    settings: TrainConfig, config: Path | None, *, given_checkpoint_dir: bool
) -> None:
    """The folders the run writes that the options did not name (checked with them already):
    a ``checkpoint_dir`` from the ``--config`` file and the plan's disk offload folder.

    Raises:
        OutputError: one sentence naming where the path came from.
    """
    folders: dict[str, str | None] = {}
    if not given_checkpoint_dir and settings.checkpoint_dir is not None:
        where = f"{config.name}: checkpoint_dir" if config is not None else "checkpoint_dir"
        folders[where] = settings.checkpoint_dir
    plan = settings.load_plan()
    off = plan.offload if plan is not None else None
    disk = off.disk_dir if off is not None and "disk" in (off.optimizer, off.parameters) else None
    check_paths(folders=folders, existing_folders={"the plan's offload.disk_dir": disk})


def _check_plan_degree(settings: TrainConfig) -> None:
    plan = settings.load_plan()
    n = settings.nproc_per_node
    if plan is None:
        return
    par = plan.parallel
    if is_layout_plan(plan):
        if par.world_size != n:
            raise ValueError(
                f"the plan's data {par.data} x tensor {par.tensor} x pipeline {par.pipeline} x "
                f"context {par.context} is "
                f"{par.world_size} processes but --nproc-per-node is {n}; give "
                f"--nproc-per-node {par.world_size} or degrees whose product is {n}"
            )
        check_layout_run(settings, plan)
    elif n > 1 and par.data not in (1, n):
        raise ValueError(
            f"the plan trains on {par.data} processes but --nproc-per-node is {n}; "
            f"give --nproc-per-node {par.data} or a plan for {n}"
        )


def _work_layout(
    settings: TrainConfig, plan: Any, world: int, *, plot: Path | None, json_path: Path | None,
    out: Any, err: Any,
) -> int:
    """Train a tensor/pipeline plan in this process (one of ``world``) through
    :mod:`memfit.train.layout_run`; join and leave the process group here. ``--plot`` is
    drawn by every process, its own report beside the path given (``mem-rank0.png``, ...).
    Returns the exit code: 0, or ``128 + signal`` when a signal stopped the run."""
    with catch_signals(second_interrupts=not _launched()) as stop, _hard_stop(err):
        _train_layout(settings, plan, world, plot=plot, json_path=json_path, out=out, err=err)
        return exit_code(stop.signum)


def _train_layout(
    settings: TrainConfig, plan: Any, world: int, *, plot: Path | None, json_path: Path | None,
    out: Any, err: Any,
) -> None:
    import os

    from ..console import SETTINGS, exit_without_teardown, fail
    from ..distributed.launch import finish_worker, init_worker
    from ..train.layout_run import predict_rank_peaks, train_layout

    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        out, err = _quiet(out), _quiet(err)
    try:
        # world_size=1: the plan is used with its own degrees (not widened to data parallelism).
        run = prepare_run(settings, world_size=1)
        # Before the process group: the prediction runs in a fake one, which a real one forbids.
        predicted = predict_rank_peaks(run, plan) if rank == 0 else None
    except (WorkloadError, ValueError) as e:
        fail(str(e))
    except StopRequested as e:
        _stopped_early(err, e)
    par = plan.parallel
    out.print(
        f"[bold]{run.workload.name}[/]: {run.workload.description}; batch "
        f"{run.workload.batch_size}, length {run.workload.seq_len}; data: {run.data_name}; "
        f"plan: [bold]{plan.summary()}[/] over {world} processes (data {par.data} x tensor "
        f"{par.tensor} x pipeline {par.pipeline} x context {par.context})",
        highlight=False,
    )
    init_worker(par.backend)
    try:
        try:
            result = train_layout(run, plan, console=err, progress=rank == 0 and not SETTINGS.quiet,
                                  report_png=plot)
        except (torch.OutOfMemoryError, TrainingDiverged) as e:
            fail(str(e), code=1)
        except (WorkloadError, ValueError) as e:
            fail(str(e))
        except StopRequested as e:
            _stopped_early(err, e)
        _report_layout(out, run, plan, result, predicted, world=world, rank=rank, plot=plot,
                       json_path=json_path)
        _all_done()  # the results are written before any process leaves
    except BaseException:
        finish_worker(ok=False)
        raise
    finish_worker()
    exit_without_teardown()


def _report_layout(
    out: Any, run: TrainRun, plan: Any, result: Any, predicted: list[int] | None, *, world: int,
    rank: int, plot: Path | None, json_path: Path | None,
) -> None:
    """Print a tensor/pipeline run's results; process 0 writes the JSON."""
    out.print(
        f"loss {result.first_loss:.4f} -> {result.final_loss:.4f} in {_steps(result)} "
        f"({result.seconds:.1f} s, {result.tokens_per_second:,.0f} tokens/s); per-process "
        "peaks: " + ", ".join(_fmt(p) for p in result.per_rank_peak_bytes)
        + (" (predicted " + ", ".join(_fmt(p) for p in predicted) + ")" if predicted else ""),
        highlight=False,
    )
    evals = result.eval_losses
    if evals:
        out.print(f"eval loss {evals[-1][1]:.4f} after step {evals[-1][0]}", highlight=False)
    if result.stopped_by:
        saved = f"; checkpoint {result.checkpoint}, continue with --resume" if result.checkpoint else ""
        out.print(f"stopped by {result.stopped_by} after step {result.steps}{saved}",
                  highlight=False)
    if plot is not None:
        from ..train.layout_memory import rank_plot_path

        out.print("wrote " + ", ".join(str(rank_plot_path(plot, r)) for r in range(world)),
                  highlight=False)
    if json_path is not None and rank == 0:
        cfg = run.config
        data = result.to_dict()
        data.update(
            world_size=world,
            budget_bytes=run.budget_bytes,
            fits_budget=max(result.per_rank_peak_bytes) <= run.budget_bytes,
            planner="given",
            model=run.workload.name,
            batch_size=run.workload.batch_size,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            lr=float(cfg.lr if cfg.lr is not None else plan.optimizer.lr),
            data=run.data_name,
            tokenizer=repr(run.tokenizer),
            config=cfg.to_dict(),
        )
        if predicted is not None:
            data["predicted_rank_peak_bytes"] = predicted
        write_text(json_path, json.dumps(data, indent=2) + "\n")
        out.print(f"wrote {json_path}")


#: Options passed on to the launched processes: parameter name -> flag.
_PASSED = {
    "config": "--config", "model": "--model", "tokenizer": "--tokenizer", "batch_size": "--batch-size",
    "seq_len": "--seq-len", "max_steps": "--max-steps", "seed": "--seed", "budget": "--budget",
    "json_path": "--json", "cap": "--cap", "plot": "--plot", "plan_path": "--plan",
    "checkpoint_dir": "--checkpoint-dir", "save_every": "--save-every", "keep": "--keep",
    "nproc_per_node": "--nproc-per-node", "text_field": "--text-field",
    "eval_max_batches": "--eval-max-batches",
    "resume_mode": "--resume-mode", "resume_from": "--resume-from",
}  # fmt: skip


def _argv(params: Mapping[str, Any]) -> list[str]:
    """``train``'s command line for the launched processes, rebuilt from its options."""
    argv = ["train"]
    for name, flag in _PASSED.items():
        value = params.get(name)
        if value is not None:
            argv += [flag, str(value)]
    for path in params.get("data") or ():
        argv += ["--data", str(path)]
    for flag in ("resume", "quiet", "verbose"):
        if params.get(flag):
            argv.append(f"--{flag}")
    return argv


def _quiet(console: Any) -> Any:
    from rich.console import Console

    return Console(file=console.file, quiet=True, stderr=console.stderr)


def _gather_peaks(peak: int, world: int) -> list[int]:
    """Every process's measured peak, in rank order (``[peak]`` on one process)."""
    if world == 1:
        return [int(peak)]
    import torch.distributed as dist

    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, int(peak))
    return [int(p) for p in peaks]


#: Config fields whose option has another name.
_FLAG_NAMES = {"checkpoint_every": "save-every", "keep_checkpoints": "keep"}


def build_config(path: Path | None, flags: Mapping[str, Any]) -> TrainConfig:
    """The run's :class:`TrainConfig`: the YAML file's settings, then the command line's.

    A bad setting is named as the user wrote it: ``--max-steps`` for a flag, ``run.yaml:
    batch_size`` for a key of the file.

    Raises:
        ConfigError: with one sentence.
    """
    values = TrainConfig.read_yaml(path) if path is not None else {}
    try:
        return TrainConfig.from_dict({**values, **flags})
    except ConfigError as e:
        if e.key in flags:
            flag = _FLAG_NAMES.get(e.key, e.key.replace("_", "-"))
            raise ConfigError(f"--{flag}", e.problem) from None
        if path is not None and e.key in values:
            raise ConfigError(f"{path.name}: {e.key}", e.problem) from None
        raise


# ---------------------------------------------------------------------------------- output
def _fmt(n: int | None) -> str:
    from ..units import format_bytes

    return "-" if n is None else format_bytes(n)


def _print_plan(out: Any, run: TrainRun) -> None:
    w, choice, ds = run.workload, run.choice, run.dataset
    out.print(
        f"[bold]{w.name}[/]: {w.description}; batch {w.batch_size}, length {w.seq_len}; "
        f"data: {run.data_name} ({ds.num_tokens:,} tokens, {len(run.train):,} training samples)",
        highlight=False,
    )
    if run.lengths is not None and run.config.data is not None:
        out.print(run.lengths.summary(), highlight=False)
    out.print(
        f"plan ({choice.method}): [bold]{choice.plan.summary()}[/]; {_verdict(run)}",
        highlight=False,
    )
    if run.eval is not None:
        out.print(eval_line(run.config, len(run.eval), w.batch_size), highlight=False)


def eval_line(config: TrainConfig, samples: int, batch_size: int) -> str:
    """What each evaluation reads, in words: ``eval: 16 of 62,500 batches (256 of 1,000,000
    held-out samples) every 50 steps and after the last``."""
    batches = -(-samples // batch_size)
    limit = config.eval_batch_limit
    n = batches if limit is None else min(limit, batches)
    every = config.eval_every
    when = "after the last step" if not every else (
        "after every step" if every == 1 else f"every {every} steps and after the last"
    )
    return (
        f"eval: {n:,} of {batches:,} batches ({min(n * batch_size, samples):,} of {samples:,} "
        f"held-out samples) {when}"
    )


def _verdict(run: TrainRun) -> str:
    """The plan line's end: the prediction and the budget it is held to, each only where
    there is one (a given plan is held to a budget only when one was given)."""
    choice, peak = run.choice, run.choice.predicted_peak_bytes
    budget_given = run.config.budget is not None or choice.method != "given"
    if peak is None:
        budget = f" (budget {_fmt(run.budget_bytes)})" if budget_given else ""
        return f"not predicted here (a plan over several processes){budget}"
    if not budget_given:
        return f"predicted peak {_fmt(peak)} (no --budget given)"
    verdict = "fits" if peak <= run.budget_bytes else "[red]does not fit[/]"
    return f"predicted peak {_fmt(peak)} {verdict} the budget of {_fmt(run.budget_bytes)}"


def _print_result(out: Any, run: TrainRun, result: Any) -> None:
    budget = run.budget_bytes
    if run.config.budget is None and run.choice.method == "given":
        held = ""  # no budget was given to hold the plan to
    else:
        within = "within" if result.peak_bytes <= budget else "[red]over[/]"
        held = f", {within} the budget of {_fmt(budget)}"
    out.print(
        f"loss {result.first_loss:.4f} -> {result.final_loss:.4f} in {_steps(result)} "
        f"({result.seconds:.1f} s, {result.tokens_per_second:,.0f} tokens/s); measured peak "
        f"[bold]{_fmt(result.peak_bytes)}[/]{held}",
        highlight=False,
    )
    evals = result.eval_losses
    if len(evals) > 1 and evals[0][0] == 0:  # a fine-tune: the saved weights' loss first
        out.print(
            f"eval loss {evals[0][1]:.4f} (the saved weights) -> {evals[-1][1]:.4f} after step "
            f"{evals[-1][0]}",
            highlight=False,
        )
    if result.stopped_by:
        saved = f"; checkpoint {result.checkpoint}, continue with --resume" if result.checkpoint else ""
        out.print(f"stopped by {result.stopped_by} after step {result.steps}{saved}", highlight=False)
    for s in result.step_downs:
        out.print(f"stepped down at step {s['step'] + 1}: {s['summary']}", highlight=False)
    if result.step_downs:
        out.print(
            "(the measured peak includes the allocation that ran out of memory, which a real "
            "device would have refused)",
            highlight=False,
        )


def _steps(result: Any) -> str:
    """``12 steps``, or for a resumed run the steps it ran: ``4 steps (9 to 12; resumed from
    .../step-00000008)``."""
    ran = result.steps_run if result.steps_run is not None else result.steps
    if not result.resumed_from:
        return f"{ran} steps"
    first = result.steps - ran + 1
    return f"{ran} steps ({first} to {result.steps}; resumed from {result.resumed_from})"


def _result_json(run: TrainRun, result: Any) -> dict[str, Any]:
    cfg, choice = run.config, run.choice
    data = result.to_dict()
    data.update(
        budget_bytes=run.budget_bytes,
        fits_budget=result.peak_bytes <= run.budget_bytes,
        cap_bytes=cfg.cap_bytes,
        predicted_peak_bytes=choice.predicted_peak_bytes,
        planner=choice.method,
        model=run.workload.name,
        num_parameters=int(result.report.meta.get("num_parameters") or 0) or None,
        batch_size=run.workload.batch_size,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        lr=float(cfg.lr if cfg.lr is not None else choice.plan.optimizer.lr),
        data=run.data_name,
        tokenizer=repr(run.tokenizer),
        config=cfg.to_dict(),
        memory_report=result.report.to_dict(max_points=200),
    )
    if run.lengths is not None:
        data["data_lengths"] = run.lengths.to_dict()
    return data
