"""Expert parallelism for transformers' mixture-of-experts blocks: :func:`apply_expert_parallel`.

``parallel.expert = E`` splits every MoE layer's experts over ``E`` ranks carved out of the
data-parallel ranks (as DeepSpeed-MoE and torchtitan do): ranks ``g*E .. g*E+E-1`` form an
expert group, rank ``g*E + j`` keeps experts ``j*n/E .. (j+1)*n/E - 1`` of the ``n``, and the
ranks holding the same experts (``j, j+E, j+2E, ...``) are their replicas. Each MoE layer's
forward then runs: the router (replicated) -> top-k -> tokens sorted by the rank of their
expert -> an all-to-all of the counts, then of the tokens -> this rank's experts (transformers'
own experts module, at ``n/E`` experts, so whichever kernel it dispatches to runs) -> an
all-to-all back -> the router-weighted sum, in the token order the unsplit block uses.

torch.distributed gives the all-to-all (``all_to_all_single``, uneven splits; gloo runs it
on the CPU) and the process groups (``init_device_mesh``); what torch lacks and this adds:

* an all-to-all autograd understands through a public API (:class:`_AllToAll`: its backward
  is the all-to-all back; ``torch.distributed.nn.functional``'s is deprecated and
  ``_functional_collectives``' is private);
* the dispatch and combine around a transformers MoE block, and the split of its fused expert
  tensors (``gate_up_proj``, ``down_proj``) to this rank's experts;
* gradients averaged correctly over the two kinds of groups: the replicated parameters over
  every data rank (DDP or FSDP2 over the whole world, as :mod:`memfit.distributed.data`
  does), an expert's over its replicas only, divided by the whole data degree (its gradient
  already sums the contributions of every rank of its expert group, which sent it tokens);
* in a dry run (fake tensors and torch's ``fake`` process group, where a collective moves
  nothing and the counts a rank would receive are unknown), the counts received taken from
  memfit's routing policy (:class:`memfit.estimate.values.DryRunValues`): every rank routes
  its tokens as this one does, so rank ``j`` receives from each rank of its group what it
  sends itself. Balanced routing gives each rank its share; ``expert_load=c`` loads expert 0,
  so the first rank of each group receives ``c`` times its experts' share of expert 0: the
  worst rank, which the per-rank prediction reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import is_fake

__all__ = ["ExpertParallel", "apply_expert_parallel", "moe_blocks"]


def moe_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every MoE block of transformers' Mixtral layout in ``model``: a ``gate`` router that
    returns ``(logits, weights, indices)`` and an ``experts`` module of fused 3-D expert
    tensors (``gate_up_proj``, ``down_proj``) with ``num_experts``."""
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if (
            type(module).__name__ == "MixtralSparseMoeBlock"
            and isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter)
            and isinstance(getattr(experts, "down_proj", None), nn.Parameter)
        ):
            yield name, module


class ExpertParallel:
    """The expert split of a model: its groups, and the expert parameters that only their
    replicas average.

    Attributes:
        degree: Ranks each layer's experts are split over.
        data: The data-parallel degree (every rank).
        group: The expert group (the ranks that exchange tokens).
        replicas: The group of the ranks holding the same experts (``None`` with one).
        replica_mesh: A one-dimensional device mesh of the replicas, for FSDP2.
        parameters: The expert parameters by name (this rank's shards).
    """

    def __init__(self, degree: int, data: int, group: Any, replicas: Any, replica_mesh: Any,
                 parameters: dict[str, nn.Parameter]) -> None:
        self.degree, self.data = degree, data
        self.group, self.replicas, self.replica_mesh = group, replicas, replica_mesh
        self.parameters = parameters

    def sync(self) -> None:
        """Sum the expert gradients over their replicas (their division by the data degree
        was done by a hook on each gradient as it was made). Every rank calls it once per
        step, after the step's last backward; DDP's engine only (FSDP2 reduces the experts
        over :attr:`replica_mesh` itself)."""
        if self.replicas is None:
            return
        for p in self.parameters.values():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.replicas)


def apply_expert_parallel(model: nn.Module, degree: int, data: int,
                          device_type: str = "cpu",
                          data_ranks: list[list[int]] | None = None) -> ExpertParallel:
    """Split ``model``'s MoE experts over ``degree`` ranks of each expert group, in place.

    Call it in every rank of the world, each with the same arguments, before the
    data-parallel engine wraps the model (:func:`memfit.distributed.data.apply_data_parallel`
    and :func:`memfit.distributed.layout.build_layout` do). Memory: each rank keeps
    ``1 / degree`` of the expert parameters (and so of their gradients and optimizer state);
    the dispatched tokens and the experts' outputs are each ``tokens x top_k x hidden`` per
    layer, as in the unsplit block.

    Args:
        model: The model (or a pipeline stage of it), on its device (every rank built it
            alike).
        degree: The expert-parallel degree.
        data: The data-parallel degree; ``degree`` divides it.
        device_type: The device the process group communicates on (``cpu`` or ``cuda``).
        data_ranks: Every data-parallel group of the world, as lists of ranks (default: the
            whole world is one): each is carved into expert groups of consecutive members.

    Returns:
        The :class:`ExpertParallel` handle.

    Raises:
        ValueError: when the model has no MoE block memfit can split, or ``degree`` does not
            divide its experts or ``data``.
    """
    blocks = list(moe_blocks(model))
    if not blocks:
        raise ValueError(
            "parallel expert needs a mixture-of-experts model of transformers' Mixtral layout "
            "(a router and fused expert tensors in each MoE block); this model has none, so "
            "set expert 1"
        )
    n = blocks[0][1].experts.num_experts
    if n % degree:
        raise ValueError(
            f"parallel expert {degree} does not divide the model's {n} experts; use an "
            "expert degree that divides it"
        )
    if data % degree:
        raise ValueError(f"parallel expert {degree} must divide data {data}")
    rank = dist.get_rank()
    group, replicas, mesh, index = _groups(degree, data_ranks or [list(range(data))],
                                          rank, device_type)
    local = n // degree
    first = index * local
    params: dict[str, nn.Parameter] = {}
    for name, block in blocks:
        experts = block.experts
        for attr in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, attr)
            mine = nn.Parameter(whole.detach()[first:first + local].clone(),
                                requires_grad=whole.requires_grad)
            setattr(experts, attr, mine)
            params[f"{name}.experts.{attr}"] = mine
            # Its gradient sums every rank of the group's loss (their tokens came here):
            # divided by the data degree, it is the average the replicated parameters get.
            mine.register_hook(lambda g, d=data: g / d)
        experts.num_experts = local
        block._memfit_expert = _Dispatch(degree, index, local, group)
        block.forward = _forward.__get__(block)
    return ExpertParallel(degree, data, group, replicas if data > degree else None, mesh,
                          params)


