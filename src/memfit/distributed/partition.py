"""ZeRO-R's partitioned activation checkpoints: :func:`apply_partitioned_checkpointing`.

Under tensor parallelism (without sequence parallelism) every block's input, the residual
stream, is the same on every rank of the tensor-parallel group. Activation checkpointing keeps
exactly that input per block until the block's backward, so each of the ``t`` ranks holds the
same ``batch x seq x hidden`` tensor per block: ``t`` copies of one value. ZeRO-R (Rajbhandari
et al., 2020; DeepSpeed's ``partition_activations``) keeps ``1/t`` of each checkpointed input
on each rank and all-gathers it over the group when backward recomputes the block; with
``offload`` (DeepSpeed's ``cpu_checkpointing``) the slices wait in host memory.

What torch lacks: ``torch.utils.checkpoint`` saves the whole input on every rank and has no
notion of a process group. What it has, and what this builds on: its non-reentrant checkpoint
saves the block's positional tensor inputs through autograd's saved-tensor machinery, which
honours :class:`torch.autograd.graph.saved_tensors_hooks` opened around the call (the
checkpoint's own hooks cover only what runs inside the block). So a forward pre-hook on each
block opens hooks that

* pack the block's hidden-state input (its first positional tensor, matched by identity, so
  nothing else the call saves is touched; not a leaf, such as a pipeline stage's receive
  buffer, which its owner keeps whole anyway) into this rank's slice of its flattened elements,
  padded to a multiple of ``t``: a copy, on the device, or in host memory with ``offload``
  (page-locked on CUDA; on a CPU run a copy all the same, allocated in memfit's ``host`` tier,
  :func:`~memfit.accounting.tiers.host_tier`, so the tracker counts it as host memory);
* unpack it, when backward recomputes the block, by one all-gather over the tensor-parallel
  group into a whole input (the transient: one block's input whole, during that block's
  recomputation and backward, as plain checkpointing keeps it all along);

and a forward hook closes them. The gradients do not change: the recomputation sees the same
values. Gradients flow through the checkpoint's own graph, never through the slices.

What stays whole: the block's keyword arguments (attention mask, position ids, the rotary
cos/sin tables), which memfit's checkpointing passes through a closure; they are small (at
most ``seq x head_dim`` per table, a mask is ``None`` for causal attention) and are the same
for every block, shared rather than copied.

Costs: ``(t - 1)/t`` of every checkpointed input off the device (all of it with ``offload``),
one all-gather of each block's input per backward (``(t - 1)/t`` of its bytes received per
rank), and with ``offload`` a copy down in forward and up in backward.

Apply it after the blocks' activation checkpointing (either order works: the hooks sit
outside the block's forward, which checkpointing replaces); without checkpointing it
partitions the input wherever the block's first operations save it, which saves less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import memfit.device as dev

from ..accounting.tiers import host_tier
from ..accounting.tracker import label_open

__all__ = ["PartitionCounters", "PartitionedCheckpoints", "apply_partitioned_checkpointing"]


@dataclass
class PartitionCounters:
    """What the partitioning did since it was applied.

    Attributes:
        partitioned: Block inputs partitioned.
        whole_bytes: Their whole bytes (what plain checkpointing keeps on every rank).
        kept_bytes: Bytes this rank kept of them (its slices, padding included).
        offloaded_bytes: Of those, bytes kept in host memory.
        gathered: All-gathers made in backward.
    """

    partitioned: int = 0
    whole_bytes: int = 0
    kept_bytes: int = 0
    offloaded_bytes: int = 0
    gathered: int = 0


class _Slice:
    """This rank's slice of one block input, and how to make the whole input again."""

    __slots__ = ("dtype", "group", "numel", "owner", "requires_grad", "shape", "slice")

    def __init__(self, t: torch.Tensor, owner: PartitionedCheckpoints) -> None:
        group, world, rank = owner.group, owner.world, owner.rank
        self.owner, self.group = owner, group
        self.shape, self.dtype, self.numel = t.shape, t.dtype, t.numel()
        self.requires_grad = t.requires_grad
        flat = t.detach().reshape(-1)
        per = math.ceil(self.numel / world)
        lo, hi = min(rank * per, self.numel), min((rank + 1) * per, self.numel)
        with torch.no_grad():
            if owner.offload:
                with host_tier():
                    piece = dev.host_buffer((per,), t.dtype,
                                            pin=t.is_cuda and not dev.is_fake(t))
                piece[:hi - lo].copy_(flat[lo:hi], non_blocking=piece.is_pinned())
            else:
                piece = torch.empty(per, dtype=t.dtype, device=t.device)
                piece[:hi - lo].copy_(flat[lo:hi])
            if hi - lo < per:  # the last ranks' padding (never read back)
                piece[hi - lo:].zero_()
        # Kept for backward: the tracker's activations (in its host tier with offload).
        label_open(piece, "activations")
        self.slice = piece
        c = owner.counters
        c.partitioned += 1
        c.whole_bytes += self.numel * t.element_size()
        c.kept_bytes += per * t.element_size()
        c.offloaded_bytes += per * t.element_size() if owner.offload else 0

    def gather(self) -> torch.Tensor:
        """The whole input (an all-gather over the tensor-parallel group), freeing the slice."""
        owner = self.owner
        piece, self.slice = self.slice, None
        if piece is None:
            raise RuntimeError("a partitioned checkpoint was unpacked twice")
        device = owner.device if owner.offload else piece.device
        if piece.device != device:
            piece = piece.to(device, non_blocking=piece.is_pinned())
        whole = torch.empty(piece.numel() * owner.world, dtype=self.dtype, device=device)
        dist.all_gather_single(whole, piece, group=self.group)
        owner.counters.gathered += 1
        # A fresh leaf as the checkpoint saved it (requires_grad as the input did, so the
        # recomputation saves what the forward saved); gradients never flow through it.
        return whole[:self.numel].view(self.shape).detach().requires_grad_(self.requires_grad)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.gather() if isinstance(saved, _Slice) else saved


