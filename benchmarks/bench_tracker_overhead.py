"""Tracker overhead: a BERT-base training step on CPU, untracked vs memfit.track vs MemTracker.

Reports each tracker's step time as a ratio to the untracked step measured in the same run.
PyTorch's private ``torch.distributed._tools.mem_tracker.MemTracker`` is the reference peer.

    python benchmarks/bench_tracker_overhead.py [--batch-size 8] [--seq-len 128] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import memfit
from memfit.workload import call_model, load_workload


def _time_steps(step: Callable[[], None], steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (noise control)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from memfit.outputs import exit_if_unwritable, make_parent

    exit_if_unwritable({"--json": args.json})
    workload = load_workload(args.model, args.batch_size, args.seq_len)
    model, batch = workload.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        loss = workload.loss_fn(call_model(model, batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def memfit_step() -> None:
        with memfit.track(model, optimizer) as tracker:
            tracker.add_inputs(batch)
            step()
        tracker.report()  # building the report is part of the cost

    def memtracker_step() -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, optimizer, batch["input_ids"])
        with mt:
            step()
        mt.get_tracker_snapshot("peak")

    step()  # warm up: optimizer state, allocator, lazy inits
    variants = {"untracked": step, "memfit.track": memfit_step, "MemTracker": memtracker_step}
    results: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            results[name].append(_time_steps(fn, args.steps))
    base = min(results["untracked"])
    rows = {name: {"seconds": min(v), "ratio": min(v) / base} for name, v in results.items()}
    print(
        f"{args.model}, batch {args.batch_size}, length {args.seq_len}, AdamW, CPU, torch {torch.__version__}"
    )
    print("| variant | step time (s) | ratio to untracked |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']:.3f} | {r['ratio']:.2f}x |")
    if args.json:
        with open(make_parent(args.json), "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
