"""Candidate generation: every plan the search may consider, with its memory rank.

The space is the product of the techniques' options (micro-batch sizes, checkpointing modes,
precisions, optimizers, the fused step, ``foreach``, freezing, shorter sequences), starting
from the user's plan and limited by ``--allow`` and ``--forbid``. Each candidate carries a
rank vector (higher keeps less memory in that dimension) that dominance pruning compares.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from ..plan import Plan
from ..workload import Workload

__all__ = ["ALLOW", "FORBID"]


#: Techniques that change what is trained or how (only used when allowed).
ALLOW: dict[str, str] = {
    "freeze": "freeze the embeddings or the model body",
    "shorter-seq": "truncate sequences to 1/2 or 1/4 of their length",
    "8bit": "8-bit AdamW state",
    "factored": "Adafactor's factored state",
    "bf16-pure": "bf16 weights and optimizer math with stochastic rounding",
}
#: Techniques on by default that a user may rule out.
FORBID: dict[str, str] = {
    "accumulation": "gradient accumulation (micro-batches)",
    "checkpointing": "activation checkpointing (all modes)",
    "full-checkpointing": "full activation checkpointing",
    "mixed-precision": "bf16/fp16 autocast",
    "fused-step": "the optimizer step fused into backward",
    "foreach-off": "turning the multi-tensor optimizer off",
}


def _check_names(values: Iterable[str], known: dict[str, str], flag: str) -> tuple[str, ...]:
    out = tuple(v.strip() for v in values if v.strip())
    for v in out:
        if v not in known:
            raise ValueError(
                f"{flag} value {v!r} does not exist; use one or more of {', '.join(known)}"
            )
    return out


def _micro_batches(batch_size: int) -> list[int]:
    sizes = []
    m = batch_size
    while m >= 1:
        sizes.append(m)
        if m == 1:
            break
        m = m // 2 if m % 2 == 0 else -(-m // 2)
    return sorted(set(sizes), reverse=True)


def _space(
    workload: Workload, base: Plan, allow: Sequence[str], forbid: Sequence[str], device: Any
) -> list[tuple[Plan, tuple[int, ...]]]:
    """Every candidate plan with its memory rank vector (higher = less memory)."""
    batch = workload.batch_size
    micros = (
        _micro_batches(batch) if "accumulation" not in forbid else [base.micro_batch_for(batch)]
    )
    ckpts = ["none"]
    if "checkpointing" not in forbid:
        ckpts.append("selective")
        if "full-checkpointing" not in forbid:
            ckpts.append("full")
    mixed = "bf16-mixed" if device.supports_bf16 else "fp16-mixed"
    precisions = [base.precision.mode]
    if "mixed-precision" not in forbid and mixed not in precisions:
        precisions.append(mixed)
    if "bf16-pure" in allow:
        precisions.append("bf16-pure")
    optimizers = [base.optimizer.name]
    if "8bit" in allow and "adamw8bit" not in optimizers:
        optimizers.append("adamw8bit")
    if "factored" in allow and "adafactor" not in optimizers:
        optimizers.append("adafactor")
    fused_options = [False] + ([True] if "fused-step" not in forbid else [])
    foreach_options = [base.optimizer.foreach] + ([False] if "foreach-off" not in forbid else [])
    freezes: list[tuple[str, ...]] = [tuple(base.freeze)]
    if "freeze" in allow:
        freezes += [("embeddings",), ("body",)]
    seqs: list[int | None] = [base.max_seq_len]
    if "shorter-seq" in allow:
        length = base.max_seq_len or workload.seq_len
        seqs += [max(1, length // 2), max(1, length // 4)]

    out = []
    for (mi, m), (ci, ck), (_pi, pr), (_oi, op), (fi, fu), (ei, fe), (zi, fz), (
        si,
        sq,
    ) in itertools.product(
        enumerate(micros),
        enumerate(ckpts),
        enumerate(precisions),
        enumerate(optimizers),
        enumerate(fused_options),
        enumerate(foreach_options),
        enumerate(freezes),
        enumerate(seqs),
    ):
        accum = -(-batch // m)
        if fu and (ei > 0 or accum > 1):
            # In backward the step runs per tensor anyway (foreach is moot), and accumulated
            # gradients must persist across micro-batches, so fusing saves nothing then.
            continue
        if ei > 0 and op not in ("adamw", "adam", "sgd"):
            continue  # memfit's optimizers loop per tensor: foreach off is the same plan
        if fu and pr == "fp16-mixed":
            continue  # the loss scaler must see every gradient before any step
        try:
            plan = base.replace(
                micro_batch_size=m if accum > 1 else None,
                grad_accum_steps=accum,
                checkpointing=base.checkpointing if ck == base.checkpointing.mode else ck,
                precision=base.precision if pr == base.precision.mode else pr,
                optimizer=base.optimizer.__class__(
                    name=op,
                    lr=base.optimizer.lr,
                    foreach=fe,
                    kwargs=base.optimizer.kwargs if op == base.optimizer.name else {},
                ),
                optimizer_in_backward=fu,
                grad_clip_mode=("approx" if fu and accum > 1 else base.grad_clip_mode),
                freeze=fz,
                max_seq_len=sq,
            )
        except ValueError:
            continue  # an impossible combination: the Plan says so
        # The fused step frees gradients only without accumulation (accumulated gradients must
        # persist across micro-batches), so it ranks as a saving only then. Precision, the
        # optimizer and freezing rank by what they keep, not by their place in the lists
        # (which start from the user's base plan, whatever it is).
        rank = (
            mi,
            ci,
            _PRECISION_RANK[pr],
            -_STATE_BYTES.get(op, 8.0),
            fi if accum == 1 else 0,
            ei,
            _FREEZE_RANK.get(fz, zi),
            si,
        )
        out.append((plan, rank))
    return out


# Memory ranks of the options (higher keeps less). Precision: fp32 weights and gradients,
# then autocast (half-size activations), then bf16 weights, gradients and state.
_PRECISION_RANK = {"fp32": 0, "bf16-mixed": 1, "fp16-mixed": 1, "bf16-pure": 2}
# Optimizer state in bytes per parameter (OptimizerConfig's docstring; tests/optim measure
# them): Adam-like two fp32 moments, LARS one, 8-bit AdamW two int8 moments plus block scales,
# Adafactor factored row and column statistics (far under one byte for matrices). SGD keeps
# momentum only when asked to (torch's default momentum is 0).
_STATE_BYTES = {
    "adamw": 8.0,
    "adam": 8.0,
    "lamb": 8.0,
    "lars": 4.0,
    "sgd": 0.0,
    "adamw8bit": 2.03,
    "adafactor": 0.01,
}
# Freezing: the embeddings, then the whole body (only the head trains).
_FREEZE_RANK = {(): 0, ("embeddings",): 1, ("body",): 2}


def _dominated(rank: tuple[int, ...], misfits: list[tuple[int, ...]]) -> bool:
    return any(all(r <= f for r, f in zip(rank, bad, strict=False)) for bad in misfits)


def _trainable_fractions(workload: Workload) -> dict[tuple[str, ...], float]:
    """Share of parameters that still train under each freezing choice (on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..strategies.freezing import apply_freezing

    out: dict[tuple[str, ...], float] = {(): 1.0}
    for spec in (("embeddings",), ("body",)):
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = workload.build_model()
                total = sum(p.numel() for p in model.parameters())
                apply_freezing(model, spec)
                out[spec] = sum(p.numel() for p in model.parameters() if p.requires_grad) / total
        except ValueError:
            out[spec] = 1.0
    return out
