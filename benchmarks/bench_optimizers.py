"""Step time and state memory of memory-light optimizers versus torch's AdamW.

Each optimizer runs in a fresh subprocess (so peak-RSS figures are its own) on the same set of
parameters -- ``--params`` elements split into 2048 x 2048 matrices plus a few bias vectors,
with fixed random gradients -- and the script prints a markdown table:

* ``step ms``: median wall time of ``optimizer.step()`` after warm-up steps (with
  ``--repeats``, the lowest median over the rounds);
* ``vs torch foreach``: that time over torch AdamW (foreach=True) measured in the same run;
* ``state B/param``: :func:`memfit.optim.state_bytes` over the parameter count;
* ``peak extra B/param``: peak RSS minus the RSS just before the optimizer was created (so:
  state plus the largest step temporaries), over the parameter count; measured over two steps
  in a separate subprocess whose allocator (glibc) returns every freed block of 64 KiB or more
  to the OS at once, so that reused heap memory cannot hide temporaries.

Usage::

    python benchmarks/bench_optimizers.py --params 50_000_000 --steps 10 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BASELINE = "torch AdamW foreach"

# name -> (module to import or None, description of how to build it)
OPTIMIZERS: dict[str, str | None] = {
    "torch AdamW foreach": None,
    "torch AdamW single-tensor": None,
    "torch AdamW fused": None,
    "memfit AdamW8bit": "memfit.optim",
    "memfit Adafactor": "memfit.optim",
    "bitsandbytes AdamW8bit": "bitsandbytes",
    "torchao AdamW8bit": "torchao.optim",
}


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    lr = 1e-3
    if name == "torch AdamW foreach":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if name == "torch AdamW single-tensor":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if name == "torch AdamW fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "memfit AdamW8bit":
        from memfit.optim import AdamW8bit

        return AdamW8bit(params, lr=lr)
    if name == "memfit Adafactor":
        from memfit.optim import Adafactor

        return Adafactor(params)
    if name == "bitsandbytes AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr)
    if name == "torchao AdamW8bit":
        from torchao.optim import AdamW8bit as AoAdamW8bit

        return AoAdamW8bit(params, lr=lr)
    raise ValueError(name)


def make_params(total: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``total`` elements as 2048 x 2048 matrices, a remainder matrix and 2048-vectors."""
    gen = torch.Generator().manual_seed(seed)
    side = 2048
    shapes: list[tuple[int, ...]] = []
    left = total
    while left >= side * side + side:
        shapes += [(side, side), (side,)]
        left -= side * side + side
    if left >= side:
        shapes.append((left // side, side))
        left -= (left // side) * side
    if left:
        shapes.append((left,))
    params = []
    for shape in shapes:
        # In-place scaling: no freed temporaries for the allocator to keep around.
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02))
        p.grad = torch.randn(shape, generator=gen).mul_(1e-3)
        params.append(p)
    return params


def current_rss_bytes() -> int:
    """Resident set size now (Linux); falls back to the peak elsewhere.

    Free heap memory is first handed back to the OS (glibc ``malloc_trim``), otherwise the
    optimizer's temporaries could reuse it unseen and the growth would be under-reported.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_worker(name: str, total: int, steps: int, warmup: int) -> dict[str, Any]:
    """Time ``steps`` steps after ``warmup``; also report RSS growth (meaningful in the
    memory-mode subprocess, see :func:`measure_memory`)."""
    from memfit.optim import state_bytes

    # A throw-away optimizer of the same kind first: lazy imports and one-off initialisation
    # (dynamo, native libraries, compiled kernels) must not count as step memory.
    tiny = [torch.nn.Parameter(torch.randn(64, 256))]
    tiny[0].grad = torch.randn(64, 256)
    warm = make_optimizer(name, tiny)
    warm.step()
    warm.step()
    del warm, tiny
    params = make_params(total)
    n = sum(p.numel() for p in params)
    # The current (not peak) RSS: temporaries of make_params are gone by now.
    rss_before = current_rss_bytes()
    opt = make_optimizer(name, params)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return {
        "name": name,
        "params": n,
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "state_bytes": state_bytes(opt),
        "state_bytes_per_param": state_bytes(opt) / n,
        "peak_extra_bytes_per_param": (peak_rss_bytes() - rss_before) / n,
    }


def importable(module: str | None) -> bool:
    if module is None:
        return True
    code = f"import {module}"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, env=env, check=False, timeout=300
    )
    return result.returncode == 0


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every optimizer ``--repeats`` times (rounds over all of them, so slow phases of a
    shared machine hit each optimizer alike) and keep each one's fastest round."""
    best: dict[str, dict[str, Any]] = {}
    for round_index in range(args.repeats):
        if args.repeats > 1:
            print(f"round {round_index + 1}/{args.repeats}", file=sys.stderr, flush=True)
        for row in run_round(args, with_memory=round_index == 0):
            old = best.get(row["name"])
            if old is not None and row.get("peak_extra_bytes_per_param") is None:
                row["peak_extra_bytes_per_param"] = old.get("peak_extra_bytes_per_param")
            if (
                old is None
                or old["status"] != "ok"
                or (row["status"] == "ok" and row["step_s"] < old["step_s"])
            ):
                best[row["name"]] = row
    return list(best.values())


# glibc: serve every allocation of 64 KiB or more with mmap and give it back on free, so the
# RSS follows live memory (by default freed blocks stay in the heap and are reused unseen).
_MEMORY_ENV = {
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=65536",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "65536",
}


def worker_cmd(args: argparse.Namespace, name: str, steps: int, warmup: int) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--threads",
        str(args.threads),
        "--params",
        str(args.params),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]


