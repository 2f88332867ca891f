"""The 3-D planner's answers for the README: llama-70b on 64 H100s and llama-8b on 8.

Runs ``memfit.planner.layout.plan_layout`` (what ``memfit plan --world-size N --gpus-per-node G``
runs) and writes ``benchmarks/results/layout_plans.{json,md}``: the winning layout, each stage's
predicted peak, the predicted step time and the search's wall time, with the next best layouts.

    python benchmarks/plan_layout.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from memfit.planner.layout import plan_layout
from memfit.units import format_bytes

CASES = [
    # (model, global batch, length, world, gpus per node, budget)
    ("llama-70b", 8, 128, 64, 8, "h100"),
    ("llama-70b", 64, 4096, 64, 8, "h100"),
    ("llama-8b", 32, 4096, 8, 8, "h100"),
]


def run_case(model: str, batch: int, length: int, world: int, per_node: int, budget: str) -> dict:
    started = time.perf_counter()
    result = plan_layout(model, budget, world, per_node, batch_size=batch, seq_len=length)
    seconds = time.perf_counter() - started
    par = result.plan.parallel
    per = par.data * par.tensor
    stages = [max(result.rank_peak_bytes[s * per:(s + 1) * per]) for s in range(par.pipeline)]
    seen, others = {(par.data, par.tensor, par.pipeline)}, []
    for c in sorted((c for c in result.layouts if c.fits), key=lambda c: c.step_seconds):
        key = (c.parallel.data, c.parallel.tensor, c.parallel.pipeline)
        if key not in seen:
            seen.add(key)
            others.append({"layout": c.describe(), "step_seconds": c.step_seconds,
                           "largest_rank_bytes": c.max_peak_bytes})
        if len(others) == 3:
            break
    return {
        "model": model, "batch": batch, "length": length, "world_size": world,
        "gpus_per_node": per_node, "budget": budget, "plan": result.plan.summary(),
        "parallel": result.plan.parallel.__dict__, "stage_peak_bytes": stages,
        "predicted_rank_peak_bytes": result.rank_peak_bytes,
        "step_seconds": result.layout["step_seconds"], "parts": result.layout["parts_seconds"],
        "search_seconds": seconds, "explanation": result.explanation, "next": others,
    }


def markdown(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines += [
            f"**{r['model']}, batch {r['batch']} x {r['length']}, {r['world_size']} GPUs "
            f"({r['gpus_per_node']} per node), {r['budget']}** "
            f"(searched in {r['search_seconds']:.1f} s): {r['plan']}.",
            "",
            "| layout (data x tensor x pipeline) | step (predicted) | largest rank |",
            "|---|---|---|",
            f"| **{r['parallel']['data']} x {r['parallel']['tensor']} x "
            f"{r['parallel']['pipeline']}** (chosen) | {r['step_seconds'] * 1e3:.0f} ms | "
            f"{format_bytes(max(r['stage_peak_bytes']))} |",
        ]
        for o in r["next"]:
            lines.append(f"| {o['layout']} | {o['step_seconds'] * 1e3:.0f} ms | "
                         f"{format_bytes(o['largest_rank_bytes'])} |")
        peaks = r["stage_peak_bytes"]
        stages = ", ".join(f"stage {i} {format_bytes(b)}" for i, b in enumerate(peaks))
        spread = f" (largest {max(peaks) / min(peaks) - 1:.1%} above smallest)" if len(peaks) > 1 else ""
        lines += ["", f"Per stage (every rank of a stage alike): {stages}{spread}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    from memfit.outputs import exit_if_unwritable, write_text

    for name in ("layout_plans.json", "layout_plans.md"):
        exit_if_unwritable({"--out": args.out / name}, folders={"--out": args.out})
    rows = []
    for case in CASES:
        print("planning", *case, flush=True)
        rows.append(run_case(*case))
        print(f"  {rows[-1]['plan']} in {rows[-1]['search_seconds']:.1f} s", flush=True)
    write_text(args.out / "layout_plans.json", json.dumps(rows, indent=2) + "\n")
    write_text(args.out / "layout_plans.md", markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
