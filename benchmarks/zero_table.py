"""Per-rank memory of data parallelism and ZeRO stages 0-3: predicted without launching, and
measured on two real processes.

Predicted rows: :func:`memfit.estimate.distributed.predict_ranks` (a rank's dry run in a fake
process group) for ``bert-large`` and ``llama-1b`` at world sizes 1, 2, 8 and 64, stages 0-3,
AdamW in fp32 (the largest rank's peak). Measured rows: the same plan trained for real by two
processes (gloo, loopback, this machine's CPU), each rank's peak as memfit's tracker measures
it, next to its prediction.

Usage::

    python benchmarks/zero_table.py [--measure bert-large] [--out benchmarks/results/zero_table]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memfit import Plan
from memfit.estimate.distributed import predict_ranks
from memfit.units import format_bytes
from memfit.workload import load_workload

MODELS = {"bert-large": (64, 128), "llama-1b": (64, 512)}
MEASURED = {"bert-large": (16, 128), "gpt2": (16, 256)}
WORLDS = (1, 2, 8, 64)
STAGES = (0, 1, 2, 3)
STEPS = 3


def _plan(world: int, stage: int) -> Plan:
    return Plan(parallel={"data": world, "zero_stage": stage})


def predicted_rows(models: list[str]) -> list[dict]:
    rows = []
    for name in models:
        batch, seq = MODELS[name]
        workload = load_workload(name, batch, seq)
        for world in WORLDS:
            for stage in STAGES:
                t0 = time.perf_counter()
                pred = predict_ranks(workload, _plan(world, stage), steps=STEPS)
                rows.append(dict(model=name, batch=batch, seq_len=seq, world=world, stage=stage,
                                 predicted_max_rank_peak_bytes=pred.max_peak_bytes,
                                 predicted_peak_bytes=pred.peak_bytes[:2] + pred.peak_bytes[-1:],
                                 seconds=round(time.perf_counter() - t0, 1)))
                print(name, world, stage, format_bytes(pred.max_peak_bytes), flush=True)
    return rows


def _rank(rank: int, world: int, port: int, name: str, batch: int, seq: int, stage: int,
          results: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from memfit.estimate.dryrun import measure

    report = measure(name, _plan(world, stage), steps=STEPS, batch_size=batch, seq_len=seq)
    results.put((rank, int(report.peak_bytes)))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def measured_rows(name: str) -> list[dict]:
    batch, seq = MEASURED[name]
    rows = []
    for stage in STAGES:
        pred = predict_ranks(load_workload(name, batch, seq), _plan(2, stage), steps=STEPS)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, name, batch, seq, stage, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        peaks = dict(results.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
        measured = [peaks[0], peaks[1]]
        rows.append(dict(model=name, batch=batch, seq_len=seq, world=2, stage=stage,
                         measured_peak_bytes=measured, predicted_peak_bytes=pred.peak_bytes,
                         ratio=[round(p / m, 4) for p, m in zip(pred.peak_bytes, measured, strict=True)],
                         seconds=round(time.perf_counter() - t0, 1)))
        print(name, "measured", stage, [format_bytes(m) for m in measured],
              [format_bytes(p) for p in pred.peak_bytes], flush=True)
    return rows


def markdown(pred: list[dict], meas: list[dict]) -> str:
    lines = ["| model (batch x length) | processes | stage 0 | stage 1 | stage 2 | stage 3 |",
             "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["model"] for r in pred):
        for world in WORLDS:
            cells = {r["stage"]: format_bytes(r["predicted_max_rank_peak_bytes"])
                     for r in pred if r["model"] == name and r["world"] == world}
            b, s = MODELS[name]
            lines.append(f"| {name} ({b} x {s}) | {world} | "
                         + " | ".join(cells.get(st, "-") for st in STAGES) + " |")
    if meas:
        lines += ["", "Two real processes (gloo, CPU), each rank's peak measured by memfit's "
                  "tracker, against its prediction:", "",
                  "| model (batch x length) | stage | rank 0 measured | rank 0 predicted | "
                  "rank 1 measured | rank 1 predicted | predicted / measured |",
                  "|---|---|---|---|---|---|---|"]
        for r in meas:
            m, p = r["measured_peak_bytes"], r["predicted_peak_bytes"]
            lines.append(f"| {r['model']} ({r['batch']} x {r['seq_len']}) | {r['stage']} | "
                         f"{format_bytes(m[0])} | {format_bytes(p[0])} | {format_bytes(m[1])} | "
                         f"{format_bytes(p[1])} | {' / '.join(f'{x:.3f}' for x in r['ratio'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bert-large,llama-1b")
    ap.add_argument("--measure", default="bert-large", help="model measured on 2 processes ('' for none)")
    ap.add_argument("--out", default="benchmarks/results/zero_table")
    args = ap.parse_args()
    from memfit.outputs import exit_if_unwritable, write_text

    out = Path(args.out)
    for suffix in (".json", ".md"):
        exit_if_unwritable({"--out": out.with_suffix(suffix)})
    pred = predicted_rows([m for m in args.models.split(",") if m])
    meas = measured_rows(args.measure) if args.measure else []
    write_text(out.with_suffix(".json"), json.dumps({"predicted": pred, "measured": meas}, indent=2))
    write_text(out.with_suffix(".md"), markdown(pred, meas))
    print(markdown(pred, meas))


if __name__ == "__main__":
    main()
