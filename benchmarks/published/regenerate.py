"""memfit's predictions of published GPU memory measurements, and their errors.

Reads ``benchmarks/published/rows.yaml`` (each published figure, its source, configuration and
metric, and how memfit predicts the same metric), predicts every row with dry runs on fake
tensors (no GPU), and writes ``benchmarks/published/table.md`` (and ``table.json``): the
published value, memfit's, the error per row, and the mean and worst absolute error of the
measured rows (the ZeRO paper's rows are arithmetic and reported apart).

Prediction kinds (``memfit.kind`` in a row):

* ``composed``: :class:`memfit.estimate.predictor.Composed` (dry runs at depths 2 and 3
  extrapolated to the full depth) of the row's workload and plan on the row's target GPU, run
  as rank 0 of a fake process group of ``world`` ranks when ``world`` > 1 (FSDP2's own code
  shards the model); the metric ``allocated`` reads its ``peak_bytes``, ``reserved`` its
  ``reserved_bytes``.
* ``liger-ce`` / ``liger-flce``: Liger-Kernel's memory benchmark loop replayed under
  :class:`memfit.accounting.tracker.MemoryTracker` on fake tensors (two repeats: the grads
  its loop never zeroes are held from the second on), plus, where the loss runs matmuls, the
  cuBLAS workspace of each of the two handles (forward thread, autograd's backward thread)
  that PyTorch allocates through its caching allocator.
* ``zero-states``: :func:`memfit.estimate.distributed.zero_model_state_bytes` with
  mixed-precision Adam (2 + 2 + 12 bytes per parameter).

Usage::

    python benchmarks/published/regenerate.py            # all rows, writes table.md/json
    python benchmarks/published/regenerate.py --only liger-ce-v4096 --no-write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))

ROWS = HERE / "rows.yaml"
UNITS = {"MiB": 2**20, "GiB": 2**30, "GB": 1e9}
#: Default tolerance on |error| of a row that states no configuration difference.
TOLERANCE = 0.08
#: Metrics that count in the mean error (measured allocated / active / reserved figures).
MEASURED = ("allocated", "active", "reserved")


def load_rows(path: Path = ROWS) -> list[dict[str, Any]]:
    """The rows of ``rows.yaml``, each checked for the fields the table needs."""
    rows = yaml.safe_load(path.read_text())["rows"]
    for row in rows:
        for key in ("id", "project", "source", "published", "memfit"):
            if key not in row:
                raise ValueError(f"row {row.get('id')!r} has no {key!r}")
        if row["published"]["unit"] not in UNITS:
            raise ValueError(f"row {row['id']!r}: unknown unit {row['published']['unit']!r}")
    return rows


# ------------------------------------------------------------------------------ predictors
def _composed(spec: dict[str, Any], metric: str) -> int:
    import contextlib

    from memfit.estimate.distributed import fake_process_group
    from memfit.estimate.predictor import Composed
    from memfit.plan import Plan
    from memfit.workload import load_workload

    model = spec["model"]
    if model.endswith(".json"):
        model = str(ROOT / model)
    workload = load_workload(model, int(spec["batch"]), int(spec["seq"]))
    plan = Plan.from_dict(spec.get("plan", {}))
    world = int(spec.get("world", 1))
    group = fake_process_group(world, 0) if world > 1 else contextlib.nullcontext()
    with group:
        pred = Composed().predict(workload, plan, spec["device"])
    return int(pred.reserved_bytes if metric == "reserved" else pred.peak_bytes)


def _tracked(fn: Callable[[], None]) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.accounting.tracker import MemoryTracker

    with FakeTensorMode(), MemoryTracker(None) as tracker:
        fn()
    return int(tracker.report().peak_bytes)


def _liger_ce(spec: dict[str, Any], metric: str) -> int:
    import torch

    def loop() -> None:
        n, vocab = int(spec["B"]) * int(spec["T"]), int(spec["V"])
        logits = torch.randn(n, vocab, requires_grad=True)
        target = torch.randint(vocab, (n, 1)).squeeze(1)
        loss = torch.nn.CrossEntropyLoss()
        for _ in range(2):
            loss(logits, target).backward()

    return _tracked(loop)  # no matmul: no cuBLAS workspace


def _liger_flce(spec: dict[str, Any], metric: str) -> int:
    import torch

    from memfit.targets import get_device

    hidden, vocab, n = int(spec["H"]), int(spec["V"]), int(spec["BT"])

    def loop() -> None:
        heads = [torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
                 for _ in range(2)]  # the script builds both providers' heads
        x = torch.randn(n, hidden, requires_grad=True, dtype=torch.bfloat16)
        target = torch.randint(vocab, (n, 1)).squeeze(1)
        loss = torch.nn.CrossEntropyLoss()
        for _ in range(2):
            loss(heads[0](x), target).backward()

    return _tracked(loop) + 2 * get_device(spec["device"]).workspace_bytes


def _zero_states(spec: dict[str, Any], metric: str) -> int:
    from memfit.estimate.distributed import zero_model_state_bytes

    return int(zero_model_state_bytes(
        int(float(spec["parameters"])), int(spec["world"]), int(spec["stage"]),
        param_bytes=2, grad_bytes=2, state_bytes=8, master_bytes=4,
    ))


PREDICTORS: dict[str, Callable[[dict[str, Any], str], int]] = {
    "composed": _composed,
    "liger-ce": _liger_ce,
    "liger-flce": _liger_flce,
    "zero-states": _zero_states,
}


def predict(row: dict[str, Any]) -> dict[str, Any]:
    """Row ``row`` predicted: published and predicted values in its unit, the error
    (predicted / published - 1), its tolerance and whether it holds, and the seconds taken."""
    pub = row["published"]
    start = time.perf_counter()
    predicted = PREDICTORS[row["memfit"]["kind"]](row["memfit"], pub["metric"])
    value = predicted / UNITS[pub["unit"]]
    error = value / float(pub["value"]) - 1
    tolerance = float(row.get("tolerance", TOLERANCE))
    if tolerance > TOLERANCE and not row.get("difference"):
        raise ValueError(f"row {row['id']!r}: a tolerance over {TOLERANCE:.0%} needs a "
                         "stated difference")
    return {
        "id": row["id"], "project": row["project"], "metric": pub["metric"],
        "unit": pub["unit"], "published": float(pub["value"]), "predicted": value,
        "predicted_bytes": predicted, "error": error, "tolerance": tolerance,
        "ok": abs(error) <= tolerance, "difference": row.get("difference", ""),
        "seconds": time.perf_counter() - start,
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and worst |error| over the measured rows, and over the allocated/active ones."""
    measured = [r for r in results if r["metric"] in MEASURED]
    alloc = [r for r in measured if r["metric"] in ("allocated", "active")]

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            return {"n": 0, "mean_abs_error": None, "worst": None}
        worst = max(rows, key=lambda r: abs(r["error"]))
        return {"n": len(rows), "mean_abs_error": sum(abs(r["error"]) for r in rows) / len(rows),
                "worst": {"id": worst["id"], "error": worst["error"]}}

    return {"measured": stats(measured), "allocated": stats(alloc),
            "projects": sorted({r["project"] for r in results}), "rows": len(results)}


