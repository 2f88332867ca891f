"""Validate memfit's offload techniques on a real CUDA device.

The offload techniques' CUDA paths (pinned host buffers, a side copy stream, non-blocking copies
and the events that order them, :mod:`memfit.device`) cannot run on the CPU-only development
machines, where the same code takes plain synchronous copies. This harness trains a workload for
``--steps`` steps under each variant below, each in a fresh subprocess (a clean CUDA context and
allocator), from the same initial weights, batch and dropout seeds, and compares:

* **numerics**: the parameters after the last step with the ``none`` variant's (same precision):
  ``max |dp|`` and ``rel = ||p - p_none|| / ||p_none - p_init||`` (the difference against the
  size of the training update, over all parameters). ``none-repeat`` runs the ``none`` plan again:
  its difference is the device's own run-to-run noise (non-deterministic kernels), the floor for
  every other row (each run asks for deterministic algorithms; memory-efficient attention's
backward, fp32's, has none). A row passes when ``rel <= 1e-3`` (fp32) or ``1e-2`` (bf16-mixed): the
  offloaded optimizer is torch's fused CPU AdamW where the device runs its foreach CUDA AdamW, the
  same update rounded in another order; a broken copy or ordering gives ``rel`` of order 1;
* **memory**: the device peak ``torch.cuda.max_memory_allocated`` over the steps (counted from the
  applied plan on, as ``benchmarks/gpu_validate.py`` does) against memfit's dry-run prediction for
  the same plan and the ``--target`` profile (``memfit.dry_run(workload, plan, device=target)``,
  its allocator-rounded device peak), and against the ``none`` variant's peak (the saving);
* **time**: the median step time (the first step, warm-up, left out) over the ``none`` variant's,
  beside the cost model's predicted ratio for the target (:mod:`memfit.estimate.cost`).

Variants (each on top of the precision's plain plan: AdamW, lr 1e-3)::

    none                              no offload
    none-repeat                       the same again (run-to-run noise)
    grad_buffer                       contiguous gradient buffer (not offload; its CUDA run)
    optimizer                         offload {optimizer: host}
    optimizer-in-backward             ... with optimizer_in_backward (buckets step in backward)
    optimizer+parameters              offload {optimizer: host, parameters: host}
    optimizer+parameters-in-backward  ... with optimizer_in_backward
    optimizer-disk                    offload {optimizer: disk} (a temporary directory)
    activations                       offload {activations: true}

With ``--llama``, llama-1b at ``--llama-batch`` x ``--llama-seq`` tokens (bf16-mixed, selective
checkpointing, micro-batches of ``--llama-micro``) runs without and with the optimizer on the
host (after backward, and stepping in backward): the step-time ratio, against the cost model's.

Run it on a machine with a CUDA GPU (the CPU-only ``--device cpu`` exercises the code at small
sizes)::

    python benchmarks/gpu_offload.py --predict-only --predictions preds.json   # any machine
    python benchmarks/gpu_offload.py --predictions preds.json --llama           # on the GPU

It writes ``<out>/gpu_offload.json`` (every figure, per step too, with the GPU, torch and CUDA
versions) and ``gpu_offload.md``. Without a GPU (and without ``--device cpu`` or
``--predict-only``) it exits with code 2 and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Deterministic cuBLAS (with torch.use_deterministic_algorithms in each run): the runs differ
# only where the device's kernels have no deterministic form (see the none-repeat row).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch.utils._pytree import tree_map_only

import memfit
from memfit import device as dev
from memfit.units import GiB

#: Variant -> the Plan's keyword arguments beside the precision ("DISK": a temporary directory).
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "none-repeat": {},
    "grad_buffer": {"grad_buffer": True},
    "optimizer": {"offload": {"optimizer": "host"}},
    "optimizer-in-backward": {"offload": {"optimizer": "host"}, "optimizer_in_backward": True},
    "optimizer+parameters": {"offload": {"optimizer": "host", "parameters": "host"}},
    "optimizer+parameters-in-backward": {
        "offload": {"optimizer": "host", "parameters": "host"},
        "optimizer_in_backward": True,
    },
    "optimizer-disk": {"offload": {"optimizer": "disk", "disk_dir": "DISK"}},
    "activations": {"offload": {"activations": True}},
}
#: llama-1b's variants (beside bf16-mixed, selective checkpointing and the micro-batch size).
LLAMA_VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "optimizer": {"offload": {"optimizer": "host"}},
    "optimizer-in-backward": {"offload": {"optimizer": "host"}, "optimizer_in_backward": True},
}
#: Largest ``rel`` (parameter difference over the update's size) that passes, per precision.
TOLERANCE = {"fp32": 1e-3, "bf16-mixed": 1e-2}


def _plan(spec: dict[str, Any], disk_dir: str | None = None) -> memfit.Plan:
    kwargs = json.loads(json.dumps(spec["plan"]))
    off = kwargs.get("offload")
    if isinstance(off, dict) and off.get("disk_dir") == "DISK":
        off["disk_dir"] = disk_dir or tempfile.gettempdir()
    return memfit.Plan(**kwargs)


def _workload(spec: dict[str, Any]) -> memfit.Workload:
    workload = memfit.load_workload(spec["model"], spec["batch_size"], spec["seq_len"])
    if spec.get("depth"):
        assert workload.with_depth is not None
        workload = workload.with_depth(spec["depth"])
    return workload


def runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs to make, in order (each ``none`` before the rows compared with it)."""
    out = []
    for precision in filter(None, args.precisions.split(",")):  # "": llama's runs alone
        for name in args.variants.split(","):
            out.append({
                "id": f"{args.model}/{precision}/{name}", "group": f"{args.model}/{precision}",
                "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                "depth": args.depth, "precision": precision, "variant": name,
                "plan": {"precision": precision, **VARIANTS[name]}, "steps": args.steps,
                "save_params": True,
            })  # fmt: skip
    if args.llama:
        micro = min(args.llama_micro, args.llama_batch)
        base = {"precision": "bf16-mixed", "checkpointing": "selective",
                **json.loads(args.llama_plan), "micro_batch_size": micro}  # fmt: skip
        label = base["precision"] + (f"/{base['optimizer']}" if "optimizer" in base else "")
        for name in args.llama_variants.split(","):
            out.append({
                "id": f"{args.llama_model}/{label}/{name}", "group": f"{args.llama_model}/{label}",
                "model": args.llama_model, "batch_size": args.llama_batch,
                "seq_len": args.llama_seq, "depth": args.llama_depth,
                "precision": base["precision"], "variant": name,
                "plan": {**base, **LLAMA_VARIANTS[name]}, "steps": args.llama_steps,
                "save_params": False,
            })  # fmt: skip
    for spec in out:
        # What a prediction is for: the run's id, sizes and plan.
        spec["key"] = json.dumps([spec["id"], spec["batch_size"], spec["seq_len"],
                                  spec["depth"], spec["plan"]], sort_keys=True)  # fmt: skip
    return out


