"""What every command checks the same way: sizes in range, a byte count, and the rule that
turns a failure into an exit code (bad input: one sentence and exit 2; the model's own
failure: exit 1)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from ..console import fail

__all__ = [
    "QuietOption",
    "TextFieldOption",
    "TokenizerOption",
    "VerboseOption",
    "check_data_options",
    "check_extras",
    "check_sizes",
    "data_lengths",
    "data_option",
    "parse_cap",
    "run_guarded",
]

#: ``--tokenizer`` of the commands that read ``--data`` to size a dry run.
TokenizerOption = Annotated[
    Path | None,
    typer.Option(
        "--tokenizer",
        help="With --data: the tokenizer that counts its tokens (a tokenizer.json, or a "
        "save_pretrained folder whose chat template renders chat records). Default: bytes.",
    ),
]
#: ``--text-field`` of the same commands.
TextFieldOption = Annotated[
    str, typer.Option("--text-field", help="With --data: the field holding a record's text.")
]


#: ``--quiet`` of every command (:func:`memfit.console.configure`).
QuietOption = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="For scripts: print the results only (no progress, no tables); errors still print.",
    ),
]
#: ``--verbose`` of every command.
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        help="Also show third-party libraries' warnings and logs (torchao's kernels that do "
        "not load here, torch's deprecation notes), silenced by default.",
    ),
]


def data_option(verb: str) -> Any:
    r"""``--data`` of a command that ``verb``\ s (plans, profiles) the data's longest batch."""
    return Annotated[
        list[Path] | None,
        typer.Option(
            "--data",
            help="Training data (JSONL, JSON, Parquet, CSV or text; repeat for several files): "
            f"{verb} its longest batch, --batch-size samples of its longest record (cut to "
            "--seq-len), and print its length percentiles.",
        ),
    ]


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn``; turn bad input into one sentence and exit 2, a model's failure into exit 1."""
    from ..estimate.dryrun import ModelError
    from ..plan import PlanError
    from ..workload import WorkloadError

    try:
        return fn(*args, **kwargs)
    except (WorkloadError, PlanError) as e:
        fail(str(e))
    except ModelError as e:
        if os.environ.get("MEMFIT_DEBUG"):
            traceback.print_exception(e.__cause__)
        fail(f"{e} (set MEMFIT_DEBUG=1 for its traceback)", code=1)
    except ValueError as e:
        fail(str(e))


def check_sizes(batch_size: int, seq_len: int, steps: int = 1) -> None:
    """Fail (exit 2) unless ``--batch-size``, ``--seq-len`` and ``--steps`` are at least 1."""
    for flag, value in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--steps", steps)):
        if value < 1:
            fail(f"{flag} must be a whole number >= 1, got {value}")


def parse_cap(cap: str | None) -> int | None:
    """``--cap`` in bytes (``None`` when not given); fail (exit 2) on a size that does not parse."""
    if cap is None:
        return None
    from ..units import parse_size

    try:
        return parse_size(cap)
    except ValueError as e:
        fail(f"--cap: {e}")


def data_lengths(
    data: list[Any],
    tokenizer: Any,
    text_field: str,
    batch_size: int,
    seq_len: int,
    model: str | None = None,
    console: Any = None,
) -> Any:
    """Read ``--data`` as ``memfit train`` would, print its length percentiles and worst batch,
    and return the :class:`~memfit.train.lengths.LengthReport` (its ``max`` is the length to
    plan for); bad data fails with one sentence and exit 2.

    Without ``tokenizer``, a model folder's own tokenizer counts the tokens, as ``memfit
    train`` uses it (else memfit's byte tokenizer). The summary goes to ``console`` (default:
    standard output)."""
    from ..console import err, out
    from ..train.chat import build_dataset
    from ..train.lengths import length_report
    from ..train.tokenizer import load_tokenizer
    from ..weights import has_tokenizer

    if tokenizer is None and model is not None and has_tokenizer(model):
        tokenizer = model
    tok = run_guarded(load_tokenizer, tokenizer)
    with err.status("reading the data") as status:
        dataset = run_guarded(
            build_dataset, [str(p) for p in data], tok, seq_len, text_field=text_field,
            say=lambda m: status.update(str(m)),
        )
    report = run_guarded(length_report, dataset, batch_size, seq_len=seq_len)
    (console or out).print(report.summary(), highlight=False)
    return report


def check_data_options(data: Any, tokenizer: Any, text_field: str) -> None:
    """Fail (exit 2) when ``--tokenizer`` or ``--text-field`` is given without ``--data``:
    they only read the data, so alone they would be ignored without a word."""
    if data:
        return
    if tokenizer is not None:
        fail("--tokenizer counts the tokens of --data; give --data too, or leave --tokenizer out")
    if text_field != "text":
        fail("--text-field names a field of --data's records; give --data too, or leave it out")


#: ``--allow`` name -> the optional packages it needs: (package, the extra that brings it).
_ALLOW_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "lora": (("peft", "peft"),),
    "qlora": (("peft", "peft"), ("torchao", "peft")),
    "fp8": (("torchao", "fp8"),),
}


def check_extras(
    allow: Iterable[str] = (), plan: Any = None, *, where: str = "", real: bool = True
) -> None:
    """Fail (one sentence naming the extra to install, exit 2) before any work when ``--allow``
    or a plan needs an optional package that is not installed.

    Args:
        allow: ``--allow``'s names (the planner may choose these techniques).
        plan: A given :class:`~memfit.plan.Plan` (its LoRA, fp8 precision and optimizer).
        where: How the plan was given, for the sentence (``--plan plan.json``).
        real: The plan will train for real; ``False``: only dry runs, where a peer's optimizer
            (bitsandbytes', torchao's) has memfit's stand-in and its package is not needed.
    """
    from ..extras import MissingExtra, require

    try:
        for name in allow:
            for package, extra in _ALLOW_NEEDS.get(name.strip(), ()):
                require(package, f"--allow {name.strip()}", extra)
        if plan is not None:
            _check_plan_extras(plan, where or "the plan", real)
    except MissingExtra as e:
        fail(str(e))


def _check_plan_extras(plan: Any, where: str, real: bool) -> None:
    """Raise :class:`~memfit.extras.MissingExtra` for the first package ``plan`` needs that is
    not installed."""
    from ..extras import installed, require
    from ..optim import registry

    if plan.lora is not None:
        require("peft", f"{where}'s LoRA adapters", "peft")
        if plan.lora.quantize_base is not None:
            require("torchao", f"{where}'s QLoRA base ({plan.lora.quantize_base})", "peft")
    if plan.precision.mode == "fp8":
        require("torchao", f"{where}'s precision 'fp8'", "fp8")
    spec = registry.get(plan.optimizer.name)
    if real and spec.package is not None and not installed(spec.package):
        raise spec.missing()
