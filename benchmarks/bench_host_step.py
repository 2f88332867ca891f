"""Host (CPU) optimizer step: memfit's AdamW8bit against torch's AdamW (foreach and fused).

``optimizer.step()`` on ``--params`` fp32 parameters held as a handful of large tensors (50M
by default, as 4096-column matrices), fixed random gradients.  Each optimizer is stepped
``--warmup`` times untimed (state creation; for the compiled AdamW8bit path also the
compilation), then the optimizers step in turn, one step each per round, for ``--repeats``
rounds; the table gives each optimizer's median step time over torch's fused and foreach
AdamW's from the same run and thread count.  The machine this runs on may be shared: the
ratios are the result, the absolute times only context.

AdamW8bit is timed twice: with its default (the compiled fused decode-update-encode kernel for
large CPU tensors, where torch.compile works) and forced eager (``compiled=False``).

Usage::

    python benchmarks/bench_host_step.py --threads 1 2 --markdown benchmarks/results/host_step.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from memfit.optim import AdamW8bit  # noqa: E402

COLUMNS = 4096


def make_params(total: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``total`` elements as matrices of up to 16 Mi elements (4096 columns), with gradients."""
    gen = torch.Generator().manual_seed(seed)
    rows_left = total // COLUMNS
    params = []
    while rows_left > 0:
        rows = min(rows_left, 4096)
        p = torch.nn.Parameter(torch.randn(rows, COLUMNS, generator=gen) * 0.02)
        p.grad = torch.randn(rows, COLUMNS, generator=gen) * 1e-3
        params.append(p)
        rows_left -= rows
    return params


def build(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "torch AdamW (fused)":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if name == "torch AdamW (foreach)":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if name == "memfit AdamW8bit":
        return AdamW8bit(params, lr=1e-3)
    if name == "memfit AdamW8bit (eager)":
        return AdamW8bit(params, lr=1e-3, compiled=False)
    raise ValueError(name)


NAMES = [
    "torch AdamW (fused)",
    "torch AdamW (foreach)",
    "memfit AdamW8bit",
    "memfit AdamW8bit (eager)",
]


def run(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(threads)
    opts = {name: build(name, make_params(args.params)) for name in args.optimizers}
    for opt in opts.values():
        for _ in range(args.warmup):
            opt.step()
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(args.repeats):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    fused = medians.get("torch AdamW (fused)")
    foreach = medians.get("torch AdamW (foreach)")
    rows = []
    for name, med in medians.items():
        rows.append(
            {
                "optimizer": name,
                "median_s": med,
                "vs_fused": med / fused if fused else None,
                "vs_foreach": med / foreach if foreach else None,
            }
        )
    return {"threads": threads, "rows": rows}


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# Host optimizer step: AdamW8bit vs torch AdamW",
        "",
        f"`python benchmarks/bench_host_step.py` -- {args.params / 1e6:.0f}M fp32 parameters as "
        f"{COLUMNS}-column matrices, median of {args.repeats} steps after {args.warmup}, "
        "optimizers stepping in turn. Ratios are within one run (one thread count); the machine "
        "is shared and loaded, so absolute times are context only.",
        "",
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['threads']} thread(s)",
            "",
            "| optimizer | median step (s) | / torch fused | / torch foreach |",
            "|---|---:|---:|---:|",
        ]
        for row in res["rows"]:
            lines.append(
                f"| {row['optimizer']} | {row['median_s']:.3f} | {row['vs_fused']:.2f}x "
                f"| {row['vs_foreach']:.2f}x |"
            )
        lines.append("")
    lines += [
        "Notes:",
        "",
        "- `memfit AdamW8bit` is the default: fp32 CPU tensors of at least 1 Mi elements take "
        "the torch.compile'd (inductor) step, two fused kernels per 1 Mi chunk (decode + update, "
        "then encode from an fp32 scratch chunk); its codes equal the eager step's bit for bit "
        "(tests/optim/test_fused8bit.py). Compilation and the one-time self-check happen in the "
        "first step (a few seconds; inductor caches the kernels on disk), in the warm-up here.",
        "- `memfit AdamW8bit (eager)` is `compiled=False` (or `MEMFIT_COMPILED_OPTIM=0`).",
        "- Goal (issue 8): AdamW8bit at most 1.0x torch's foreach AdamW.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--optimizers", nargs="+", default=NAMES, choices=NAMES)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    from memfit.outputs import exit_if_unwritable, write_text

    exit_if_unwritable({"--json": args.json, "--markdown": args.markdown})
    results = [run(t, args) for t in args.threads]
    for res in results:
        for row in res["rows"]:
            print(
                f"threads={res['threads']} {row['optimizer']:26s} {row['median_s']:.3f}s "
                f"fused x{row['vs_fused']:.2f} foreach x{row['vs_foreach']:.2f}"
            )
    if args.json:
        write_text(args.json, json.dumps(results, indent=2))
    if args.markdown:
        write_text(args.markdown, markdown(results, args))


if __name__ == "__main__":
    main()
