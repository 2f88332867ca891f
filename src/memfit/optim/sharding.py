"""Optimizer math on parameters sharded as DTensors (FSDP2's ``fully_shard``).

FSDP2 hands the optimizer DTensor parameters and gradients, each rank holding a shard (by
default ``Shard(0)``: a block of rows).  memfit's optimizers step each rank's *local* tensors,
so element-wise state stays local and costs 1 / world of the whole; the few quantities that
need the full parameter (norms of trust-ratio optimizers, Adafactor's column statistics and
RMS) are sums of per-shard partial sums, reduced with ``all_reduce`` over the groups the
parameter is sharded across.

For a plain tensor every function here is a no-op or the plain computation: no
``torch.distributed`` call, no process group needed, single-process behaviour unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["all_reduce_sum_", "is_sharded", "local_tensor", "norms"]


def _dtensor_type() -> type | None:
    # Importing torch.distributed.tensor costs about half a second; a DTensor cannot exist
    # before someone imported it, so look it up instead of importing it here.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _is_dtensor(t: Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's local tensor, or ``t`` itself.

    The local tensor shares storage with the DTensor, so in-place updates of it update the
    (sharded) parameter.

    Args:
        t: A tensor, DTensor or not.

    Returns:
        The local tensor.
    """
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _shard_mesh_dims(t: Tensor, dims: Iterable[int] | None) -> list[int]:
    """Mesh dimensions over which tensor dimensions ``dims`` (all if None) of ``t`` are split."""
    if not _is_dtensor(t):
        return []
    from torch.distributed.tensor import Shard

    wanted = None if dims is None else {d % t.ndim for d in dims}
    return [
        mesh_dim
        for mesh_dim, placement in enumerate(t.placements)  # type: ignore[attr-defined]
        if isinstance(placement, Shard) and (wanted is None or placement.dim % t.ndim in wanted)
    ]


def is_sharded(t: Tensor, dims: Iterable[int] | None = None) -> bool:
    """Whether ``t`` is a DTensor split along any of tensor dimensions ``dims`` (any if None).

    Args:
        t: A tensor, DTensor or not.
        dims: Tensor dimensions of interest (negative ones count from the end).

    Returns:
        ``True`` if some ``Shard`` placement of ``t`` splits one of ``dims``.
    """
    return bool(_shard_mesh_dims(t, dims))


def all_reduce_sum_(partial: Tensor, like: Tensor, dims: Iterable[int] | None = None) -> Tensor:
    """Sum ``partial`` in place across the shards of ``like``.

    ``partial`` is a plain tensor holding this rank's partial sum of something over ``like``'s
    local shard; afterwards it holds the sum over the whole of ``like``, on every rank.

    Args:
        partial: Plain tensor, the same shape on every rank; overwritten.
        like: The (possibly DTensor) parameter the sum runs over.
        dims: Only reduce across shards of these tensor dimensions of ``like`` (the dimensions
            the sum ran over); ``None``: all of them.

    Returns:
        ``partial``, for chaining.  Untouched (and no collective runs) if ``like`` is not
        sharded along ``dims``.
    """
    mesh_dims = _shard_mesh_dims(like, dims)
    if mesh_dims:
        import torch.distributed as dist

        mesh = like.device_mesh  # type: ignore[attr-defined]
        for mesh_dim in mesh_dims:
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim))
    return partial


def norms(like: Tensor, *local: Tensor) -> tuple[Tensor, ...]:
    """2-norms of whole tensors shaped like ``like``, given their local shards.

    Unsharded, this is ``torch.linalg.vector_norm`` of each tensor.  Sharded, the squared local
    norms are summed across shards in a single ``all_reduce`` and square-rooted.

    Args:
        like: The (possibly DTensor) parameter whose sharding the tensors share.
        *local: Local shards (plain tensors of one dtype).

    Returns:
        One 0-d tensor per input.
    """
    if not is_sharded(like):
        return tuple(torch.linalg.vector_norm(t) for t in local)
    squares = torch.stack([torch.linalg.vector_norm(t).square() for t in local])
    return tuple(all_reduce_sum_(squares, like).sqrt_().unbind())
