"""The smallest device total memfit predicts for fine-tuning the popular 7-8B models on an H100.

For each fine-tuning preset (``llama-3.1-8b``, ``qwen2.5-7b``, ``mistral-7b``: the published
configs) at batch 1 x 2048 tokens, three ways of fine-tuning:

* **full**: every weight trained, with what memfit tries by default (checkpointing, mixed
  precision, the fused step, the fused loss, accumulation): no ``--allow``;
* **LoRA**: adapters of rank 16 on a frozen base (``--allow lora``);
* **QLoRA**: the same on a 4-bit NF4 base (``--allow qlora``).

The planner is asked for a budget nothing fits (1 GiB), so its answer is the plan with the
smallest predicted device total (reserved bytes plus the CUDA context) it can reach, which
:class:`memfit.NothingFits` carries. Dry runs only: this runs on any machine, in a few
minutes.

Run::

    python benchmarks/finetune_presets.py                 # writes benchmarks/results/finetune_presets.{json,md}
    python benchmarks/finetune_presets.py --models mistral-7b --out /tmp
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import memfit
from memfit.outputs import output_problem, write_text
from memfit.units import GiB

MODELS = ("llama-3.1-8b", "qwen2.5-7b", "mistral-7b")
#: Way of fine-tuning -> the planner's --allow names.
WAYS: dict[str, tuple[str, ...]] = {"full": (), "LoRA": ("lora",), "QLoRA": ("qlora",)}


def smallest(model: str, allow: tuple[str, ...], device: str) -> dict[str, Any]:
    """The plan of the smallest predicted device total the planner reaches for ``model``."""
    workload = memfit.load_workload(model, 1, 2048)
    t0 = time.perf_counter()
    try:
        result = memfit.plan(workload, "1GiB", device=device, allow=list(allow))
    except memfit.NothingFits as e:
        result = e.result
    return {
        "model": model,
        "allow": list(allow),
        "device_total_bytes": result.predicted_device_total_bytes,
        "device_total_upper_bytes": result.predicted_device_total_upper_bytes,
        "peak_bytes": result.predicted_peak_bytes,
        "plan": result.plan.to_dict(),
        "summary": result.plan.summary(),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    lines = [
        f"| model | way | smallest device total on {device} (upper edge) | plan |",
        "|---|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['way']} | {r['device_total_bytes'] / GiB:.2f} GiB "
            f"({r['device_total_upper_bytes'] / GiB:.2f} GiB) | {r['summary']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--device", default="h100")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    problem = output_problem(args.out, folder=True)
    if problem is not None:
        print(f"error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    rows = []
    for model in args.models.split(","):
        for way, allow in WAYS.items():
            row = {"way": way, **smallest(model, allow, args.device)}
            print(f"{model} / {way}: {row['device_total_bytes'] / GiB:.2f} GiB, "
                  f"{row['summary']} ({row['seconds']} s)", file=sys.stderr)
            rows.append(row)
    write_text(args.out / "finetune_presets.json", json.dumps(rows, indent=2) + "\n")
    table = markdown(rows, args.device)
    write_text(args.out / "finetune_presets.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
