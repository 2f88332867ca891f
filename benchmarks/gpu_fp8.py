"""What FP8 training (torchao's float8 linears) keeps on a real GPU, against bf16.

memfit has no FP8 technique yet (issue 26 asks for one, through torchao's
``convert_to_float8_training``); its dry run will have to model on fake tensors what the float8
path keeps, since ``torch._scaled_mm`` needs an sm89+ GPU. This harness measures that on a GPU,
so the model can be checked against it: for each configuration, in a fresh subprocess,

* ``max_allocated`` / ``max_reserved``: ``torch.cuda.max_memory_allocated``/``reserved`` over
  the timed steps (after one warm-up step, with the peaks reset);
* ``forward_held``: what one forward leaves allocated for backward (allocated after the forward
  minus before it): the saved activations;
* ``saved``: the tensors autograd saves in one forward (``saved_tensors_hooks``), by dtype,
  counted once per storage, with the float8 training tensors' payloads and scales unwrapped;
* ``step_seconds``: the mean of the timed steps.

The model is a memfit preset (random weights) in bf16 with torch's AdamW; ``bf16`` is the
plain run, ``fp8-<recipe>`` converts every linear but the output head (torchao's recipes
``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``), and ``-compiled`` compiles the model
(torchao's speed assumes it; compilation fuses the casts, which changes the temporaries).
``plan-<precision>`` runs memfit's own plan instead (``precision: bf16-mixed`` or ``fp8``: fp32
master weights, bf16 autocast, and for ``fp8`` the float8 linears of memfit's conversion) through
``memfit.apply_plan``, and adds memfit's dry-run prediction for the same GPU profile
(``predicted_max_allocated``, ``predicted_forward_held``: the tracker's peak and what one forward
leaves live, on fake tensors), so the fp8 model is checked against the GPU.

Run on a GPU machine (torchao installed)::

    python benchmarks/gpu_fp8.py --out benchmarks/results
    python benchmarks/gpu_fp8.py --model llama-1b --batch-size 2 --seq-len 2048 \
        --configs bf16,fp8-tensorwise

It writes ``gpu_fp8_<device>.json`` and ``.md``. Without a CUDA device of compute capability
8.9 or newer it exits with code 2.

Without a GPU, ``--predict h200`` prints memfit's dry-run peaks for the eager configurations
on that profile instead (fake tensors: seconds on a CPU; ``bf16`` and ``fp8-tensorwise`` are
built as the harness builds them, bf16 weights and torch's AdamW)::

    python benchmarks/gpu_fp8.py --predict h200
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

CONFIGS = ("bf16", "fp8-tensorwise", "fp8-rowwise", "bf16-compiled", "fp8-tensorwise-compiled",
           "plan-bf16-mixed", "plan-fp8")
GiB = 1024**3


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    except Exception:  # a wrapper subclass without storage: its parts are counted instead
        return None


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor, or a float8 training tensor's payload and scale."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return [t]
    names, _ = flatten()
    out: list[torch.Tensor] = []
    for name in names:
        out.extend(_parts(getattr(t, name)))
    return out


class SavedCounter:
    """Counts autograd's saved tensors by dtype, each storage once; parameters apart."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: set[tuple[int, int]] = set()
        self.by_dtype: dict[str, int] = {}
        self.param_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for part in _parts(t):
            key = _storage_key(part)
            if key is None or key in self.seen:
                continue
            self.seen.add(key)
            if key[0] in self.params:
                self.param_bytes += key[1]
                continue
            name = str(part.dtype).replace("torch.", "")
            self.by_dtype[name] = self.by_dtype.get(name, 0) + key[1]
        return t


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's steps (in a fresh subprocess)."""
    import memfit
    from memfit.workload import call_model

    config: str = spec["config"]
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    workload = memfit.load_workload(spec["model"], spec["batch_size"], spec["seq_len"])
    model, batch = workload.build(seed=0)
    out: dict[str, Any] = {"config": config}
    if config.startswith("plan-"):
        return run_plan(spec, workload, model, batch, out)
    model = model.to(device=device, dtype=torch.bfloat16)
    batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    if config.startswith("fp8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = config.removeprefix("fp8-").removesuffix("-compiled")

        def keep(module: torch.nn.Module, fqn: str) -> bool:
            # The head stays bf16 (torchtitan's default); _scaled_mm needs dims divisible by 16.
            w = getattr(module, "weight", None)
            return "lm_head" not in fqn and w is not None and all(d % 16 == 0 for d in w.shape)

        convert_to_float8_training(
            model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe)
        )
        out["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if config.endswith("-compiled"):
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        loss = workload.loss_fn(call_model(model, batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    out["first_loss"] = step()
    torch.cuda.synchronize()
    out["first_step_seconds"] = time.perf_counter() - t0
    out["params_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    # One forward under the saved-tensor hooks: what backward will read.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counter = SavedCounter(params)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = workload.loss_fn(call_model(model, batch), batch)
    torch.cuda.synchronize()
    out["forward_held_bytes"] = torch.cuda.memory_allocated(device) - before
    out["saved_by_dtype_bytes"] = counter.by_dtype
    out["saved_parameter_bytes"] = counter.param_bytes
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    del loss
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    out["start_allocated_bytes"] = torch.cuda.memory_allocated(device)
    _timed_steps(step, spec["steps"], device, out)
    return out


def _timed_steps(step: Any, steps: int, device: torch.device, out: dict[str, Any]) -> None:
    """Run ``steps`` timed training steps; record their losses, mean time and the peaks since
    the caller reset them."""
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(float(step()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out.update(
        losses=losses,
        step_seconds=sum(times) / len(times),
        max_allocated_bytes=torch.cuda.max_memory_allocated(device),
        max_reserved_bytes=torch.cuda.max_memory_reserved(device),
    )


def run_plan(spec: dict[str, Any], workload: Any, model: Any, batch: Any,
             out: dict[str, Any]) -> dict[str, Any]:
    """A ``plan-<precision>`` configuration: memfit's plan on the GPU (fp32 masters), measured
    as the others are, with memfit's dry-run prediction for this GPU beside it."""
    import memfit
    from memfit.workload import call_model

    device = torch.device(spec.get("device", "cuda"))  # "cpu": a smoke test, no GPU
    plan = memfit.Plan(precision=spec["config"].removeprefix("plan-"))
    model = model.to(device)
    batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    setup = memfit.apply_plan(model, plan, loss_fn=workload.loss_fn)
    out["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    setup.step(batch)  # warm-up
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counter = SavedCounter(params)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
    with hooks, setup.precision.autocast():
        loss = workload.loss_fn(call_model(model, batch), batch)
    torch.cuda.synchronize()
    out["forward_held_bytes"] = torch.cuda.memory_allocated(device) - before
    out["saved_by_dtype_bytes"] = counter.by_dtype
    out["saved_parameter_bytes"] = counter.param_bytes
    loss.backward()
    setup.optimizer.zero_grad(set_to_none=True)
    del loss
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    _timed_steps(functools.partial(setup.step, batch), spec["steps"], device, out)
    setup.remove()
    del setup, model
    torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    target = "h200" if "H200" in name else "h100" if "H100" in name else "cpu"
    kw = dict(batch_size=spec["batch_size"], seq_len=spec["seq_len"], device=target)
    out["predicted_max_allocated_bytes"] = memfit.dry_run(
        spec["model"], plan, steps=spec["steps"] + 1, **kw
    ).peak_bytes
    out["predicted_forward_peak_bytes"] = memfit.dry_run(
        spec["model"], plan, steps=1, stop="forward", **kw
    ).peak_bytes
    return out


def predict(args: argparse.Namespace) -> list[str]:
    """memfit's dry-run peak of each eager configuration on the ``args.predict`` profile."""
    import dataclasses

    import memfit
    from memfit.strategies.fp8 import apply_fp8
    from memfit.strategies.precision import cast_module

    base = memfit.load_workload(args.model, args.batch_size, args.seq_len)

    def harness(fp8: bool) -> Any:
        def build() -> torch.nn.Module:
            model = base.build_model()
            cast_module(model, torch.bfloat16)  # bf16 weights, as run_one's .to(bfloat16)
            if fp8:
                apply_fp8(model)  # memfit's filter: dims of 16, no head (the harness's too)
            return model

        return dataclasses.replace(base, build_model=build, with_depth=None)

    runs = {
        "bf16": (harness(False), memfit.Plan()),
        "fp8-tensorwise": (harness(True), memfit.Plan()),
        "plan-bf16-mixed": (base, memfit.Plan(precision="bf16-mixed")),
        "plan-fp8": (base, memfit.Plan(precision="fp8")),
    }
    lines = []
    for config, (workload, plan) in runs.items():
        report = memfit.dry_run(workload, plan, steps=args.steps, device=args.predict)
        lines.append(f"{config}: predicted peak {report.peak_bytes / GiB:.2f} GiB on {args.predict}")
    return lines


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"config": spec["config"], "error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
    return {"config": spec["config"], "error": " | ".join(tail[-3:])[:600]}


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    base = next((r for r in rows if r["config"] == "bf16" and "error" not in r), None)
    lines = [
        f"# FP8 training (torchao {result['torchao']}) vs bf16 on {result['gpu']}",
        "",
        f"{result['model']}, batch {result['batch_size']} x {result['seq_len']} tokens, bf16 "
        f"weights, torch AdamW, {result['steps']} timed steps; torch {result['torch']}.",
        "",
        "| config | max allocated GiB | max reserved GiB | forward held GiB | saved (by dtype) GiB "
        "| step s | step ratio | last loss |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'][:200]} ||||||| ")
            continue
        saved = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(r["saved_by_dtype_bytes"].items()))
        ratio = f"{r['step_seconds'] / base['step_seconds']:.2f}x" if base else ""
        lines.append(
            f"| {r['config']} | {r['max_allocated_bytes'] / GiB:.2f} | "
            f"{r['max_reserved_bytes'] / GiB:.2f} | {r['forward_held_bytes'] / GiB:.2f} | "
            f"{saved} | {r['step_seconds']:.3f} | {ratio} | {r['losses'][-1]:.4f} |"
        )
    for r in rows:
        if "predicted_max_allocated_bytes" in r:
            lines.append(
                f"\n{r['config']}: memfit's dry run for this GPU predicted a peak of "
                f"{r['predicted_max_allocated_bytes'] / GiB:.2f} GiB (measured max allocated "
                f"{r['max_allocated_bytes'] / GiB:.2f} GiB) and "
                f"{r['predicted_forward_peak_bytes'] / GiB:.2f} GiB at the first forward's end."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per config")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--predict", default=None, metavar="PROFILE",
                        help="print memfit's dry-run peaks on this GPU profile (no GPU needed)")
    args = parser.parse_args(argv)
    if args.predict:
        print("\n".join(predict(args)))
        return 0
    if args.child:
        print(json.dumps(run_one(json.loads(args.child))))
        return 0
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"error: unknown config {unknown[0]!r}; use {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9):
        print("error: FP8 training needs a CUDA GPU of compute capability 8.9 or newer "
              "(Ada, Hopper, Blackwell)", file=sys.stderr)
        return 2
    import torchao

    rows = []
    for config in configs:
        spec = {"config": config, "model": args.model, "batch_size": args.batch_size,
                "seq_len": args.seq_len, "steps": args.steps}  # fmt: skip
        row = _child(spec, args.timeout)
        print(f"{config}: {row.get('error') or _gib_line(row)}", file=sys.stderr)
        rows.append(row)
        # After every config: a run stopped by a lease's time limit keeps what it measured.
        name = torch.cuda.get_device_name(0)
        result = {
            "gpu": name, "torch": torch.__version__, "torchao": torchao.__version__,
            "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "steps": args.steps, "rows": rows,
        }  # fmt: skip
        slug = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"gpu_fp8_{slug}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"gpu_fp8_{slug}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _gib_line(row: dict[str, Any]) -> str:
    return (f"max allocated {row['max_allocated_bytes'] / GiB:.2f} GiB, forward held "
            f"{row['forward_held_bytes'] / GiB:.2f} GiB, step {row['step_seconds']:.3f} s")


if __name__ == "__main__":
    sys.exit(main())
