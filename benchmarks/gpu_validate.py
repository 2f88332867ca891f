"""Validate memfit's GPU predictions against a real GPU.

For each model and plan, this compares memfit's dry-run prediction for the GPU (kernel
emulation, caching-allocator model, CUDA context) with what PyTorch reports after real training
steps on the GPU:

* predicted tensor peak and allocated peak vs ``torch.cuda.max_memory_allocated``;
* predicted reserved peak (allocator model) vs ``torch.cuda.max_memory_reserved``;
* predicted device total (reserved + context + workspaces) vs the device memory in use as the
  driver reports it (``mem_get_info``: total minus free, measured after the steps).

Each real run is a fresh subprocess, so the CUDA context and the allocator's cache start clean.

Run it on a machine with a CUDA GPU::

    pip install torch --index-url https://download.pytorch.org/whl/cu128   # a CUDA build
    pip install -e .
    python benchmarks/gpu_validate.py                      # all models and plans
    python benchmarks/gpu_validate.py --models bert-base --plans baseline,best

It writes ``benchmarks/results/gpu_<device>.json`` (every number, with the GPU's name and the
torch version) and ``gpu_<device>.md``, a table of relative errors ``(predicted - measured) /
measured``: positive means memfit over-predicts (safe), negative means a plan it says fits
could run out of memory. Without a GPU it exits with code 2, unless ``--dry-only`` is given:
then it only computes the predictions (on any machine), for checking the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

import memfit
from memfit import device as dev
from memfit.targets import machine_device

#: Model -> (batch size, sequence length) that an 80 GB GPU holds for the baseline plan.
MODELS: dict[str, tuple[int, int]] = {
    "bert-base": (32, 128),
    "bert-large": (32, 128),
    "gpt2-medium": (8, 512),
    "llama-1b": (4, 512),
}


def plans() -> dict[str, memfit.Plan]:
    """The plans validated: as in the issue, and the ladder's best full fine-tune."""
    return {
        "baseline": memfit.Plan(),
        "bf16-selective": memfit.Plan(precision="bf16-mixed", checkpointing="selective"),
        "best": memfit.Plan(
            precision="bf16-pure",
            optimizer="adafactor",
            optimizer_in_backward=True,
            checkpointing="full",
        ),
        "accum-8bit": memfit.Plan(grad_accum_steps=4, optimizer="adamw8bit"),
    }


def predict(model: str, plan_name: str, batch: int, seq: int, steps: int, target: str) -> dict:
    """memfit's dry-run prediction for ``target``."""
    workload = memfit.load_workload(model, batch, seq)
    report = memfit.measure(workload, plans()[plan_name], steps=steps, dry=True, device=target)
    return {
        "tensor_peak_bytes": report.peak_bytes,
        "allocated_bytes": report.meta.get("peak_allocated_bytes"),
        "reserved_bytes": report.peak_reserved_bytes,
        "device_total_bytes": report.device_total_bytes,
        "overhead_bytes": report.overhead_bytes,
        "peak_by_category": report.peak_by_category,
        "attention_backends": report.meta.get("attention_backends"),
    }


def run_real(model: str, plan_name: str, batch: int, seq: int, steps: int) -> dict:
    """Real training steps on the GPU (called in a fresh subprocess)."""
    from memfit.strategies.compose import apply_plan

    cuda = torch.device("cuda")
    torch.ones(1, device=cuda)  # create the context before anything is allocated
    dev.synchronize(cuda)
    info = dev.mem_get_info(cuda)
    assert info is not None
    free0, total = info
    workload = memfit.load_workload(model, batch, seq)
    model_, batch_ = workload.build(seed=0)
    model_ = model_.to(cuda)
    batch_ = {k: v.to(cuda) for k, v in batch_.items()}
    dev.reset_peak_memory_stats(cuda)
    setup = apply_plan(model_, plans()[plan_name], loss_fn=workload.loss_fn)
    out: dict[str, Any] = {"context_bytes": total - free0, "oom": False}
    try:
        for _ in range(steps):
            loss = setup.step(batch_)
        dev.synchronize(cuda)
        out["final_loss"] = float(loss)
    except torch.OutOfMemoryError as e:
        out.update(oom=True, error=str(e).splitlines()[0])
    info = dev.mem_get_info(cuda)
    assert info is not None
    out.update(
        max_allocated_bytes=dev.max_memory_allocated(cuda),
        max_reserved_bytes=dev.max_memory_reserved(cuda),
        device_used_bytes=total - info[0],
        total_bytes=total,
    )
    return out


