"""What ``selective`` checkpointing keeps: the policies that choose, op by op, which outputs
of a checkpointed block are saved for backward and which are recomputed.

* ``matmuls`` (memfit's default): every matmul, convolution and fused-attention output is
  saved; everything else (norms, activations, dropout, adds, softmax) is recomputed.
* ``alternate-matmuls``: torchtitan's per-op policy (``selective_ac_option = "op"`` in
  ``torchtitan/parallelisms/parallelize_llama.py``, Dec. 2024): fused-attention outputs and
  every other ``aten.mm`` are saved, the mms being counted from the block's first (the 1st,
  3rd, 5th ... are saved, the 2nd, 4th ... recomputed; in a Llama block q, v, w1 and w2 are
  kept, k, o and w3 recomputed). The count restarts at each block's forward and again at its
  recomputation, as torchtitan's does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .recompute import retryable

__all__ = [
    "SAVE_OPS",
    "SELECTIVE_CHECKPOINT_KEYWORDS",
    "SELECTIVE_POLICIES",
    "selective_context",
    "selective_policy",
]

#: What ``selective`` passes ``checkpoint()`` beside its ``context_fn``. torch 2.15 asks
#: whether the tensors a selective checkpoint saves go through the saved-tensor hooks active
#: around it (``respect_saved_tensors_hooks``): today they do not, and a later release will
#: make them. memfit's tracker always has hooks active, so every selective figure would move
#: when that default flips; ``False`` keeps today's behaviour (and torch's FutureWarning
#: away). Passed only where the installed torch takes the argument (2.13 and 2.14 do not).
SELECTIVE_CHECKPOINT_KEYWORDS: dict[str, Any] = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    else {}
)


def _aten_packets(names: Iterable[str]) -> frozenset[Any]:
    # Look each op up by name: some exist only in some builds (flash / cuDNN attention).
    ops = (getattr(torch.ops.aten, n, None) for n in names)
    return frozenset(op for op in ops if op is not None)


_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

#: Ops whose outputs ``selective`` keeps: matmuls, convolutions and fused attention. They carry
#: most of a block's FLOPs, so recomputing them would cost nearly a full forward; everything
#: else (norms, activations, dropout, adds, softmax) is cheap to recompute.
SAVE_OPS: frozenset[Any] = _aten_packets(
    ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "convolution", "_scaled_mm",
     *_ATTENTION)
)

#: torchtitan's save list for its per-op policy (attention; ``mm`` every other time).
_ALTERNATE_SAVE_OPS: frozenset[Any] = _aten_packets(("mm", *_ATTENTION))
_MM = torch.ops.aten.mm


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``selective`` policy: save matmul/attention outputs, recompute everything else.

    Usable on its own as ``context_fn=functools.partial(create_selective_checkpoint_contexts,
    selective_policy)`` for :func:`torch.utils.checkpoint.checkpoint`.
    """
    packet = getattr(op, "overloadpacket", op)
    if packet in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _alternate_policy() -> Callable[..., CheckpointPolicy]:
    counts = {"forward": 0, "recompute": 0}  # one block's call: its forward, its recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        if packet not in _ALTERNATE_SAVE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if packet is _MM:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


#: The ``selective`` policies by name: each makes a fresh policy for one block's call.
SELECTIVE_POLICIES: dict[str, Callable[[], Callable[..., CheckpointPolicy]]] = {
    "matmuls": lambda: selective_policy,
    "alternate-matmuls": _alternate_policy,
}


def selective_context(policy: str = "matmuls") -> tuple[Any, Any]:
    """The ``context_fn`` pair of one checkpointed block's call under the named policy."""
    caching, cached = create_selective_checkpoint_contexts(SELECTIVE_POLICIES[policy]())
    if isinstance(getattr(cached, "func_counter", None), dict):
        cached.__class__ = retryable(type(cached))
    return caching, cached
