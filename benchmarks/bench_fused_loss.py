"""Peak memory and CPU time of the loss of a language model's output head, three ways.

* ``plain``: ``F.cross_entropy(F.linear(hidden, weight).float(), labels)``, as Hugging Face's
  causal-LM loss computes it (full logits, upcast to fp32);
* ``memfit chunked``: :func:`memfit.ops.chunked_cross_entropy` (automatic chunk size);
* ``torch chunked``: ``torch.nn.functional.linear_cross_entropy`` with
  ``LinearCrossEntropyOptions()`` (torch 2.13's batch-chunked mode, automatic chunk size).

Each runs one forward and backward of the loss, with the hidden states and the weight both
requiring gradients.

**Peak** is measured with :func:`memfit.track` at full size (default: a llama-1b-like head,
hidden 2048, vocabulary 128256, 4 x 1024 tokens) on fake tensors
(``FakeTensorMode``: shapes and dtypes only, nothing allocated). torch's chunked mode is a
custom operator whose body the tracker, like any dispatch mode, sees as one op producing its
outputs, so its temporaries would be missed. The script therefore registers the op's own
Python body as the op's handler for a subclass of the tracker ("see-through"), and every
allocation inside it is counted too. Both columns are in the JSON. ``peak - inputs`` is the
peak less the inputs and their gradients (hidden, weight, d hidden, d weight), which every
method must hold.

**Time** is CPU wall time of forward + backward on real fp32 tensors at a reduced size
(default: hidden 512, vocabulary 32000, 1024 tokens), the best of ``--repeats`` runs after one
warm-up, on this machine's threads. Ratios are to ``plain`` in the same run.

Usage::

    python benchmarks/bench_fused_loss.py            # writes benchmarks/results/fused_loss.*
    python benchmarks/bench_fused_loss.py --tokens 2048 --time-tokens 512 --no-write
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import memfit  # noqa: E402
from memfit.accounting.tracker import MemoryTracker  # noqa: E402
from memfit.ops import auto_chunk_size, chunked_cross_entropy  # noqa: E402

MiB = 2**20
GiB = 2**30
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y)


def memfit_chunked(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return chunked_cross_entropy(h, w, y)


def torch_chunked(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return F.linear_cross_entropy(h, w, y, options=torch.nn.LinearCrossEntropyOptions())


METHODS: dict[str, LossFn] = {
    "plain": plain,
    "memfit chunked": memfit_chunked,
    "torch chunked": torch_chunked,
}


class SeeThroughTracker(MemoryTracker):
    """The tracker, for which torch's chunked op runs its Python body under the tracker."""


def _install_see_through() -> bool:
    try:
        from torch.nn.modules import linear_cross_entropy as lce
    except ImportError:  # torch before 2.13
        return False
    ops = [
        getattr(lce, name, None)
        for name in (
            "_linear_cross_entropy_batch_chunked",
            "_linear_cross_entropy_batch_chunked_no_reduction",
        )
    ]
    for op in ops:
        if op is None or not hasattr(op, "_init_fn"):
            return False
        body = op._init_fn

        def inside(mode: Any, func: Any, types: Any, args: tuple, kwargs: dict, body=body) -> Any:
            with mode:  # the handler runs with the mode popped; put it back for the body
                return body(*args, **kwargs)

        op.register_torch_dispatch(SeeThroughTracker, inside)
    return True


def _peak(fn: LossFn, n: int, hidden: int, vocab: int, dtype: torch.dtype, see: bool) -> int:
    tracker_cls = SeeThroughTracker if see else MemoryTracker
    with FakeTensorMode():
        h = torch.empty(n, hidden, dtype=dtype, requires_grad=True)
        w = torch.empty(vocab, hidden, dtype=dtype, requires_grad=True)
        y = torch.zeros(n, dtype=torch.long)
        with tracker_cls(None) as tracker:
            fn(h, w, y).backward()
    return tracker.report().peak_bytes


