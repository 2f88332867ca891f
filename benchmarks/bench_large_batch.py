"""LAMB at 8x the batch against AdamW at 1x, for the same number of epochs (8x fewer steps).

The task is generated from a seed, nothing is downloaded: 16-dimensional Gaussian inputs
labelled with one of 10 classes by a random teacher network (``argmax(tanh(x W1) W2)``, 32
hidden units), 32768 training samples and two held-out sets of 4096 (validation, to choose
each optimizer's learning rate; test, to report). The student is an MLP 16-128-128-10.

Every run uses :mod:`memfit.distributed.recipes`: a :class:`LargeBatchRecipe` tuned at the base
batch, :func:`build_optimizer` with the learning rate scaled for the run's batch,
:func:`build_scheduler` (linear warm-up over the same number of samples at every batch, then a
cosine decay to 0 at the last step). The grid:

* AdamW at the base batch ``B``, three learning rates: the reference is the one with the lowest
  validation loss;
* LAMB at ``8B``, three base learning rates x both scaling rules (``sqrt``, ``linear``);
* LARS at ``8B``, the same, on SGD-like learning rates;
* AdamW at ``8B``, the same: the control that says whether LAMB's trust ratio or merely the
  learning-rate scaling keeps the loss.

For each optimizer at 8B the configuration with the lowest validation loss is compared with
the reference: the ratio of test losses (and of final training losses, over the whole training
set in eval mode), on one task per seed (``--seeds``, three by default; about 3 minutes on one
CPU thread). Deterministic on CPU for a given torch (fixed seeds, one thread).

Usage::

    python benchmarks/bench_large_batch.py --out benchmarks/results/large_batch.md
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from memfit.distributed.recipes import (  # noqa: E402
    LargeBatchRecipe,
    build_optimizer,
    build_scheduler,
    scale_for_batch,
)

#: Base learning rates tried per optimizer (LARS's trust ratio already scales by eta=1e-3, so
#: its learning rates are SGD-like).
GRID: dict[str, tuple[float, ...]] = {
    "adamw": (1e-3, 3e-3, 1e-2),
    "lamb": (1e-3, 3e-3, 1e-2),
    "lars": (0.3, 1.0, 3.0),
}
WEIGHT_DECAY = {"adamw": 0.01, "lamb": 0.01, "lars": 1e-4}


@dataclass(frozen=True)
class Task:
    x: torch.Tensor
    y: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_task(seed: int, samples: int, held_out: int = 4096, dim: int = 16, teacher_hidden: int = 32,
              classes: int = 10) -> Task:
    """Teacher-labelled Gaussian data: the same tensors for every run with the same seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples + 2 * held_out, dim, generator=g)
    w1 = torch.randn(dim, teacher_hidden, generator=g) / math.sqrt(dim)
    w2 = torch.randn(teacher_hidden, classes, generator=g) / math.sqrt(teacher_hidden)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    a, b = samples, samples + held_out
    return Task(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:])


