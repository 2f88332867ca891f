"""``memfit bench``: benchmarks that reproduce memfit's published tables (``bench ladder``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..console import check_outputs, configure, fail, out, show, status
from ..outputs import write_text
from .checks import QuietOption, VerboseOption, check_sizes, run_guarded

__all__ = ["bench_ladder"]


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
    quiet: QuietOption = False,
    verbose: VerboseOption = False,
) -> None:
    """Reproduce and extend the published BERT-large strategy ladder."""
    configure(quiet=quiet, verbose=verbose)
    import json

    from ..bench.ladder import ladder_markdown, ladder_table, run_ladder

    check_sizes(batch_size, seq_len)
    check_outputs({"--json": json_path, "--markdown": markdown})
    for flag, value in (("--compute-depth", compute_depth), ("--compute-seq", compute_seq)):
        if value < 1:
            fail(f"{flag} must be a whole number >= 1, got {value}")
    from ..targets import get_device

    target = run_guarded(get_device, device)
    with status("ladder...") as line:
        rows = run_guarded(
            run_ladder,
            model,
            batch_size=batch_size,
            seq_len=seq_len,
            short_seq=max(1, seq_len // 2),
            compute_depth=compute_depth,
            compute_seq=compute_seq,
            device=target,
            progress=lambda msg: line.update(msg),
            only=[n.strip() for n in only.split(",") if n.strip()] or None,
        )
    show(ladder_table(rows))
    if json_path is not None:
        write_text(json_path, json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
        out.print(f"wrote {json_path}")
    if markdown is not None:
        write_text(markdown, ladder_markdown(rows) + "\n")
        out.print(f"wrote {markdown}")