def _groups(degree: int, data_ranks: list[list[int]], rank: int,
            device_type: str) -> tuple[Any, Any, Any, int]:
    """This rank's expert group, replica group (and its device mesh, for FSDP2) and index in
    its expert group. Every rank creates every group, in the same order (``new_group``'s
    rule): the expert groups are consecutive members of a data group (within a node), the
    replicas stride by ``degree``."""
    from torch.distributed.device_mesh import DeviceMesh

    mine: dict[str, Any] = {}
    for ranks in data_ranks:
        for g in range(len(ranks) // degree):
            members = ranks[g * degree:(g + 1) * degree]
            made = dist.new_group(members)
            if rank in members:
                mine["expert"], mine["index"] = made, members.index(rank)
        for j in range(degree):
            members = ranks[j::degree]
            made = dist.new_group(members)
            if rank in members:
                mine["replica"] = made
                mine["mesh"] = DeviceMesh.from_group(made, device_type)
    return mine["expert"], mine["replica"], mine["mesh"], mine["index"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows, ``x``'s split by ``sent`` rows per rank, the result's
    by ``got``; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, got: list[int], sent: list[int],
                group: Any) -> torch.Tensor:
        ctx.got, ctx.sent, ctx.group = got, sent, group
        out = x.new_empty((sum(got), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), got, sent, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.got, group=ctx.group)
        return out, None, None, None


class _Dispatch:
    """One MoE block's place in its expert group."""

    def __init__(self, degree: int, index: int, local: int, group: Any) -> None:
        self.degree, self.index, self.local, self.group = degree, index, local, group

    def received(self, counts: torch.Tensor, sent: list[int]) -> list[int]:
        """The token counts this rank receives, per source rank then local expert, from the
        per-expert ``counts`` it sends (``sent``, as numbers): exchanged for real, or in a dry
        run what the routing policy gives every rank (the same routing as this one's)."""
        e, m = self.degree, self.local
        if is_fake(counts):
            return sent[self.index * m:(self.index + 1) * m] * e
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        return got.tolist()


def _counts(counts: torch.Tensor, routed: int, n: int) -> list[int]:
    """``counts`` as numbers. A dry run knows them from memfit's routing policy; where it
    does not (more routed tokens than a shadow holds), they are the balanced split."""
    if not is_fake(counts):
        return counts.tolist()
    try:
        return counts.tolist()
    except Exception:  # fake tensors refuse a value they do not know
        return [routed // n + (1 if i < routed % n else 0) for i in range(n)]


def _forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """An expert-parallel MixtralSparseMoeBlock forward (see the module docstring)."""
    ep: _Dispatch = self._memfit_expert
    b, s, h = hidden_states.shape
    if self.training and self.jitter_noise > 0:
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
            1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
    x = hidden_states.reshape(-1, h)
    _, weights, index = self.gate(x)
    k = index.shape[-1]
    n = ep.degree * ep.local
    flat = index.reshape(-1)
    # Routed slots sorted by expert (so by destination rank); stable: a token's order kept.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n)
    sent = _counts(counts, flat.numel(), n)
    got = ep.received(counts, sent)
    m = ep.local
    send_splits = [sum(sent[r * m:(r + 1) * m]) for r in range(ep.degree)]
    recv_splits = [sum(got[r * m:(r + 1) * m]) for r in range(ep.degree)]
    tokens = x[order // k]
    recv = _AllToAll.apply(tokens, recv_splits, send_splits, ep.group)
    # Received rows come by source rank, then local expert: their local expert ids.
    local_ids = [e for r in range(ep.degree) for e in range(m) for _ in range(got[r * m + e])]
    ids = torch.tensor(local_ids, dtype=torch.long, device=x.device).reshape(-1, 1)
    ones = torch.ones(len(local_ids), 1, dtype=weights.dtype, device=x.device)
    out = self.experts(recv, ids, ones)
    back = _AllToAll.apply(out, send_splits, recv_splits, ep.group)
    scaled = back * weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
    y = torch.zeros_like(x).index_add(0, order // k, scaled.to(x.dtype))
    return y.reshape(b, s, h)