# --------------------------------------------------------------------------- predictions


def predict(spec: dict[str, Any], target: str) -> dict[str, Any]:
    """memfit's dry run and cost model for ``spec`` on ``target`` (no device needed)."""
    from memfit.estimate.cost import profile_workload, step_cost
    from memfit.targets import get_device

    workload, t0 = _workload(spec), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plan = _plan(spec, tmp)
        report = memfit.dry_run(workload, plan, steps=2, device=target)
    cost = step_cost(profile_workload(workload), plan, get_device(target),
                     batch_size=workload.batch_size)  # fmt: skip
    return {
        "target": target,
        "device_peak_bytes": report.peak_by_tier.get("device", report.peak_bytes),
        "allocated_bytes": report.meta.get("peak_allocated_bytes"),
        "reserved_bytes": report.peak_reserved_bytes,
        "host_peak_bytes": report.peak_by_tier.get("host", 0),
        "peak_by_category": report.peak_by_category,
        "step_seconds": cost.total,
        "step_terms": cost.to_dict(),
        "seconds": round(time.perf_counter() - t0, 2),
    }


# --------------------------------------------------------------------------- a real run


def run_real(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec``'s steps (in a fresh subprocess) and measure; saves the final parameters
    (fp32, on the host) to ``spec["params_path"]`` and, when asked, the initial ones to
    ``spec["init_path"]``."""
    from memfit.apply.compose import apply_plan

    # Kernels without a deterministic form (memory-efficient attention's backward) only warn.
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    workload = _workload(spec)
    with device:  # initialised on the device: much faster than on the host for llama-1b
        model, batch = workload.build(seed=0)
    if spec.get("init_path"):
        torch.save({n: p.detach().to("cpu", torch.float32, copy=True)
                    for n, p in model.named_parameters()},
                   spec["init_path"])  # fmt: skip
    model = model.to(device)
    batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    out: dict[str, Any] = {"steps": []}
    with tempfile.TemporaryDirectory() as disk:
        setup = apply_plan(model, _plan(spec, disk), loss_fn=workload.loss_fn)
        dev.synchronize(device)
        dev.empty_cache()
        dev.reset_peak_memory_stats(device)
        out["start_allocated_bytes"] = dev.memory_allocated(device)
        for step in range(spec["steps"]):
            torch.manual_seed(1000 + step)  # the same dropout masks in every variant
            dev.synchronize(device)
            t0 = time.perf_counter()
            loss = float(setup.step(batch))
            dev.synchronize(device)
            out["steps"].append({"seconds": time.perf_counter() - t0, "loss": loss,
                                 "max_allocated_bytes": dev.max_memory_allocated(device)})  # fmt: skip
        out["max_allocated_bytes"] = dev.max_memory_allocated(device)
        out["max_reserved_bytes"] = dev.max_memory_reserved(device)
        setup.remove()  # streamed parameters come back to the device, trained values kept
    if spec.get("params_path"):
        torch.save({n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()},
                   spec["params_path"])  # fmt: skip
    times = [s["seconds"] for s in out["steps"][1:]] or [out["steps"][0]["seconds"]]
    out["step_seconds"] = statistics.median(times)
    out["host_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a fresh process; its last stdout line is JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return {**json.loads(lines[-1]), "wall_seconds": round(time.perf_counter() - t0, 1)}
    tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-3:]
    return {"error": f"exit code {done.returncode}: " + " / ".join(tail)[:600]}


def compare_params(path: str, ref_path: str, init_path: str) -> dict[str, float]:
    """``max_abs`` and ``rel`` (see the module docstring) of two saved parameter sets."""
    got, ref, init = (torch.load(p, map_location="cpu") for p in (path, ref_path, init_path))
    diff = update = max_abs = 0.0
    for name, r in ref.items():
        d = (got[name] - r).double()
        diff += float(d.square().sum())
        update += float((r - init[name]).double().square().sum())
        max_abs = max(max_abs, float(d.abs().max()))
    rel = math.sqrt(diff) / math.sqrt(update) if update else math.inf
    return {"max_abs": max_abs, "rel": rel, "finite": all(bool(t.isfinite().all()) for t in got.values())}


# --------------------------------------------------------------------------- the report


def _gib(n: float | None) -> str:
    return "" if n is None else f"{n / GiB:.2f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _num(x: float | None, fmt: str, suffix: str = "") -> str:
    return "" if x is None else f"{x:{fmt}}{suffix}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def analyse(rows: list[dict[str, Any]]) -> None:
    """Fill each row's comparisons with its group's ``none`` row (in place)."""
    base = {r["group"]: r for r in rows if r["variant"] == "none"}
    for r in rows:
        real, pred, ref = r.get("real") or {}, r.get("predicted") or {}, base.get(r["group"])
        ref_real = (ref or {}).get("real") or {}
        ref_pred = (ref or {}).get("predicted") or {}
        c: dict[str, Any] = {}
        if "error" not in real and real:
            c["predicted_vs_measured"] = _ratio(pred.get("allocated_bytes"), real["max_allocated_bytes"])
            if c["predicted_vs_measured"] is not None:
                c["predicted_vs_measured"] -= 1
            if "step_seconds" in ref_real:
                if real["max_allocated_bytes"] is not None:  # None off CUDA
                    c["saving_bytes"] = ref_real["max_allocated_bytes"] - real["max_allocated_bytes"]
                c["step_ratio"] = _ratio(real["step_seconds"], ref_real["step_seconds"])
                c["loss_max_abs_diff"] = max(abs(a["loss"] - b["loss"]) for a, b in
                                             zip(real["steps"], ref_real["steps"], strict=True))  # fmt: skip
        if pred and ref_pred and "error" not in pred and "error" not in ref_pred:
            c["predicted_saving_bytes"] = (ref_pred["allocated_bytes"] or 0) - (pred["allocated_bytes"] or 0)
            c["predicted_step_ratio"] = _ratio(pred["step_seconds"], ref_pred["step_seconds"])
        params = r.get("params")
        if params:
            c["params_pass"] = params["finite"] and params["rel"] <= TOLERANCE.get(r["precision"], 1e-2)
        r["comparison"] = c


def markdown(result: dict[str, Any]) -> str:
    """The tables of numerics, memory and time, one per model and precision."""
    rows = result["rows"]
    env = result["env"]
    lines = [
        f"# memfit offload on {env.get('gpu') or env['device']}",
        "",
        f"`{result['command']}`",
        "",
        f"torch {env['torch']} (CUDA {env['torch_cuda']}), Python {env['python']}, "
        f"{env['cpu_count']} CPU threads; predictions for the `{result['target']}` profile; "
        f"{result['seconds']:.0f} s in all."
        + (" **Partial: the run was cut short.**" if result.get("partial") else ""),
    ]
    for group in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == group]
        first = members[0]
        lines += ["", f"## {group}, batch {first['batch_size']} x {first['seq_len']} tokens, "
                  f"{first['steps']} steps" + (f", {first['depth']} blocks" if first.get("depth") else ""),
                  "", "| variant | params max abs diff | params rel | pass | device peak GiB "
                  "| predicted GiB | prediction error | saving GiB (predicted) | step s "
                  "| step ratio | cost-model ratio |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in members:
            real, pred, c, p = r.get("real") or {}, r.get("predicted") or {}, r["comparison"], r.get("params")
            if "error" in real:
                lines.append(f"| {r['variant']} | error: {real['error'][:200].replace('|', '/')} |" + " |" * 9)
                continue
            lines.append(
                f"| {r['variant']} | {_num(p and p['max_abs'], '.2e')} | {_num(p and p['rel'], '.2e')} "
                f"| {'' if 'params_pass' not in c else ('yes' if c['params_pass'] else '**no**')} "
                f"| {_gib(real.get('max_allocated_bytes'))} | {_gib(pred.get('allocated_bytes'))} "
                f"| {_pct(c.get('predicted_vs_measured'))} "
                f"| {_gib(c.get('saving_bytes'))} ({_gib(c.get('predicted_saving_bytes'))}) "
                f"| {_num(real.get('step_seconds'), '.3f')} | {_num(c.get('step_ratio'), '.2f', 'x')} "
                f"| {_num(c.get('predicted_step_ratio'), '.2f', 'x')} |"
            )
    lines += [
        "",
        "*params*: the parameters after the last step against the `none` row's: the largest "
        "absolute difference and `||p - p_none|| / ||p_none - p_init||`; *pass*: rel within "
        f"{TOLERANCE} (the `none-repeat` row is the device's run-to-run noise). *device peak*: "
        "`torch.cuda.max_memory_allocated` over the steps, from the applied plan on; *predicted*: "
        "the dry run's allocator-rounded device peak for the target profile; *prediction error*: "
        "(predicted - measured) / measured. *saving*: the `none` row's peak minus this row's. "
        "*step s*: median step time without the first; *step ratio* over the `none` row's; "
        "*cost-model ratio*: the same predicted by `memfit.estimate.cost.step_cost`.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _env(device: torch.device) -> dict[str, Any]:
    gpu = None
    if device.type == "cuda":
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                             capture_output=True, text=True, check=False)  # fmt: skip
        gpu = out.stdout.strip() or None
    return {
        "device": str(device), "gpu": gpu, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": torch.get_num_threads(),
    }  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--depth", type=int, default=None, help="blocks (default: the preset's)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--precisions", default="fp32,bf16-mixed", help='"": only --llama\'s runs')
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--llama", action="store_true", help="add llama-1b's step-time ratio")
    p.add_argument("--llama-model", default="llama-1b", help="the model of --llama")
    p.add_argument("--llama-plan", default="{}",
                   help="JSON of Plan fields over llama's base plan (bf16-mixed, selective)")
    p.add_argument("--llama-variants", default=",".join(LLAMA_VARIANTS))
    p.add_argument("--llama-batch", type=int, default=32)
    p.add_argument("--llama-seq", type=int, default=1024)
    p.add_argument("--llama-micro", type=int, default=8)
    p.add_argument("--llama-steps", type=int, default=4)
    p.add_argument("--llama-depth", type=int, default=None)
    p.add_argument("--target", default="h100", help="memfit profile the predictions are for")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--predictions", type=Path, default=None,
                   help="read predictions from this file (written by --predict-only)")
    p.add_argument("--predict-only", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="gpu_offload")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Predict, measure and compare; returns the exit code."""
    args = _parse(argv)
    if args.child:
        print(json.dumps(run_real(json.loads(args.child))))
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    unknown += [v for v in args.llama_variants.split(",") if v not in LLAMA_VARIANTS]
    if unknown or (args.precisions and "none" not in args.variants.split(",")):
        print(f"error: variants must include none and be among {', '.join(VARIANTS)} "
              f"(llama's among {', '.join(LLAMA_VARIANTS)})", file=sys.stderr)  # fmt: skip
        return 2
    from memfit.outputs import exit_if_unwritable, write_text

    if args.predict_only:
        if args.predictions:
            exit_if_unwritable({"--predictions": args.predictions})
        else:
            exit_if_unwritable({"--out": args.out / f"{args.name}_predictions.json"},
                               folders={"--out": args.out})
    else:
        for suffix in (".json", ".md"):
            exit_if_unwritable({"--out": args.out / f"{args.name}{suffix}"},
                               folders={"--out": args.out})
    device = torch.device(args.device or ("cuda" if dev.cuda_available() else "cpu"))
    if not args.predict_only and device.type == "cuda" and not dev.cuda_available():
        print("error: no CUDA device: use --device cpu to exercise the code", file=sys.stderr)
        return 2
    if not args.predict_only and args.device is None and device.type != "cuda":
        print("error: no CUDA device: this harness measures offload on a GPU; --device cpu runs "
              "it on the CPU, --predict-only computes the predictions alone", file=sys.stderr)  # fmt: skip
        return 2
    t_start = time.perf_counter()
    todo = runs(args)
    preds: dict[str, Any] = {}
    if args.predictions and args.predictions.exists():
        preds = json.loads(args.predictions.read_text())
    for spec in todo:
        if spec["key"] not in preds:
            print(f"predicting {spec['id']}", file=sys.stderr)
            try:
                preds[spec["key"]] = predict(spec, args.target)
            except Exception as e:  # one failed prediction is a row, not the end
                preds[spec["key"]] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if args.predict_only:
        path = args.predictions or args.out / f"{args.name}_predictions.json"
        write_text(path, json.dumps(preds, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
        return 0
    rows: list[dict[str, Any]] = []
    env = _env(device)

    def write(partial: bool) -> str:
        done = [{k: v for k, v in r.items() if k not in ("params_path", "init_path", "save_params", "key")}
                for r in rows]  # fmt: skip
        analyse(done)
        result = {
            "command": "python benchmarks/gpu_offload.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "target": args.target, "env": env, "tolerance": TOLERANCE, "partial": partial,
            "seconds": time.perf_counter() - t_start, "rows": done,
        }  # fmt: skip
        write_text(args.out / f"{args.name}.json", json.dumps(result, indent=1) + "\n")
        table = markdown(result)
        write_text(args.out / f"{args.name}.md", table + "\n")
        return table

    with tempfile.TemporaryDirectory() as tmp:
        for k, spec in enumerate(todo):
            spec = {**spec, "device": str(device)}
            if spec["save_params"]:
                spec["params_path"] = f"{tmp}/{k}.pt"
                if spec["variant"] == "none":
                    spec["init_path"] = f"{tmp}/{spec['group'].replace('/', '_')}_init.pt"
            real = _child(spec, args.timeout)
            row = {**spec, "predicted": preds.get(spec["key"]), "real": real}
            ref = next((r for r in rows if r["group"] == spec["group"] and r["variant"] == "none"), None)
            if spec["save_params"] and ref and "error" not in real and "error" not in ref["real"]:
                row["params"] = compare_params(spec["params_path"], ref["params_path"], ref["init_path"])
            rows.append(row)
            summary = real.get("error") or (
                f"peak {_gib(real['max_allocated_bytes']) or '?'} GiB, step {real['step_seconds']:.3f} s"
                + (f", params rel {row['params']['rel']:.2e}" if row.get("params") else ""))
            print(f"[{k + 1}/{len(todo)}] {spec['id']}: {summary}", file=sys.stderr, flush=True)
            write(partial=True)  # what ran so far survives a run cut short
    print(write(partial=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