# ---------------------------------------------------------------------------------- table
def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def table(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> str:
    """The Markdown table of ``results`` (rows in ``rows.yaml``'s order) with the summary."""
    by_id = {r["id"]: r for r in rows}
    s = summary(results)
    lines = [
        "| project | row | metric | published | memfit | error | tolerance |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        src = by_id[r["id"]]["source"]
        flag = "" if r["ok"] else " **over**"
        tol = _pct(r["tolerance"]).lstrip("+") + (" (stated)" if r["difference"] else "")
        lines.append(
            f"| {r['project']} | [{r['id']}]({src['url']}) | {r['metric']} | "
            f"{r['published']:,.2f} {r['unit']} | {r['predicted']:,.2f} {r['unit']} | "
            f"{_pct(r['error'])}{flag} | {tol} |"
        )
    lines.append("")
    for key, label in (("allocated", "allocated rows"), ("measured", "all measured rows")):
        st = s[key]
        if st["n"]:
            lines.append(
                f"- {label} ({st['n']}): mean |error| {st['mean_abs_error'] * 100:.2f}%, worst "
                f"{_pct(st['worst']['error'])} ({st['worst']['id']})"
            )
    zero = [r for r in results if r["metric"] not in MEASURED]
    if zero:
        worst = max(abs(r["error"]) for r in zero)
        lines.append(f"- arithmetic rows (the ZeRO paper's model-state figures, {len(zero)}): "
                     f"worst |error| {worst * 100:.1f}% (the paper rounds to 3 digits)")
    lines.append(f"- {s['rows']} rows from {len(s['projects'])} projects: "
                 f"{', '.join(s['projects'])}")
    stated = [r for r in results if r["difference"]]
    if stated:
        lines += ["", "Rows with a stated difference:", ""]
        lines += [f"- {r['id']}: {' '.join(r['difference'].split())}" for r in stated]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="row ids to predict (default: all)")
    ap.add_argument("--no-write", action="store_true", help="print, do not write table.md")
    args = ap.parse_args(argv)
    rows = load_rows()
    chosen = [r for r in rows if not args.only or r["id"] in args.only]
    results = []
    for row in chosen:
        res = predict(row)
        results.append(res)
        print(f"{res['id']:36s} {res['published']:>12,.2f} {res['predicted']:>12,.2f} "
              f"{res['unit']:3s} {_pct(res['error']):>7s} {res['seconds']:6.1f}s", flush=True)
    text = table(rows, results)
    print(text)
    if not args.no_write:
        header = ("# memfit against published measurements\n\nProduced by "
                  "`python benchmarks/published/regenerate.py` from `rows.yaml` (sources, "
                  "configurations, notes). error = memfit / published - 1.\n\n")
        (HERE / "table.md").write_text(header + text)
        (HERE / "table.json").write_text(json.dumps(
            {"rows": results, "summary": summary(results)}, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
