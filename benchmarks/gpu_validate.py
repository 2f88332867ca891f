"""Validate memfit's GPU predictions against real training steps on a real GPU.

For each model and plan, this compares memfit's dry run for the GPU (``memfit.measure(...,
dry=True, device=<profile>)``: kernel emulation, caching-allocator model, fixed overhead) with
what the GPU reports after real training steps of the same workload under the same plan:

==========================  =====================================================
prediction                  measured on the GPU
==========================  =====================================================
tensor peak (tracker)       ``torch.cuda.max_memory_allocated``
allocated peak (rounded)    ``torch.cuda.max_memory_allocated``
reserved peak (allocator)   ``torch.cuda.max_memory_reserved``
device total (+ overhead)   memory this process holds on the device: the driver's
                            used memory (NVML) after the steps minus before CUDA
                            started; without ``pynvml``, ``total - free`` from
                            ``torch.cuda.mem_get_info`` (then other processes count)
==========================  =====================================================

Each real run is a fresh subprocess, so the CUDA context and the allocator's cache start clean.
It builds the model on the CPU as ``memfit.measure`` does, moves model and batch to the GPU,
applies the plan, empties the allocator's cache and resets the peak counters (the dry run's
tracker also starts after the plan is applied), then runs ``--steps`` training steps. A second
subprocess repeats the run under ``memfit.track`` (skip it with ``--no-track``): its tensor
peak on the GPU separates the dry run's kernel emulation (``dry vs tracked``) from the
allocator model, which then replays the *real* run's allocations (``replay vs reserved``).
A probe subprocess first measures the CUDA context and the cuBLAS workspace on their own.

Run it on a machine with a CUDA GPU::

    pip install torch==<version> --index-url https://download.pytorch.org/whl/cu128  # CUDA build
    pip install -e ".[bench]"   # memfit; bench brings bitsandbytes and torchao, not needed here
    pip install nvidia-ml-py    # optional: the driver's view of used memory (see above)
    python benchmarks/gpu_validate.py                 # 4 models x 4 plans, about 10 minutes
    python benchmarks/gpu_validate.py --models bert-base --plans baseline,best --steps 3

To predict on the torch memfit supports and measure on the GPU machine's own, predict first
(``--dry-only --target h200``) and pass that file to the GPU run (``--predictions FILE``): its
rows are taken instead of computing them there.

Options: ``--models``, ``--plans`` (``baseline``, ``bf16-selective``, ``best``,
``accum-8bit``), ``--track-plans`` (the plans whose tracked run is repeated; default all),
``--predictions``, ``--batch-size`` / ``--seq-len`` (override every model's), ``--target`` (the
memfit profile to predict for; default: the one matching this GPU's name), ``--device-name``
(the ``<device>`` in the file names), ``--out`` (default ``benchmarks/results``).

It writes ``benchmarks/results/gpu_<device>.json`` (every number, per step too, with the
GPU, torch, CUDA and driver versions and ``PYTORCH_CUDA_ALLOC_CONF``) and ``gpu_<device>.md``,
the table it also prints. Each error column is ``(predicted - measured) / measured``: positive
means memfit over-predicts (safe, but a plan that would fit may be refused), negative means it
under-predicts (a plan it says fits could run out of memory). A run that runs out of memory is a
row with ``"oom": true``. Without a GPU it exits with code 2 and writes nothing, unless
``--dry-only`` is given: then it computes the predictions alone, on any machine, and writes
``gpu_<target>_predictions.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from torch.utils._pytree import tree_map_only

import memfit
from memfit import device as dev
from memfit.outputs import output_problem, write_text
from memfit.targets import DEVICES, get_device
from memfit.units import GiB

#: Model -> (batch size, sequence length) that an 80 GB GPU holds under the baseline plan.
MODELS: dict[str, tuple[int, int]] = {
    "bert-base": (32, 128),
    "bert-large": (32, 128),
    "gpt2-medium": (8, 512),
    "llama-1b": (4, 512),
}
#: Batch size and length for a model not in MODELS.
OTHER_MODEL = (8, 128)


def plans() -> dict[str, memfit.Plan]:
    """The plans validated, by the names ``--plans`` takes."""
    from memfit.bench.ladder import ladder_plans

    # The ladder's own plan, so that this harness follows it if the ladder's best one changes.
    best = dict(ladder_plans())["best full fine-tune"]
    return {
        "baseline": memfit.Plan(),
        "bf16-selective": memfit.Plan(precision="bf16-mixed", checkpointing="selective"),
        "best": best,
        "accum-8bit": memfit.Plan(grad_accum_steps=4, optimizer="adamw8bit"),
    }


# --------------------------------------------------------------------------- the GPU


def target_for_gpu(
    name: str, capability: tuple[int, int] | None, total_bytes: int | None
) -> tuple[str, str]:
    """memfit's profile for a GPU, and a short name for the result files.

    The GPU's name decides where it names a known card: memory alone cannot tell an 80 GB A100
    from an H100, which differ in kernels (compute capability). Another GPU gets the built-in
    profile of its compute capability (the kernels a dry run emulates depend on it, not on
    the memory), closest in memory; its files are named after the GPU.

    Args:
        name: ``torch.cuda.get_device_name`` (``NVIDIA H100 80GB HBM3``).
        capability: ``(major, minor)`` compute capability, if known.
        total_bytes: The device's memory, if known.

    Returns:
        ``(profile name, device name)``, for example ``("h100", "h100")`` or
        ``("h100", "gh200-480gb")`` for a 95 GiB GH200 (the sm90 profile closest in memory).
    """
    known = (
        (r"\bH100\b|\bH800\b", "h100"),
        (r"\bH200\b", "h200"),
        (r"\bA100\b|\bA800\b", "a100"),
        (r"\b4090\b", "rtx4090"),
        (r"\bT4\b", "t4"),
    )
    for pattern, profile in known:
        if re.search(pattern, name, re.IGNORECASE):
            if profile == "a100" and total_bytes is not None and total_bytes < 60 * GiB:
                profile = "a100-40gb"
            return profile, profile
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"
    candidates = [d for d in DEVICES.values() if d.compute_capability == capability]
    candidates = candidates or list(DEVICES.values())
    memory = total_bytes or 0
    return min(candidates, key=lambda d: abs(d.memory_bytes - memory)).name, slug


def _nvml_used(device: torch.device) -> int | None:
    """The driver's used memory on ``device`` (all processes), or None without ``pynvml``."""
    try:
        return dev.device_memory_used(device)
    except Exception:  # no pynvml, no NVML driver: the mem_get_info figures remain
        return None