def _real_in_subprocess(model: str, plan_name: str, batch: int, seq: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", model, plan_name, str(batch), str(seq), str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"oom": False, "error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _err(predicted: int | None, measured: int | None) -> float | None:
    if not predicted or not measured:
        return None
    return (predicted - measured) / measured


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def markdown(rows: list[dict], title: str) -> str:
    """The table of relative errors."""
    lines = [
        f"### {title}",
        "",
        "| model | plan | measured allocated | vs tensor peak | vs allocated | measured reserved "
        "| vs reserved | device used | vs device total |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gib = 2**30
    for r in rows:
        real, pred = r.get("real") or {}, r["predicted"]
        if real.get("oom") or real.get("error"):
            lines.append(f"| {r['model']} | {r['plan']} | {real.get('error', 'OOM')} |||||||")
            continue
        lines.append(
            f"| {r['model']} | {r['plan']} | {real.get('max_allocated_bytes', 0) / gib:.2f} GiB "
            f"| {_pct(_err(pred['tensor_peak_bytes'], real.get('max_allocated_bytes')))} "
            f"| {_pct(_err(pred['allocated_bytes'], real.get('max_allocated_bytes')))} "
            f"| {real.get('max_reserved_bytes', 0) / gib:.2f} GiB "
            f"| {_pct(_err(pred['reserved_bytes'], real.get('max_reserved_bytes')))} "
            f"| {real.get('device_used_bytes', 0) / gib:.2f} GiB "
            f"| {_pct(_err(pred['device_total_bytes'], real.get('device_used_bytes')))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    parser.add_argument("--plans", default=",".join(plans()), help="comma-separated plan names")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="override every model's")
    parser.add_argument("--seq-len", type=int, default=None, help="override every model's")
    parser.add_argument("--target", default=None, help="memfit device profile (default: this GPU)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--dry-only", action="store_true", help="predictions only (no GPU)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        model, plan_name, batch, seq, steps = args.child
        print(json.dumps(run_real(model, plan_name, int(batch), int(seq), int(steps))))
        return 0
    unknown = [p for p in args.plans.split(",") if p not in plans()]
    if unknown:
        print(f"error: unknown plan {unknown[0]!r}; use {', '.join(plans())}", file=sys.stderr)
        return 2
    has_gpu = dev.cuda_available()
    if not has_gpu and not args.dry_only:
        print(
            "error: no CUDA device: this harness compares predictions with a real GPU; run it "
            "on a GPU machine, or pass --dry-only for the predictions alone",
            file=sys.stderr,
        )
        return 2
    target = args.target or (machine_device().name if has_gpu else "h100")
    gpu_name = dev.device_name("cuda") if has_gpu else None
    rows = []
    for model in args.models.split(","):
        batch, seq = MODELS.get(model, (8, 128))
        batch, seq = args.batch_size or batch, args.seq_len or seq
        for plan_name in args.plans.split(","):
            print(f"{model} / {plan_name}: predicting for {target}", file=sys.stderr)
            t0 = time.perf_counter()
            row: dict[str, Any] = {
                "model": model,
                "plan": plan_name,
                "batch_size": batch,
                "seq_len": seq,
                "predicted": predict(model, plan_name, batch, seq, args.steps, target),
                "predict_seconds": time.perf_counter() - t0,
            }
            if has_gpu and not args.dry_only:
                print(f"{model} / {plan_name}: running on {gpu_name}", file=sys.stderr)
                row["real"] = _real_in_subprocess(model, plan_name, batch, seq, args.steps)
                real, pred = row["real"], row["predicted"]
                row["rel_error"] = {
                    "tensor_peak_vs_max_allocated": _err(
                        pred["tensor_peak_bytes"], real.get("max_allocated_bytes")
                    ),
                    "allocated_vs_max_allocated": _err(
                        pred["allocated_bytes"], real.get("max_allocated_bytes")
                    ),
                    "reserved_vs_max_reserved": _err(
                        pred["reserved_bytes"], real.get("max_reserved_bytes")
                    ),
                    "device_total_vs_used": _err(
                        pred["device_total_bytes"], real.get("device_used_bytes")
                    ),
                }
            rows.append(row)
    result = {
        "target": target,
        "gpu": gpu_name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": args.steps,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_{target}" + ("_predictions" if args.dry_only or not has_gpu else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    title = f"{gpu_name or target}: predicted vs measured, torch {torch.__version__}"
    table = markdown(rows, title) if has_gpu and not args.dry_only else ""
    if table:
        (args.out / f"{stem}.md").write_text(table + "\n")
        print(table)
    print(f"wrote {args.out / (stem + '.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