@dataclass
class PartitionedCheckpoints:
    """The hooks :func:`apply_partitioned_checkpointing` put on a module's blocks.

    Attributes:
        group: The tensor-parallel process group the inputs are split over.
        world: Its size (the tensor degree).
        rank: This process's rank in it.
        offload: Whether the slices wait in host memory.
        device: Where the whole inputs are gathered (the blocks' device).
        blocks: The blocks whose checkpointed inputs are partitioned.
        counters: What was partitioned and gathered (:class:`PartitionCounters`).
    """

    group: Any
    world: int
    rank: int
    offload: bool
    device: torch.device
    blocks: list[nn.Module]
    counters: PartitionCounters = field(default_factory=PartitionCounters)
    _handles: list[Any] = field(default_factory=list)
    _open: list[Any] = field(default_factory=list)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved
            self._open.append((None, []))
            return
        target = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if target is None:
            raise RuntimeError(
                f"{type(module).__name__} was called without a positional tensor input; "
                "partitioned checkpoints split a block's first positional tensor (its hidden "
                "states), so pass it positionally")

        # The target in a box the forward hook empties: autograd keeps the pack hook with
        # every tensor it saved, and a closure over the input would keep the input whole.
        box = [target]

        def pack(t: torch.Tensor) -> Any:
            # A leaf input is its owner's (a pipeline stage's receive buffer, kept for the
            # whole run): a slice of it would add bytes and free none.
            return _Slice(t, self) if box and t is box[0] and not t.is_leaf else t

        hooks = saved_tensors_hooks(pack, _unpack)
        hooks.__enter__()
        self._open.append((hooks, box))

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        hooks, box = self._open.pop() if self._open else (None, [])
        box.clear()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def remove(self) -> None:
        """Take the hooks off (idempotent); graphs built before still gather their slices."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def apply_partitioned_checkpointing(
    module: nn.Module,
    mesh_tp: Any,
    *,
    offload: bool = False,
    blocks: list[nn.Module] | None = None,
) -> PartitionedCheckpoints:
    """Partition the checkpointed input of each of ``module``'s blocks over the
    tensor-parallel group: each rank keeps ``1/t`` of it (on the host with ``offload``) and
    backward all-gathers it to recompute the block (see the module docstring).

    Every rank of the group calls this on its replica of the same module, and runs the same
    forwards and backwards in the same order (the all-gathers are collectives).

    Args:
        module: A pipeline stage (:class:`~memfit.distributed.pipeline.StageModule`: its
            ``blocks()``) or a whole causal LM (its decoder layers), its blocks checkpointed.
        mesh_tp: The tensor-parallel device mesh (``mesh["tp"]``) or its process group.
        offload: Keep the slices in host memory until backward (pinned on CUDA).
        blocks: The blocks to partition (default: the stage's or the model's blocks).

    Returns:
        The :class:`PartitionedCheckpoints` handle (``remove()`` takes the hooks off).

    Raises:
        ValueError: when ``module`` has no blocks.
    """
    group = mesh_tp.get_group() if hasattr(mesh_tp, "get_group") else mesh_tp
    if blocks is None:
        blocks = _blocks(module)
    if not blocks:
        raise ValueError(f"{type(module).__name__} has no blocks whose inputs to partition")
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if hasattr(param, "to_local"):
        device = param.to_local().device
    handle = PartitionedCheckpoints(group, dist.get_world_size(group), dist.get_rank(group),
                                    bool(offload), device, list(blocks))
    for block in blocks:
        handle._handles.append(block.register_forward_pre_hook(handle._pre, with_kwargs=True))
        handle._handles.append(block.register_forward_hook(handle._post, with_kwargs=True,
                                                           always_call=True))
    return handle


def _blocks(module: nn.Module) -> list[nn.Module]:
    """A stage's blocks, or a whole model's (its repeated decoder layers)."""
    if callable(getattr(module, "blocks", None)):
        return list(module.blocks())
    from .pipeline import model_blocks

    try:
        return [b for _, b in model_blocks(module)]
    except ValueError:
        return []