def probe(device: torch.device) -> dict[str, Any]:
    """The GPU, and the fixed overhead measured on its own (called in a fresh subprocess).

    ``context_bytes``: what this process holds on the device outside the caching allocator
    right after CUDA starts (the driver's context before kernels load lazily);
    ``context_after_matmul_bytes``: the same after an fp32 and a bf16 matmul (cuBLAS loaded);
    ``cublas_workspace_bytes``: what those matmuls leave allocated in the caching allocator.
    """
    used0 = _nvml_used(device)
    torch.ones(1, device=device)
    dev.synchronize(device)
    out: dict[str, Any] = {
        "name": dev.device_name(device),
        "capability": dev.device_capability(device),
        "total_bytes": dev.total_memory(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nvml": used0 is not None,
    }
    out["context_bytes"] = _outside_allocator(device, used0)
    allocated0 = dev.memory_allocated(device) or 0
    a = torch.randn(1024, 1024, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        b = a.to(dtype)
        (b @ b).sum().item()
        del b
    del a
    dev.synchronize(device)
    out["cublas_workspace_bytes"] = (dev.memory_allocated(device) or 0) - allocated0
    out["context_after_matmul_bytes"] = _outside_allocator(device, used0)
    return out


def _process_used(device: torch.device, used0: int | None) -> int | None:
    """Device memory this process holds: NVML's delta when known, else ``total - free``."""
    info = dev.mem_get_info(device)
    if info is None:
        return None
    if used0 is not None:
        used = _nvml_used(device)
        if used is not None:
            return used - used0
    return info[1] - info[0]


def _outside_allocator(device: torch.device, used0: int | None) -> int | None:
    used = _process_used(device, used0)
    return None if used is None else used - (dev.memory_reserved(device) or 0)


# --------------------------------------------------------------------------- the runs


def predict(model: str, plan_name: str, batch: int, seq: int, steps: int, target: str) -> dict:
    """memfit's dry-run prediction for ``target``.

    Reads the report's device fields where they exist and falls back on ``meta`` (the fields
    arrived in stages): a missing figure is ``None``, never an error.
    """
    workload = memfit.load_workload(model, batch, seq)
    report = memfit.measure(workload, plans()[plan_name], steps=steps, dry=True, device=target)
    meta = report.meta
    reserved = getattr(report, "peak_reserved_bytes", None) or meta.get("peak_reserved_bytes")
    overhead = getattr(report, "overhead_bytes", None)
    total = meta.get("predicted_device_total_bytes")
    if total is None and reserved is not None and overhead is not None:
        total = reserved + overhead
    return {
        "target_device": meta.get("target_device", target),
        "tensor_peak_bytes": report.peak_bytes,
        "allocated_bytes": meta.get("peak_allocated_bytes"),
        "reserved_bytes": reserved,
        "overhead_bytes": overhead,
        "device_total_bytes": total,
        "peak_by_category": report.peak_by_category,
        "peak_phase": report.peak_phase,
        "attention_backends": meta.get("attention_backends"),
        "num_parameters": meta.get("num_parameters"),
    }


def _is_oom(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or (
        "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text
    )


def run_real(spec: dict[str, Any]) -> dict[str, Any]:
    """Real training steps (called in a fresh subprocess, so the device starts clean).

    Args:
        spec: ``model``, ``plan``, ``batch_size``, ``seq_len``, ``steps``; ``track`` (run under
            ``memfit.track`` and replay its trace through the allocator model for ``target``);
            ``device`` (default ``cuda``; ``cpu`` exercises the code without a GPU, with the
            CUDA figures ``None``).

    Returns:
        The measured figures; ``oom`` is true when the device ran out of memory (the figures
        are then those reached before it did).
    """
    device = torch.device(spec.get("device", "cuda"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # an explicit index: NVML then starts no context
    used0 = _nvml_used(device)
    torch.ones(1, device=device)  # start CUDA before measuring what it takes
    dev.synchronize(device)
    out: dict[str, Any] = {
        "oom": False,
        "nvml": used0 is not None,
        "used_after_init_bytes": _process_used(device, used0),
        "steps": [],
    }
    plan = plans()[spec["plan"]]
    workload = memfit.load_workload(spec["model"], spec["batch_size"], spec["seq_len"])
    with ExitStack() as stack:
        try:
            model, batch = workload.build(seed=0)
            model = model.to(device)
            batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
            from memfit.apply.compose import apply_plan

            setup = apply_plan(model, plan, loss_fn=workload.loss_fn)
            dev.synchronize(device)
            out["setup_max_allocated_bytes"] = dev.max_memory_allocated(device)
            out["setup_max_reserved_bytes"] = dev.max_memory_reserved(device)
            # The dry run counts from the applied plan on: blocks freed while applying it
            # (bf16-pure's fp32 weights) are returned, and the peaks restart here.
            dev.empty_cache()
            dev.reset_peak_memory_stats(device)
            out["start_allocated_bytes"] = dev.memory_allocated(device)
            out["start_reserved_bytes"] = dev.memory_reserved(device)
            tracker = None
            if spec.get("track"):
                tracker = stack.enter_context(memfit.track(model, setup.optimizer))
                tracker.add_inputs(batch)
            for _ in range(spec["steps"]):
                t0 = time.perf_counter()
                loss = float(setup.step(batch))
                dev.synchronize(device)
                out["steps"].append(
                    {
                        "seconds": time.perf_counter() - t0,
                        "loss": loss,
                        "allocated_bytes": dev.memory_allocated(device),
                        "max_allocated_bytes": dev.max_memory_allocated(device),
                        "reserved_bytes": dev.memory_reserved(device),
                        "max_reserved_bytes": dev.max_memory_reserved(device),
                        "process_used_bytes": _process_used(device, used0),
                    }
                )
        except Exception as e:
            if not _is_oom(e):
                raise
            out.update(oom=True, error=str(e).splitlines()[0][:300])
            tracker = None
    dev.synchronize(device)
    used = [s["process_used_bytes"] for s in out["steps"] if s["process_used_bytes"] is not None]
    out.update(
        max_allocated_bytes=dev.max_memory_allocated(device),
        max_reserved_bytes=dev.max_memory_reserved(device),
        # The caching allocator keeps what it reserved, so the most the process held shows
        # after some step; the transient peak inside a step is in max_reserved_bytes.
        process_used_bytes=max(used, default=None),
        outside_allocator_bytes=_outside_allocator(device, used0),
        total_bytes=dev.total_memory(device),
    )
    if tracker is not None:
        from memfit.estimate.target import device_memory

        report = tracker.report()
        replayed = device_memory(tracker.trace(), get_device(spec["target"]), report.peak_bytes)
        out["tracked"] = {
            "tensor_peak_bytes": report.peak_bytes,
            "peak_by_category": report.peak_by_category,
            "replayed_allocated_bytes": replayed["peak_allocated_bytes"],
            "replayed_reserved_bytes": replayed["peak_reserved_bytes"],
        }
    return out


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    """Run this script with ``args`` in a fresh process; its last stdout line is JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"oom": False, "error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return {"oom": "out of memory" in done.stderr.lower(), "error": last[:300]}


# --------------------------------------------------------------------------- the comparison


def rel_err(predicted: int | None, measured: int | None) -> float | None:
    """``(predicted - measured) / measured``, or None when either is missing."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def compare(pred: dict[str, Any], real: dict[str, Any]) -> dict[str, float | None]:
    """Relative errors of a row (None where a figure is missing or the run failed)."""
    if real.get("oom") or real.get("error"):
        return {}
    tracked = real.get("tracked") or {}
    measured_alloc = real.get("max_allocated_bytes")
    return {
        "tensor_peak_vs_max_allocated": rel_err(pred.get("tensor_peak_bytes"), measured_alloc),
        "allocated_vs_max_allocated": rel_err(pred.get("allocated_bytes"), measured_alloc),
        "reserved_vs_max_reserved": rel_err(
            pred.get("reserved_bytes"), real.get("max_reserved_bytes")
        ),
        "device_total_vs_process_used": rel_err(
            pred.get("device_total_bytes"), real.get("process_used_bytes")
        ),
        "dry_vs_tracked_tensor_peak": rel_err(
            pred.get("tensor_peak_bytes"), tracked.get("tensor_peak_bytes")
        ),
        "replayed_reserved_vs_max_reserved": rel_err(
            tracked.get("replayed_reserved_bytes"), real.get("max_reserved_bytes")
        ),
    }


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GiB:.2f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def markdown(rows: list[dict[str, Any]], title: str, gpu: dict[str, Any] | None = None) -> str:
    """The table of measured peaks and relative errors, with notes on how to read it."""
    lines = [
        f"### {title}",
        "",
        "| model | plan | batch x len | max alloc GiB | tensor peak | allocated "
        "| max reserved GiB | reserved | process GiB | device total | dry vs tracked "
        "| replay vs reserved | step s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        real, err = r.get("real") or {}, r.get("rel_error") or {}
        head = f"| {r['model']} | {r['plan']} | {r['batch_size']} x {r['seq_len']} "
        if real.get("oom") or real.get("error") or "error" in r["predicted"]:
            what = "OOM" if real.get("oom") else "error"
            why = real.get("error") or r["predicted"].get("error", "")
            lines.append(head + f"| {what}: {why.replace('|', '/')[:120]} |" + " |" * 9)
            continue
        steps = real.get("steps") or [{}]
        lines.append(
            head + f"| {_gib(real.get('max_allocated_bytes'))} "
            f"| {_pct(err.get('tensor_peak_vs_max_allocated'))} "
            f"| {_pct(err.get('allocated_vs_max_allocated'))} "
            f"| {_gib(real.get('max_reserved_bytes'))} "
            f"| {_pct(err.get('reserved_vs_max_reserved'))} "
            f"| {_gib(real.get('process_used_bytes'))} "
            f"| {_pct(err.get('device_total_vs_process_used'))} "
            f"| {_pct(err.get('dry_vs_tracked_tensor_peak'))} "
            f"| {_pct(err.get('replayed_reserved_vs_max_reserved'))} "
            f"| {steps[-1].get('seconds', 0):.3f} |"
        )
    lines += [
        "",
        "Errors are (predicted - measured) / measured: positive over-predicts (safe), negative "
        "under-predicts. *tensor peak* and *allocated*: the dry run's tensor bytes and its "
        "allocator-rounded bytes vs `max_memory_allocated`; *reserved*: the allocator model vs "
        "`max_memory_reserved`; *device total*: reserved plus the profile's context and "
        "workspaces vs the memory this process held on the device; *dry vs tracked*: the dry "
        "run's tensor peak vs the tracker on the real run (kernel emulation alone); *replay vs "
        "reserved*: the allocator model replaying the real run's allocations (allocator model "
        "alone). *step s*: the last step's wall time.",
    ]
    if gpu:
        lines += [
            "",
            f"Measured on its own: CUDA context {_mib(gpu.get('context_bytes'))} at start, "
            f"{_mib(gpu.get('context_after_matmul_bytes'))} once cuBLAS is loaded; cuBLAS "
            f"workspace {_mib(gpu.get('cublas_workspace_bytes'))} (in the allocator).",
        ]
    return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.0f} MiB"


# --------------------------------------------------------------------------- main


def _env() -> dict[str, Any]:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memfit": getattr(memfit, "__version__", None),
        "git_commit": commit,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="See the module docstring (benchmarks/gpu_validate.py) for how to read the table.",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    parser.add_argument("--plans", default=",".join(plans()), help="comma-separated plan names")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=None, help="override every model's")
    parser.add_argument("--seq-len", type=int, default=None, help="override every model's")
    parser.add_argument("--target", default=None, help="memfit profile (default: this GPU's)")
    parser.add_argument("--device-name", default=None, help="<device> in gpu_<device>.json")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--dry-only", action="store_true", help="predictions only (no GPU)")
    parser.add_argument("--no-track", action="store_true", help="skip the tracked real runs")
    parser.add_argument(
        "--track-plans", default=None,
        help="comma-separated plans whose real run is repeated under the tracker (default: all)",
    )
    parser.add_argument(
        "--predictions", type=Path, default=None,
        help="a --dry-only run's JSON: take its predictions for the same rows instead of "
        "computing them here (predict on the supported torch, run on the GPU's own)",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per real run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Validate, or with ``--dry-only`` predict; returns the exit code."""
    args = _parse(argv)
    if args.child:
        print(json.dumps(run_real(json.loads(args.child))))
        return 0
    if args.probe:
        print(json.dumps(probe(torch.device("cuda", 0))))
        return 0

    models, plan_names = args.models.split(","), args.plans.split(",")
    unknown = [p for p in plan_names if p not in plans()]
    if unknown:
        return _fail(f"unknown plan {unknown[0]!r}; use {', '.join(plans())}")
    if args.steps < 1:
        return _fail(f"--steps must be at least 1, got {args.steps}")
    for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            return _fail(f"{name} must be at least 1, got {value}")
    try:
        for model in models:
            memfit.load_workload(model, 1, 1)
        if args.target:
            get_device(args.target)
    except ValueError as e:
        return _fail(str(e))
    # The files' names wait for the GPU's name; their folder is checked before any work.
    problem = output_problem(args.out, folder=True)
    if problem is not None:
        return _fail(f"--out {args.out}: {problem}")
    real = not args.dry_only
    # Only cuda_available() here: the parent creates no CUDA context, which would take device
    # memory while the children measure.
    if real and not dev.cuda_available():
        return _fail(
            "no CUDA device: this harness compares memfit's predictions with real training "
            "steps on a GPU, so run it on a GPU machine, or pass --dry-only for the "
            "predictions alone"
        )

    gpu: dict[str, Any] | None = None
    if real:
        print("probing the GPU", file=sys.stderr)
        gpu = _child(["--probe"], args.timeout)
        if "error" in gpu:
            return _fail(f"the GPU probe failed: {gpu['error']}")
        target, device_name = target_for_gpu(
            gpu["name"], tuple(gpu["capability"]), gpu["total_bytes"]
        )
        target = args.target or target
    else:
        target = args.target or "h100"
        device_name = target
    device_name = args.device_name or device_name

    try:
        earlier = _earlier_predictions(args.predictions, target)
    except (OSError, ValueError) as e:
        return _fail(f"--predictions {args.predictions}: {e}")
    tracked_plans = set(plan_names if args.track_plans is None else args.track_plans.split(","))
    rows: list[dict[str, Any]] = []
    n = len(models) * len(plan_names)
    for model in models:
        batch, seq = MODELS.get(model, OTHER_MODEL)
        batch, seq = args.batch_size or batch, args.seq_len or seq
        for plan_name in plan_names:
            tag = f"[{len(rows) + 1}/{n}] {model} / {plan_name} ({batch} x {seq})"
            t0 = time.perf_counter()
            pred = earlier.get((model, plan_name, batch, seq, args.steps))
            if pred is None:
                try:
                    pred = predict(model, plan_name, batch, seq, args.steps, target)
                except Exception as e:  # one failed prediction is a row, not the end of the run
                    pred = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            row: dict[str, Any] = {
                "model": model,
                "plan": plan_name,
                "plan_spec": plans()[plan_name].to_dict(),
                "batch_size": batch,
                "seq_len": seq,
                "steps": args.steps,
                "predicted": pred,
                "predict_seconds": round(time.perf_counter() - t0, 3),
            }
            print(f"{tag}: predicted for {target}: {_summary(pred)}", file=sys.stderr)
            if real:
                spec = {
                    "model": model,
                    "plan": plan_name,
                    "batch_size": batch,
                    "seq_len": seq,
                    "steps": args.steps,
                    "target": target,
                }
                measured = _child(["--child", json.dumps(spec)], args.timeout)
                track = not args.no_track and plan_name in tracked_plans
                if track and not measured.get("oom") and "error" not in measured:
                    tracked = _child(["--child", json.dumps({**spec, "track": True})], args.timeout)
                    measured["tracked"] = tracked.get("tracked") or {
                        "error": tracked.get("error", "no tracker report")
                    }
                row["real"] = measured
                row["oom"] = bool(measured.get("oom"))
                row["rel_error"] = compare(pred, measured)
                print(
                    f"{tag}: measured on {gpu and gpu['name']}: {_summary(measured)}",
                    file=sys.stderr,
                )
            rows.append(row)
            # Written after every row: a run stopped by its time limit (a lent GPU's lease)
            # keeps the rows it measured.
            stem = _write(args, device_name, target, gpu, rows, real)

    if real:
        title = (
            f"{gpu and gpu['name']}: memfit's predictions for `{target}` vs real steps, "
            f"torch {torch.__version__}, {args.steps} steps"
        )
        table = markdown(rows, title, gpu)
        write_text(args.out / f"{stem}.md", table + "\n")
        print(table)
    print(f"wrote {args.out / (stem + '.json')}", file=sys.stderr)
    return 0


def _write(
    args: argparse.Namespace,
    device_name: str,
    target: str,
    gpu: dict[str, Any] | None,
    rows: list[dict[str, Any]],
    real: bool,
) -> str:
    """Write the JSON of the rows so far; returns the files' stem."""
    result = {
        "device_name": device_name,
        "target": target,
        "gpu": gpu,
        "env": _env(),
        "steps": args.steps,
        "rows": rows,
    }
    stem = f"gpu_{device_name}" + ("" if real else "_predictions")
    write_text(args.out / f"{stem}.json", json.dumps(result, indent=2) + "\n")
    return stem


def _earlier_predictions(
    path: Path | None, target: str
) -> dict[tuple[str, str, int, int, int], dict[str, Any]]:
    """``--predictions``' rows by (model, plan, batch size, length, steps); empty without it.

    Raises:
        ValueError: the file is not a ``--dry-only`` result, or predicts for another target.
    """
    if path is None:
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError("not a gpu_validate.py result (no 'rows')")
    if data.get("target") != target:
        raise ValueError(f"it predicts for {data.get('target')!r}, this run for {target!r}")
    return {
        (r["model"], r["plan"], r["batch_size"], r["seq_len"], r["steps"]): r["predicted"]
        for r in data["rows"]
        if "error" not in r["predicted"]
    }


def _summary(figures: dict[str, Any]) -> str:
    """One progress line's worth of a prediction or a measurement."""
    if figures.get("oom"):
        return "out of memory"
    if "error" in figures:
        return f"failed: {figures['error']}"
    if "max_allocated_bytes" in figures:
        return (
            f"max allocated {_gib(figures['max_allocated_bytes'])} GiB, max reserved "
            f"{_gib(figures['max_reserved_bytes'])} GiB"
        )
    return (
        f"tensor peak {_gib(figures['tensor_peak_bytes'])} GiB, reserved "
        f"{_gib(figures.get('reserved_bytes'))} GiB, total "
        f"{_gib(figures.get('device_total_bytes'))} GiB"
    )


if __name__ == "__main__":
    sys.exit(main())