def make_model(dim: int = 16, hidden: int = 128, classes: int = 10) -> nn.Module:
    torch.manual_seed(1)  # the same initial weights in every run
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def train(recipe: LargeBatchRecipe, batch: int, epochs: int, task: Task) -> dict[str, Any]:
    """Train for ``epochs`` passes at ``batch`` with ``recipe``; the losses at the end."""
    model = make_model()
    n = len(task.x)
    steps_per_epoch = n // batch
    total = steps_per_epoch * epochs
    lr, warmup = scale_for_batch(recipe, batch, samples_per_epoch=n)
    opt = build_optimizer(recipe, model.parameters(), batch, samples_per_epoch=n)
    sched = build_scheduler(opt, recipe, batch, total_steps=total, samples_per_epoch=n)
    order = torch.Generator().manual_seed(2)
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order)
        for i in range(steps_per_epoch):
            idx = perm[i * batch:(i + 1) * batch]
            loss = F.cross_entropy(model(task.x[idx]), task.y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        def loss_on(x: torch.Tensor, y: torch.Tensor) -> float:
            return F.cross_entropy(model(x), y).item()

        def error_on(x: torch.Tensor, y: torch.Tensor) -> float:
            return (model(x).argmax(1) != y).float().mean().item()

        return {
            "optimizer": recipe.optimizer, "scaling": recipe.scaling, "base_lr": recipe.base_lr,
            "batch": batch, "lr": lr, "warmup_steps": warmup, "steps": total,
            "train_loss": loss_on(task.x, task.y), "val_loss": loss_on(task.x_val, task.y_val),
            "test_loss": loss_on(task.x_test, task.y_test),
            "test_error": error_on(task.x_test, task.y_test), "seconds": seconds,
        }


def recipe_for(optimizer: str, base_lr: float, base_batch: int, scaling: str,
               warmup_epochs: float) -> LargeBatchRecipe:
    return LargeBatchRecipe(optimizer=optimizer, base_lr=base_lr, base_batch_size=base_batch,
                            scaling=scaling, warmup_epochs=warmup_epochs, schedule="cosine",
                            weight_decay=WEIGHT_DECAY[optimizer])


def best(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The row with the lowest validation loss among those matching."""
    chosen = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return min(chosen, key=lambda r: r["val_loss"])


def run(args: argparse.Namespace, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The whole grid on the task of ``seed``: every run, and the comparison."""
    torch.set_num_threads(1)
    task = make_task(seed, args.samples)
    base, big = args.base_batch, args.base_batch * args.scale
    rows = []

    def go(optimizer: str, base_lr: float, batch: int, scaling: str) -> None:
        recipe = recipe_for(optimizer, base_lr, base, scaling, args.warmup_epochs)
        row = train(recipe, batch, args.epochs, task)
        row["seed"] = seed
        rows.append(row)
        print(f"seed {seed} {optimizer:5s} batch {batch:4d} {scaling:6s} base_lr {base_lr:<6g} "
              f"lr {row['lr']:.4g} steps {row['steps']:5d} warm-up {row['warmup_steps']:4d}: "
              f"train {row['train_loss']:.4f} val {row['val_loss']:.4f} "
              f"test {row['test_loss']:.4f} ({row['seconds']:.1f} s)", flush=True)

    for lr in GRID["adamw"]:
        go("adamw", lr, base, "sqrt")  # at the base batch both rules give base_lr
    for optimizer in args.optimizers:
        for scaling in ("sqrt", "linear"):
            for lr in GRID[optimizer]:
                go(optimizer, lr, big, scaling)
    ref = best(rows, optimizer="adamw", batch=base)
    summary: dict[str, Any] = {"reference": ref, "at_scale": {}}
    for optimizer in args.optimizers:
        row = best(rows, optimizer=optimizer, batch=big)
        summary["at_scale"][optimizer] = {
            "row": row,
            "test_loss_ratio": row["test_loss"] / ref["test_loss"],
            "train_loss_ratio": row["train_loss"] / ref["train_loss"],
        }
    return rows, summary


def markdown(results: list[tuple[list[dict[str, Any]], dict[str, Any]]],
             args: argparse.Namespace, command: str, seconds: float) -> str:
    big = args.base_batch * args.scale
    steps_big = (args.samples // big) * args.epochs
    steps_base = (args.samples // args.base_batch) * args.epochs
    lines = [
        f"# Large-batch recipes: LAMB at {args.scale}x the batch vs AdamW at 1x",
        "",
        f"Command: `{command}`",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, CPU, one thread; "
        f"whole run {seconds:.0f} s (the seconds below are wall time on a shared 2-core machine).",
        "",
        f"Task: {args.samples} training samples (16-d Gaussian, labelled by a random "
        "tanh teacher into 10 classes; the seed draws both data and teacher), 4096 validation "
        "and 4096 test samples; student MLP 16-128-128-10 (the same initial weights in every "
        f"run); {args.epochs} epochs at every batch: {steps_base} steps at batch "
        f"{args.base_batch}, {steps_big} at batch {big}; warm-up {args.warmup_epochs} epoch (the "
        "same samples at every batch), then cosine decay to 0; weight decay "
        + ", ".join(f"{k} {v:g}" for k, v in WEIGHT_DECAY.items())
        + ". Each optimizer's base learning rate and scaling rule are chosen on validation "
        "loss (grid: " + "; ".join(f"{k} {', '.join(f'{v:g}' for v in vs)}"
                                   for k, vs in GRID.items())
        + "); test and training losses are reported (training loss: the whole training set, "
        "eval mode, after the last step). Ratios below 1 mean lower than AdamW at 1x.",
        "",
        f"| seed | optimizer at batch {big} (best on val) | scaling | base lr | lr | train loss "
        "| AdamW@1x train | train ratio | test loss | AdamW@1x test | test ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[tuple[float, float]]] = {}
    for _, summary in results:
        ref = summary["reference"]
        for optimizer, s in summary["at_scale"].items():
            r = s["row"]
            ratios.setdefault(optimizer, []).append((s["train_loss_ratio"], s["test_loss_ratio"]))
            lines.append(
                f"| {r['seed']} | {optimizer} | {r['scaling']} | {r['base_lr']:g} | {r['lr']:.4g} "
                f"| {r['train_loss']:.4f} | {ref['train_loss']:.4f} | {s['train_loss_ratio']:.3f} "
                f"| {r['test_loss']:.4f} | {ref['test_loss']:.4f} | {s['test_loss_ratio']:.3f} |"
            )
    lines += ["", "| optimizer at batch " + str(big) + " | seeds where train ratio <= 1 | "
              "mean train ratio | seeds where test ratio <= 1.02 | mean test ratio |",
              "|---|---|---|---|---|"]
    for optimizer, pairs in ratios.items():
        train_r = [a for a, _ in pairs]
        test_r = [b for _, b in pairs]
        lines.append(
            f"| {optimizer} | {sum(a <= 1 for a in train_r)}/{len(pairs)} | "
            f"{sum(train_r) / len(pairs):.3f} | {sum(b <= 1.02 for b in test_r)}/{len(pairs)} | "
            f"{sum(test_r) / len(pairs):.3f} |"
        )
    lines += [
        "",
        "AdamW at 1x per seed (its best base lr on validation): "
        + "; ".join(f"seed {s['reference']['seed']}: lr {s['reference']['base_lr']:g}, test "
                    f"error {s['reference']['test_error']:.2%}" for _, s in results) + ".",
        "",
        "Every run:",
        "",
        "| seed | optimizer | batch | scaling | base lr | lr | steps | warm-up steps | "
        "train loss | val loss | test loss | test error | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rows, _ in results:
        for r in rows:
            scaling = "-" if r["batch"] == args.base_batch else r["scaling"]
            lines.append(
                f"| {r['seed']} | {r['optimizer']} | {r['batch']} | {scaling} | {r['base_lr']:g} "
                f"| {r['lr']:.4g} | {r['steps']} | {r['warmup_steps']} | {r['train_loss']:.4f} "
                f"| {r['val_loss']:.4f} | {r['test_loss']:.4f} | {r['test_error']:.2%} "
                f"| {r['seconds']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--base-batch", type=int, default=32)
    parser.add_argument("--scale", type=int, default=8, help="the large batch is this x base")
    parser.add_argument("--warmup-epochs", type=float, default=0.5)
    parser.add_argument("--optimizers", nargs="+", default=["lamb", "lars", "adamw"],
                        choices=sorted(GRID), help="optimizers tried at the large batch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one task (data and teacher) per seed")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--json", type=Path, help="write every run's numbers here")
    args = parser.parse_args(argv)
    from memfit.outputs import exit_if_unwritable, write_text

    exit_if_unwritable({"--out": args.out, "--json": args.json})
    start = time.perf_counter()
    results = [run(args, seed) for seed in args.seeds]
    command = "python benchmarks/bench_large_batch.py " + " ".join(sys.argv[1:] if argv is None
                                                                    else argv)
    text = markdown(results, args, command.strip(), time.perf_counter() - start)
    print(text)
    if args.out:
        write_text(args.out, text)
    if args.json:
        write_text(args.json, json.dumps([{"rows": r, "summary": s} for r, s in results],
                                         indent=2))


if __name__ == "__main__":
    main()