def _time(fn: LossFn, n: int, hidden: int, vocab: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=gen)
    best = float("inf")
    for i in range(repeats + 1):
        h.grad = w.grad = None
        start = time.perf_counter()
        fn(h, w, y).backward()
        elapsed = time.perf_counter() - start
        if i:  # the first run warms up
            best = min(best, elapsed)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    see_through = _install_see_through()
    n, hidden, vocab = args.tokens, args.hidden, args.vocab
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "memfit": memfit.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "peak": {"tokens": n, "hidden": hidden, "vocab": vocab,
                 "memfit_chunk_size": auto_chunk_size(n, hidden, vocab),
                 "fp32_logits_bytes": n * vocab * 4, "rows": []},
        "time": {"tokens": args.time_tokens, "hidden": args.time_hidden,
                 "vocab": args.time_vocab, "repeats": args.repeats, "dtype": "float32",
                 "rows": []},
    }
    for dtype in (torch.bfloat16, torch.float32):
        item = torch.empty((), dtype=dtype).element_size()
        inputs = 2 * (n * hidden + vocab * hidden) * item
        base = None
        for name, fn in METHODS.items():
            seen = _peak(fn, n, hidden, vocab, dtype, see=False)
            full = _peak(fn, n, hidden, vocab, dtype, see=True) if see_through else seen
            base = base or full
            result["peak"]["rows"].append({
                "dtype": str(dtype).replace("torch.", ""), "method": name,
                "peak_bytes": full, "peak_bytes_op_outputs_only": seen,
                "inputs_and_grads_bytes": inputs, "peak_minus_inputs_bytes": full - inputs,
                "ratio_to_plain": full / base,
            })
    times = {}
    for name, fn in METHODS.items():
        times[name] = _time(fn, args.time_tokens, args.time_hidden, args.time_vocab,
                            args.repeats)
        result["time"]["rows"].append({
            "method": name, "seconds": times[name], "ratio_to_plain": times[name] / times["plain"],
        })
    return result


def markdown(result: dict[str, Any]) -> str:
    p, t = result["peak"], result["time"]
    lines = [
        "# Fused linear + cross-entropy: peak and CPU time",
        "",
        f"torch {result['torch']}, memfit {result['memfit']}, {result['machine']}. "
        "Produced by `python benchmarks/bench_fused_loss.py`.",
        "",
        f"## Peak, one forward + backward, {p['tokens']} tokens, hidden {p['hidden']}, "
        f"vocabulary {p['vocab']} (fake tensors, `memfit.track`)",
        "",
        f"fp32 logits alone: {p['fp32_logits_bytes'] / GiB:.2f} GiB. memfit's automatic chunk: "
        f"{p['memfit_chunk_size']} tokens. 'peak - inputs' leaves out hidden, weight and their "
        "gradients, which every method holds; torch's chunked op is measured see-through "
        "(its body's temporaries counted; the plain tracker sees only its outputs, in brackets).",
        "",
        "| dtype | method | peak | peak - inputs | vs plain |",
        "|---|---|---:|---:|---:|",
    ]
    for row in p["rows"]:
        seen = ""
        if row["peak_bytes_op_outputs_only"] != row["peak_bytes"]:
            seen = f" ({row['peak_bytes_op_outputs_only'] / MiB:,.0f} MiB)"
        lines.append(
            f"| {row['dtype']} | {row['method']} | {row['peak_bytes'] / MiB:,.0f} MiB{seen} | "
            f"{row['peak_minus_inputs_bytes'] / MiB:,.0f} MiB | {row['ratio_to_plain']:.2f}x |"
        )
    lines += [
        "",
        f"## CPU time, forward + backward, {t['tokens']} tokens, hidden {t['hidden']}, "
        f"vocabulary {t['vocab']}, fp32 (best of {t['repeats']})",
        "",
        "| method | seconds | vs plain |",
        "|---|---:|---:|",
    ]
    for row in t["rows"]:
        lines.append(f"| {row['method']} | {row['seconds']:.3f} | {row['ratio_to_plain']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--time-tokens", type=int, default=1024)
    parser.add_argument("--time-hidden", type=int, default=512)
    parser.add_argument("--time-vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fused_loss")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    from memfit.outputs import exit_if_unwritable, write_text

    for suffix in () if args.no_write else (".md", ".json"):
        exit_if_unwritable({"--out": args.out.with_suffix(suffix)})
    for name in ("tokens", "hidden", "vocab", "time_tokens", "time_hidden", "time_vocab",
                 "repeats"):
        if getattr(args, name) < 1:
            parser.exit(2, f"--{name.replace('_', '-')} must be a positive integer.\n")
    if not hasattr(F, "linear_cross_entropy"):
        parser.exit(2, "torch.nn.functional.linear_cross_entropy needs torch 2.13 or later.\n")
    result = run(args)
    text = markdown(result)
    print(text)
    if not args.no_write:
        write_text(args.out.with_suffix(".md"), text)
        write_text(args.out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
