"""A layout's data dimension without sharding (ZeRO 0): each module a rank trains under torch's
``DistributedDataParallel`` on the ``dp`` process group, its gradients living in DDP's buckets.

torch does the reduction: DDP's reducer all-reduces (and averages) each bucket of gradients as
backward fills it, on the last micro-batch only (``no_sync`` before it; torch's pipeline stage
does that itself for a DDP-wrapped stage, ``PipelineStage.backward_maybe_with_nosync``), and
``gradient_as_bucket_view=True`` makes every ``.grad`` a view into its bucket, so the buckets
*are* the gradients: no second copy. memfit adds what torch lacks for a layout:

* :class:`LocalShards`, DDP over tensor-parallel modules. DDP's reducer takes plain tensors, and
  torch's own bridge (``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``, in
  2.13) replaces the DTensor parameters by plain module attributes at the first forward: the
  module loses them and their gradients never reach DDP's buckets. :class:`LocalShards` gives
  DDP each DTensor parameter's local shard (same storage) as a parameter of its own, and around
  each forward puts ``DTensor.from_local`` of it (a view, differentiable) in the modules' place,
  so gradients reach the shards, whole for this rank's share, as the DTensor's would.
* :class:`Replicas`, the buckets kept as the gradients for the whole run. DDP adopts gradients
  that exist when it is built, so :func:`replicate` gives each parameter a zero gradient first:
  from the first backward on, micro-batches accumulate into the buckets. ``zero_grad
  (set_to_none=True)`` drops the views, after which autograd would allocate a second set of
  gradients under ``no_sync`` (copied into the buckets only on the last micro-batch):
  :meth:`Replicas.before_step` points them back at their views, zeroed. DDP rebuilds its
  buckets once, in the order gradients became ready, at the first forward after the first
  synchronised backward, copying every gradient into new buckets (for a moment both exist):
  :meth:`Replicas.after_step` rebuilds them at the end of the first step instead, when no
  activation and (on a fresh run) no optimizer state is live, so that no later step pays it.

Memory: the gradients (this rank's shards) are live from :func:`replicate` on, for the whole
run, also during the forwards; the reduction allocates nothing. :func:`memfit.estimate.layout.
predict_layout` holds them so (one contiguous buffer, labelled ``gradients``). Against training
that frees the gradients between steps (the per-parameter all-reduce this replaced), a rank
whose peak falls in a forward or early backward holds up to the gradients' bytes more: on
tests/distributed/test_layout.py's tiny Llama, +9% for the first stage of data 2 x pipeline 2,
+7% for data 2 x tensor 2 with two micro-batches, +23% with one; the last stage, whose peak
comes when the gradients exist anyway, is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..accounting.tracker import label_open

__all__ = ["LocalShards", "Replicas", "local_shards", "replicate"]


class LocalShards(nn.Module):
    """``module`` with its DTensor parameters' local shards as plain parameters, for DDP.

    The shards are ``nn.Parameter`` s sharing storage with the DTensors' local tensors, so an
    optimizer over :meth:`parameters` updates the module's DTensors in place; a parameter that
    is not a DTensor is shared as it is. ``module`` is not a submodule (DDP must see only the
    shards) and keeps its DTensor parameters (its state dict, its full-tensor gathering) but
    they get no ``.grad``: :meth:`named_grads` gives the shards' gradients under the module's
    names, as DTensors.

    Args:
        module: A module split by tensor parallelism (``parallelize_module``).
    """

    def __init__(self, module: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        super().__init__()
        object.__setattr__(self, "inner", module)  # not registered: hidden from DDP
        self.shards = nn.ParameterList()
        # Each (owning module, attribute) of a DTensor parameter, and its shard's index: a tied
        # parameter has several slots and one shard. Slots, not dotted names, so that a later
        # wrapper around a block (checkpointing) changes nothing.
        self._slots: list[tuple[nn.Module, str, int]] = []
        self._names: list[str] = []
        self._specs: list[Any] = []
        index: dict[int, int] = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for attr, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in index:
                    index[id(p)] = len(self.shards)
                    self._names.append(f"{mod_name}.{attr}" if mod_name else attr)
                    if isinstance(p, DTensor):
                        shard = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
                        self._specs.append(p._spec)
                    else:
                        shard = p
                        self._specs.append(None)
                    self.shards.append(shard)
                if self._specs[index[id(p)]] is not None:
                    self._slots.append((mod, attr, index[id(p)]))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._dtensors():
            return self.inner(*args, **kwargs)

    @contextlib.contextmanager
    def _dtensors(self) -> Iterator[None]:
        """The module's DTensor parameters replaced by DTensor views of the shards (autograd
        then carries their gradients to the shards), put back after."""
        from torch.distributed.tensor import DTensor

        views: dict[int, Any] = {}
        saved = []
        for mod, attr, i in self._slots:
            if i not in views:
                spec = self._specs[i]
                views[i] = DTensor.from_local(self.shards[i], spec.mesh, spec.placements,
                                              run_check=False, shape=spec.shape,
                                              stride=spec.stride)
            saved.append(mod._parameters[attr])
            mod._parameters[attr] = views[i]  # the dict, not setattr: a view is no Parameter
        try:
            yield
        finally:
            for (mod, attr, _), p in zip(self._slots, saved, strict=True):
                mod._parameters[attr] = p

    def shard_of(self) -> dict[int, nn.Parameter]:
        """Each DTensor parameter's shard, by the DTensor parameter's ``id``."""
        return {id(mod._parameters[attr]): self.shards[i] for mod, attr, i in self._slots}

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every parameter's gradient under the module's name: a DTensor (a view of the
        shard's gradient) for a split parameter, ``None`` where there is none."""
        from torch.distributed.tensor import DTensor

        for name, shard, spec in zip(self._names, self.shards, self._specs, strict=True):
            g = shard.grad
            if g is not None and spec is not None:
                g = DTensor.from_local(g, spec.mesh, spec.placements, run_check=False,
                                       shape=spec.shape, stride=spec.stride)
            yield name, g


