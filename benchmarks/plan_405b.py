"""Llama 3.1 405B on 512 GPUs as torchtitan published it, planned by memfit.

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (Table 5, torchtitan 9dec370): 405B
over FSDP 8 x TP 8 x PP 8, local batch 32 x 8192, full activation checkpointing, 1F1B 82.5 GiB
and interleaved 1F1B 72.7 GiB per GPU (reserved, the largest rank). Its pipeline
(torchtitan/parallelisms/pipelining_utils.py, generate_split_points) cuts the 126 layers with
the remainder on the middle stages, 8 micro-batches (the pipeline degree), and FSDP under a
pipeline keeps gathered parameters until backward (reshard_after_forward=False: memfit's ZeRO
stage 2); its tensor parallelism is sequence-parallel (``apply_tp``: ``SequenceParallel`` norms,
block inputs ``Shard(1)``), so the plan sets ``sequence``.

Writes each schedule's plan (``benchmarks/results/torchtitan_405b_<schedule>.plan.json``, the
``--plan`` of ``memfit plan --model llama-3.1-405b --batch-size 256 --seq-len 8192
--world-size 512 --gpus-per-node 8 --budget h100``) and what memfit predicts for it, rank by
rank and by category, to ``benchmarks/results/torchtitan_405b.{json,md}``.

    python benchmarks/plan_405b.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memfit.distributed.layout import pipeline_config
from memfit.estimate.layout_cost import estimate_layout, model_shape
from memfit.plan import Plan
from memfit.targets import get_device
from memfit.units import format_bytes
from memfit.workload import load_workload

PUBLISHED = {"1f1b": 82.5, "interleaved-1f1b": 72.7}  # GiB, reserved, largest rank
GiB = 1 << 30


def plan_for(schedule: str) -> Plan:
    """torchtitan's run as a memfit plan, its cuts torchtitan's (memfit's even split)."""
    # torchtitan's apply_tp splits the norms and block inputs over the sequence (Shard(1)).
    par = {"data": 8, "tensor": 8, "pipeline": 8, "zero_stage": 2, "schedule": schedule,
           "microbatches": 8, "sequence": True}
    even = pipeline_config(Plan(parallel=par).parallel).resolved_cuts(126)
    return Plan(precision="bf16-mixed", checkpointing="full", parallel={**par, "cuts": list(even)})


def run(schedule: str) -> dict:
    plan = plan_for(schedule)
    workload = load_workload("llama-3.1-405b", 256, 8192)
    cand = estimate_layout(model_shape(workload), plan.parallel, batch_size=256, seq_len=8192,
                           checkpointing=True, device=get_device("h100"),
                           precision="bf16-mixed", optimizer="adamw", gpus_per_node=8)
    per = plan.parallel.data * plan.parallel.tensor
    stages = cand.rank_peak_bytes[::per]
    top = max(range(len(stages)), key=lambda s: stages[s])
    return {"schedule": schedule, "plan": plan.to_dict(), "cuts": list(plan.parallel.cuts),
            "published_gib": PUBLISHED[schedule], "stage_peak_bytes": stages,
            "largest_rank_bytes": max(stages), "largest_stage": top,
            "largest_by_category": cand.stages[top],
            "error": max(stages) / GiB / PUBLISHED[schedule] - 1}


def markdown(rows: list[dict]) -> str:
    lines = ["| schedule | cuts | published (largest rank) | memfit (largest rank) | error | "
             "memfit's largest rank by category |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        cats = ", ".join(f"{k} {format_bytes(v)}" for k, v in r["largest_by_category"].items())
        lines.append(f"| {r['schedule']} | {', '.join(map(str, r['cuts']))} | "
                     f"{r['published_gib']:.1f} GiB | {format_bytes(r['largest_rank_bytes'])} "
                     f"(stage {r['largest_stage']}) | {r['error']:+.0%} | {cats} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    from memfit.outputs import exit_if_unwritable, write_text

    names = ["torchtitan_405b.json", "torchtitan_405b.md",
             *(f"torchtitan_405b_{schedule}.plan.json" for schedule in PUBLISHED)]
    for name in names:
        exit_if_unwritable({"--out": args.out / name}, folders={"--out": args.out})
    rows = []
    for schedule in PUBLISHED:
        plan_for(schedule).to_json(args.out / f"torchtitan_405b_{schedule}.plan.json")
        rows.append(run(schedule))
    write_text(args.out / "torchtitan_405b.json", json.dumps(rows, indent=2) + "\n")
    write_text(args.out / "torchtitan_405b.md", markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
