"""How long ``memfit plan`` takes, and whether its answers stay the same (issue 8: bert-large at
4 GiB in under 10 s).

Runs the planner on the README's examples and records, per case, the seconds and the answer:
the chosen plan, its predicted peak (device total, by category) and every candidate predicted
(summary and peak; a candidate ruled out by a floor is marked so, see :func:`same_answer`).
The CPU cost model measures this machine (matmul rates, bandwidth), which
makes the search order, and so the answer, depend on the machine's load; here it is pinned to
fixed figures (:data:`PINNED_CPU`), so two runs of any two versions of memfit can be compared
answer for answer (``--check``).

Usage::

    python benchmarks/bench_plan_time.py                     # time every case
    python benchmarks/bench_plan_time.py --cases bert-large-4gib --json out.json
    python benchmarks/bench_plan_time.py --check benchmarks/results/plan_time_before_36.json \
        --json benchmarks/results/plan_time.json --markdown benchmarks/results/plan_time.md

Each case's CPU seconds (this process and its forked worker) are recorded beside the wall
seconds: on a shared machine the wall clock counts other people's work too.

Times are wall-clock seconds of :func:`memfit.planner.plan` in a process whose imports and
first model builds are already done (a warm-up plan of a tiny model runs first), so they are
the search's own cost; the CLI adds about 2-3 s of imports on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: name -> (model, batch size, sequence length, budget, allow, extra keyword arguments).
CASES: dict[str, tuple[str, int, int, str, tuple[str, ...], dict[str, Any]]] = {
    # README "What will fit?": the issue 8 target.
    "bert-large-4gib": ("bert-large", 32, 128, "4GiB", ("8bit", "factored"), {}),
    # The same without --allow: nothing fits (the closest plan is the answer).
    "bert-large-4gib-nothing": ("bert-large", 32, 128, "4GiB", (), {}),
    # A GPU target (a fixed profile: no measured figures).
    "gpt2-t4": ("gpt2", 16, 512, "t4", (), {}),
    # README: data parallel, the ZeRO stage chosen too.
    "bert-large-8gib-ws8": ("bert-large", 64, 128, "8GiB", (), {"world_size": 8}),
    # Issue 36: the README's 8B fine-tune on an 8 GiB H100 budget, adapters allowed.
    "llama-3.1-8b-8gib-qlora": (
        "llama-3.1-8b", 1, 2048, "8GiB", ("lora", "qlora"), {"device": "h100"}
    ),
    # The same model on a 24 GiB RTX 4090.
    "llama-3.1-8b-24gib-qlora": (
        "llama-3.1-8b", 1, 2048, "24GiB", ("lora", "qlora"), {"device": "rtx4090"}
    ),
    # Without --allow: nothing fits (a full fine-tune needs ~100 GiB), the closest plan answers.
    "llama-3.1-8b-8gib-nothing": ("llama-3.1-8b", 1, 2048, "8GiB", (), {"device": "h100"}),
}

#: CPU profile figures used instead of measuring this machine (FLOP/s per dtype, bytes/s,
#: seconds per op): the search order must not depend on the load.
PINNED_CPU = {
    "flops": {"fp32": 1.0e11, "bf16": 4.0e10, "fp16": 2.0e10},
    "bandwidth": 1.0e10,
    "overhead": 5.0e-6,
}


def pin_cpu_profile() -> None:
    """Replace the measured CPU profile by :data:`PINNED_CPU` (memory stays this machine's)."""
    import dataclasses

    from memfit.targets import profiles

    measured = profiles.cpu_profile()
    pinned = dataclasses.replace(
        measured,
        flops=dict(PINNED_CPU["flops"]),
        mem_bandwidth=PINNED_CPU["bandwidth"],
        host_bandwidth=PINNED_CPU["bandwidth"],
        host_mem_bandwidth=PINNED_CPU["bandwidth"],
        launch_overhead=PINNED_CPU["overhead"],
        memory_bytes=64 * 2**30,
        context_bytes=16 * 2**30,
    )
    profiles.cpu_profile.cache_clear()
    profiles.cpu_profile = lambda: pinned  # type: ignore[assignment]


def _candidate(c: Any) -> dict[str, Any]:
    return {
        "summary": c.plan.summary(),
        "fits": c.fits,
        "device_total_bytes": c.device_total_bytes,
        "peak_bytes": c.peak_bytes,
        "host_bytes": c.host_bytes,
        "peak_is_lower_bound": c.at_least,
    }


def same_answer(want: dict[str, Any], got: dict[str, Any]) -> bool:
    """Whether two answers agree: the plan and its figures, and every candidate both runs
    predicted in full (not ruled out by a floor) has the same figures. Which candidates get
    predicted may differ between versions: a floor in one may be a full prediction in another."""
    if {k: v for k, v in want.items() if k != "candidates"} != {
        k: v for k, v in got.items() if k != "candidates"
    }:
        return False

    def full(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {
            c["summary"]: {k: v for k, v in c.items() if k != "peak_is_lower_bound"}
            for c in answer["candidates"]
            if not c.get("peak_is_lower_bound")
        }

    a, b = full(want), full(got)
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def answer(result: Any, fits: bool) -> dict[str, Any]:
    """What must not change: the plan, its prediction and the candidates predicted."""
    out = {
        "fits": fits,
        "plan": result.plan.to_dict(),
        "predicted_peak_bytes": result.predicted_peak_bytes,
        "predicted_device_total_bytes": result.predicted_device_total_bytes,
        "predicted_peak_by_category": dict(result.predicted_peak_by_category),
        "predicted_host_bytes": result.predicted_host_bytes,
        "step_time_ratio": round(result.predicted_step_time_ratio, 9),
        "candidates": [_candidate(c) for c in result.candidates],
    }
    ranks = getattr(result, "ranks", None)
    if ranks:
        out["ranks"] = json.loads(json.dumps(ranks, default=str))
    return out


def run_case(name: str) -> dict[str, Any]:
    """Plan one case; its seconds and answer."""
    from memfit.planner import plan
    from memfit.planner.result import NothingFits
    from memfit.workload import load_workload

    model, batch, seq, budget, allow, extra = CASES[name]
    workload = load_workload(model, batch, seq)
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    try:
        result, fits = plan(workload, budget, allow=allow, **extra), True
    except NothingFits as e:
        result, fits = e.result, False
    seconds = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_started
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "answer": answer(result, fits)}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the planner's forked worker is
    joined before :func:`~memfit.planner.plan` returns): on a shared machine the wall clock
    counts other people's work too, this does not."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def table(results: dict[str, Any], before: dict[str, Any]) -> str:
    """The results as a Markdown table: per case, wall and CPU seconds (the planner's process
    and its worker), before where ``before`` has the case, and the chosen plan."""
    from memfit.plan import Plan

    lines = [
        "| case | seconds | CPU seconds | before: seconds | before: CPU seconds | answer |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        was = before.get(name, {})
        a = r["answer"]
        verdict = "fits" if a["fits"] else "nothing fits; closest"
        plan = Plan.from_dict(a["plan"]).summary()
        total = a["predicted_device_total_bytes"] / 2**30
        same = "" if not was else (
            " (same)" if same_answer(was["answer"], a) else " (DIFFERS)"
        )
        lines.append(
            f"| {name} | {r['seconds']:.2f} | {r.get('cpu_seconds', float('nan')):.2f} | "
            f"{_figure(was.get('seconds'))} | {_figure(was.get('cpu_seconds'))} | "
            f"{verdict}: {plan}, {total:.2f} GiB{same} |"
        )
    return "\n".join(lines) + "\n"


def _figure(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--json", type=Path, help="write seconds and answers here")
    parser.add_argument(
        "--check", type=Path, help="a JSON written by --json: fail if an answer differs"
    )
    parser.add_argument(
        "--markdown", type=Path, help="write the results table here (with --check: before, too)"
    )
    args = parser.parse_args(argv)
    from memfit.outputs import exit_if_unwritable, write_text

    exit_if_unwritable({"--json": args.json, "--markdown": args.markdown})
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing: a second thread only spins
    pin_cpu_profile()
    from memfit.planner import plan

    plan("bert-tiny", "1GiB", batch_size=2, seq_len=8)  # warm-up: imports, first builds
    want = json.loads(args.check.read_text()) if args.check else {}
    results: dict[str, Any] = {}
    failed = []
    for name in args.cases:
        results[name] = run_case(name)
        line = (
            f"{name:28s} {results[name]['seconds']:7.2f} s"
            f" ({results[name]['cpu_seconds']:.2f} CPU s)"
        )
        if name in want:
            same = same_answer(want[name]["answer"], results[name]["answer"])
            line += (
                f"  (before: {want[name]['seconds']:.2f} s, answer {'same' if same else 'DIFFERS'})"
            )
            if not same:
                failed.append(name)
        print(line, flush=True)
    if args.json:
        write_text(args.json, json.dumps(results, indent=1) + "\n")
    if args.markdown:
        write_text(args.markdown, table(results, want))
    if failed:
        print(f"answers differ: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