def local_shards(module: nn.Module) -> nn.Module:
    """``module`` as DDP can take it: :class:`LocalShards` of it when it holds DTensor
    parameters (tensor parallelism), else itself."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        return LocalShards(module)
    return module


def replicate(module: nn.Module, group: Any, *, bucket_bytes: int,
              device: torch.device) -> Any:
    """``module`` under ``DistributedDataParallel`` on ``group``, its gradients kept in the
    buckets (``gradient_as_bucket_view``) from the start (see the module docstring).

    Buffers are not broadcast at each forward: a layout's replicas start from the same model
    and its buffers are constants (rotary frequencies, masks).

    Args:
        module: What this rank trains (a stage, or the whole model), possibly split by tensor
            parallelism.
        group: The data-parallel process group (``mesh["dp"].get_group()``).
        bucket_bytes: DDP's bucket size (``ParallelConfig.bucket_bytes``).
        device: Where the module computes.

    Returns:
        The ``DistributedDataParallel`` module (around :class:`LocalShards` of ``module`` when
        it holds DTensors).
    """
    from torch.nn.parallel import DistributedDataParallel

    target = local_shards(module)
    for p in target.parameters():
        if p.requires_grad and p.grad is None:
            # DDP adopts an existing gradient as its bucket view (and frees it).
            p.grad = torch.zeros_like(p)
    return DistributedDataParallel(
        target, device_ids=[device] if device.type == "cuda" else None,
        process_group=group, bucket_cap_mb=bucket_bytes / (1 << 20),
        gradient_as_bucket_view=True, forward_sync_buffers=False)


class Replicas:
    """A rank's DDP-wrapped modules, and their gradients kept as views of DDP's buckets.

    Args:
        ddps: The ``DistributedDataParallel`` modules (:func:`replicate`), one per module the
            rank trains.
    """

    def __init__(self, ddps: list[Any]) -> None:
        self.ddps = ddps
        self._views = self._grads()

    def parameters(self) -> list[nn.Parameter]:
        """What the rank's optimizer steps: DDP's parameters (the shards under tensor
        parallelism), each once."""
        seen: dict[int, nn.Parameter] = {}
        for ddp in self.ddps:
            for p in ddp.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for p in self.parameters() if p.grad is not None]

    def before_step(self) -> None:
        """Point every gradient dropped since the last step back at its bucket view, zeroed,
        and tell any open tracker that the buckets are gradients (they are live all along)."""
        for p, view in self._views:
            if p.grad is None:
                view.zero_()
                p.grad = view
        label_open([v for _, v in self._views], "gradients")

    def after_step(self) -> None:
        """After a step's last backward: rebuild DDP's buckets now if it has not yet (the
        first step; every replica calls this at the same point, as the rebuild agrees the
        bucket order across them), and keep the gradients' views."""
        rebuilt = False
        for ddp in self.ddps:
            rebuilt |= bool(ddp.reducer._rebuild_buckets())
        if rebuilt:
            self._views = self._grads()
            label_open([v for _, v in self._views], "gradients")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """No gradient reduction in the backwards run inside (every module's ``no_sync``)."""
        with contextlib.ExitStack() as stack:
            for ddp in self.ddps:
                stack.enter_context(ddp.no_sync())
            yield