def measure_memory(args: argparse.Namespace, name: str) -> float | None:
    """Peak RSS growth per parameter over two steps, in a subprocess whose allocator returns
    freed memory at once (slower, hence separate from the timing run)."""
    env = dict(os.environ, **_MEMORY_ENV)
    result = subprocess.run(
        worker_cmd(args, name, steps=2, warmup=0),
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if result.returncode != 0:
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_extra_bytes_per_param"]


def run_round(args: argparse.Namespace, with_memory: bool) -> list[dict[str, Any]]:
    rows = []
    for name, module in OPTIMIZERS.items():
        if args.only and name not in args.only:
            continue
        if not importable(module):
            print(f"{name}: not installed", file=sys.stderr)
            rows.append({"name": name, "status": "not installed"})
            continue
        print(f"{name}: running", file=sys.stderr, flush=True)
        cmd = worker_cmd(args, name, args.steps, args.warmup)
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            print(result.stderr[-2000:], file=sys.stderr)
            rows.append({"name": name, "status": "failed"})
            continue
        row = json.loads(result.stdout.strip().splitlines()[-1])
        row["status"] = "ok"
        row["peak_extra_bytes_per_param"] = measure_memory(args, name) if with_memory else None
        rows.append(row)
        print(f"  {row['step_s'] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    return rows


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["name"] == BASELINE and r["status"] == "ok"), None)
    lines = [
        "| optimizer | step ms | vs torch foreach | state B/param | peak extra B/param |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']} | | | |")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "n/a"
        lines.append(
            f"| {r['name']} | {r['step_s'] * 1e3:.1f} | {ratio} | "
            f"{r['state_bytes_per_param']:.3f} | {_fmt(r['peak_extra_bytes_per_param'])} |"
        )
    ours = next((r for r in rows if r["name"] == "memfit AdamW8bit" and r["status"] == "ok"), None)
    bnb = next(
        (r for r in rows if r["name"] == "bitsandbytes AdamW8bit" and r["status"] == "ok"), None
    )
    if ours and bnb:
        lines.append("")
        lines.append(
            "memfit AdamW8bit / bitsandbytes AdamW8bit step time: "
            f"{ours['step_s'] / bnb['step_s']:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="parameter elements")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds over all optimizers; the fastest counts"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--only", nargs="*", help="run only these optimizers (by table name)")
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch intra-op threads for every optimizer (default: torch's default)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    warnings.filterwarnings("ignore")
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.params, args.steps, args.warmup)))
        return
    from memfit.outputs import exit_if_unwritable, write_text

    exit_if_unwritable({"--json": args.json})

    rows = run_all(args)
    table = markdown(rows)
    load = os.getloadavg()
    print(
        f"{args.params:,} parameters, {args.steps} timed steps after {args.warmup} warm-up, "
        f"best of {args.repeats} round(s), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n"
    )
    print(table)
    if args.json:
        meta = {
            "params": args.params,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d"),
        }
        write_text(args.json, json.dumps({"meta": meta, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
