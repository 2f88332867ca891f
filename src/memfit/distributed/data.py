"""Data parallelism and ZeRO stages 0-3 on torch.distributed: :func:`apply_data_parallel`.

torch.distributed does the work; this module chooses and configures it for a plan, and adds
what the engines lack for memfit:

* one handle for four engines (DDP; DDP + ``ZeroRedundancyOptimizer``; FSDP2 ``fully_shard``
  on each repeated block and the root, with or without resharding after forward), so the rest
  of memfit sees a module to run, an optimizer to shard and a stepper;
* gradient synchronisation only on a step's last micro-batch, for both engines (DDP decides in
  its forward, FSDP2 in its backward), behind the :class:`~memfit.apply.stepper.Stepper`
  protocol;
* the global batch split into this rank's share (:func:`local_batch`) and the loss averaged
  back (:func:`mean_over_ranks`), so a data-parallel step computes the same loss and gradient
  as one process on the whole batch;
* FSDP2's in-place storage resizes (it frees gathered parameters with
  ``untyped_storage().resize_(0)``, which no dispatched op shows) reported to memfit's tracker,
  so the per-rank memory it measures is exact.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..accounting.tracker import label_open, storage_resized
from ..stepping import BaseStepper
from ..techniques import ENGINES, ApplyContext, Technique
from ..workload import Batch, batch_size_of, split_batch
from .config import ParallelConfig

__all__ = [
    "DataParallel",
    "DataParallelStepper",
    "any_rank",
    "apply_data_parallel",
    "batches_are_local",
    "batches_local",
    "local_batch",
    "mean_over_ranks",
    "rank_and_world",
]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (``(0, 1)`` outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_LOCAL: ContextVar[bool] = ContextVar("memfit_batches_local", default=False)


@contextlib.contextmanager
def batches_are_local() -> Iterator[None]:
    """Within this context a data-parallel training step takes its batch as this rank's
    share already (not the global batch to split). The planner uses it: it searches on one
    rank's workload, whose batch is already the share."""
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def batches_local() -> bool:
    """Whether :func:`batches_are_local` is in force."""
    return _LOCAL.get()


def local_batch(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's share of a global ``batch``: the ``rank``-th of ``world`` equal slices.

    Raises:
        ValueError: when ``world`` does not divide the batch size.
    """
    size = batch_size_of(batch)
    if size % world:
        raise ValueError(
            f"a batch of {size} samples cannot be split evenly over {world} processes; use a "
            f"batch size that is a multiple of {world}"
        )
    if world == 1:
        return batch
    return split_batch(batch, size // world)[rank]


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` holds on any rank (``flag`` itself outside a process group); every
    rank must call it. ``device``: where the backend communicates (CUDA for NCCL)."""
    _, world = rank_and_world()
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (itself outside a process group)."""
    _, world = rank_and_world()
    if world == 1:
        return value
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return (t / world).reshape(())


class DataParallel:
    """A model under data parallelism: what runs its forward, how its optimizer is sharded.

    Made by :func:`apply_data_parallel`.

    Attributes:
        config: The settings.
        module: The module whose forward the training step calls (DDP's wrapper for stages 0
            and 1; the model itself, changed in place by ``fully_shard``, for stages 2 and 3).
        model: The model given.
    """

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        config: ParallelConfig,
        stand_in: Any = None,
        replaced: Mapping[int, tuple[weakref.ref, nn.Parameter]] | None = None,
    ) -> None:
        self.model = model
        self.module = module
        self.config = config
        self.stand_in = stand_in
        self._synced = 0  # backwards that synchronised gradients
        # FSDP2's sharded parameter for each parameter it replaced, by the old one's id (a
        # weak reference to the old one guards against a reused id without keeping it alive).
        self._replaced = dict(replaced or {})
        self.experts: Any = None  # the expert split, with parallel.expert > 1

    def after_backward(self, last: bool) -> None:
        """On a step's last backward, the expert gradients summed over their replicas (DDP
        leaves them to :class:`~memfit.distributed.expert.ExpertParallel`; FSDP2 reduces
        them itself)."""
        if last and self.experts is not None and not self.config.sharded:
            self.experts.sync()

    @property
    def syncs_in_forward(self) -> bool:
        """Whether gradients are averaged only for a forward run through :attr:`module`
        (DDP, stages 0 and 1: its forward arms the all-reduce of the coming backward; a
        forward of the bare model leaves it unarmed). FSDP2 shards the model in place, so any
        forward of it counts."""
        return not self.config.sharded and self.stand_in is None

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Stage 1: the same optimizer as a ``ZeroRedundancyOptimizer`` (each rank keeps the
        state of its share of the parameters). Stages 2 and 3: ``optimizer`` itself, its
        parameters that FSDP2 replaced by shards swapped for those, in place (an optimizer
        built before :func:`apply_data_parallel`, such as one given to ``prepare()``, would
        otherwise step the old, unsharded parameters, which the model no longer uses). Stage 0:
        ``optimizer`` unchanged.

        Raises:
            ValueError: when the optimizer cannot be rebuilt (stage 1) or already has state
                for the parameters to swap (stages 1-3).
        """
        if self.config.sharded:
            return self._point_at_shards(optimizer)
        if self.config.zero_stage != 1:
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls = type(optimizer)
        name = cls.__name__
        if optimizer.state:
            raise ValueError(
                f"ZeRO stage 1 rebuilds the optimizer per process, and this {name} already has "
                "state that would be lost; pass a fresh optimizer or use zero_stage 0, 2 or 3"
            )
        kwargs: dict[str, Any] = {}
        for key, param in inspect.signature(cls.__init__).parameters.items():
            if key in ("self", "params") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if key in optimizer.defaults:
                kwargs[key] = optimizer.defaults[key]
            elif hasattr(optimizer, key):  # a setting the optimizer keeps as an attribute
                kwargs[key] = getattr(optimizer, key)
            elif param.default is inspect.Parameter.empty:
                raise ValueError(
                    f"ZeRO stage 1 cannot rebuild {name}: its setting {key!r} is neither in its "
                    "defaults nor kept on it; use zero_stage 0, 2 or 3"
                )
        # Each parameter group with its own settings (ZeroRedundancyOptimizer takes groups).
        groups = [dict(group) for group in optimizer.param_groups]
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)

    def _point_at_shards(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        def shard(p: Any) -> Any:
            entry = self._replaced.get(id(p))
            return entry[1] if entry is not None and entry[0]() is p else None

        if not any(shard(p) is not None for g in optimizer.param_groups for p in g["params"]):
            return optimizer  # built over the shards already (the plan's optimizer)
        if optimizer.state:
            raise ValueError(
                f"ZeRO stage {self.config.zero_stage} replaces the model's parameters with "
                f"shards, and this {type(optimizer).__name__} already has state for the old "
                "ones that would be lost; pass an optimizer that has not stepped yet"
            )
        for group in optimizer.param_groups:
            group["params"] = [shard(p) if shard(p) is not None else p for p in group["params"]]
        return optimizer

    def attach_optimizer(self, optimizer: Any) -> None:
        """Give DDP the communication hook the optimizer needs: 1-bit Adam's compressed
        all-reduce (:mod:`memfit.distributed.onebit`) for
        :class:`~memfit.optim.onebit_adam.OneBitAdam`; nothing for other optimizers. A dry
        run's stand-in for DDP communicates nothing (the hook's error buffers, 4 bytes per
        gradient element from the first compressed step, are not in its figure)."""
        from ..optim.onebit_adam import OneBitAdam

        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, OneBitAdam) and not self.config.sharded and self.stand_in is None:
            from .onebit import register_onebit_adam

            self.onebit = register_onebit_adam(self.module, inner)

    def before_forward(self, last: bool) -> None:
        """DDP decides in its forward whether the coming backward all-reduces."""
        if self.stand_in is not None:
            if self._synced == 1:  # DDP rebuilds its buckets here, once
                self.stand_in.reallocate()
                self._synced += 1
            return
        if not self.config.sharded:
            self.module.require_backward_grad_sync = last  # what DDP.no_sync() toggles

    def before_backward(self, last: bool) -> None:
        """FSDP2 decides in its backward whether to reduce-scatter."""
        if last and self._synced < 2:
            self._synced += 1
        if self.config.sharded:
            self.module.set_requires_gradient_sync(last)  # type: ignore[operator]

    def remove(self) -> None:
        """Stages 0 and 1 leave the model as it was (DDP only wraps it). FSDP2 changed the
        model in place and cannot undo it.

        Raises:
            RuntimeError: for stages 2 and 3.
        """
        if self.stand_in is not None:
            self.stand_in.remove()
            return
        if self.config.sharded:
            raise RuntimeError(
                "a model sharded by FSDP2 (ZeRO stage 2 or 3) cannot be unsharded in place; "
                "build the model again to train it under another plan"
            )


class DataParallelStepper(BaseStepper):
    """A stepper that trains on this rank's share of the global batch, synchronises gradients
    on a step's last micro-batch only, steps through ``inner`` (plain or, for stage 1, the
    sharded optimizer) and reports the loss averaged over the ranks."""

    def __init__(self, inner: Any, parallel: DataParallel) -> None:
        self.inner = inner
        self.parallel = parallel

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's share of the global ``batch`` (the batch itself inside
        :func:`batches_are_local`)."""
        if batches_local():
            return batch
        return local_batch(batch, *rank_and_world())

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the ranks' losses: the global batch's."""
        return mean_over_ranks(loss)

    def before_forward(self, last: bool) -> None:
        self.parallel.before_forward(last)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.parallel.before_backward(last)
        self.inner.backward(loss, last=last)
        self.parallel.after_backward(last)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        if self.parallel.config.sharded:
            self.inner.zero_grad()
            return
        # DDP's gradients are views into its buckets, which live for the whole run: zeroing
        # them in place (instead of dropping them) lets the next backward accumulate into the
        # buckets without a temporary gradient per parameter, and keeps the memory visible.
        self.inner.optimizer.zero_grad(set_to_none=False)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)


def apply_data_parallel(
    model: nn.Module,
    config: ParallelConfig,
    *,
    mixed_dtype: torch.dtype | None = None,
    dry_stand_in: Callable[[nn.Module], Any] | None = None,
) -> DataParallel:
    """Put ``model`` under the data-parallel engine of ``config.zero_stage``.

    Call it in every process of a process group of ``config.data`` ranks (the launcher's
    ``memfit train --nproc-per-node N`` or ``torchrun`` starts them; a dry run uses a fake
    process group), after the single-device techniques (checkpointing wraps the blocks FSDP2
    then shards) and before the optimizer is built (FSDP2's sharded parameters are what it
    steps).

    Args:
        model: The model, on its device.
        config: The settings.
        mixed_dtype: With a mixed-precision plan, the compute dtype: FSDP2 then gathers
            parameters in it and reduces gradients in fp32 (``MixedPrecisionPolicy``).
        dry_stand_in: What stands in for DDP (stages 0 and 1) in a dry run, built from the
            model: a handle with ``reallocate()`` and ``remove()``. DDP's C++ constructor
            reads parameter values, which a dry run's fake tensors lack; its memory is its
            buckets (every gradient, contiguous, held for the whole run, zeroed in place),
            which memfit's contiguous gradient buffer holds exactly, so
            :func:`memfit.apply.compose.apply_plan` passes
            :func:`~memfit.strategies.grad_buffer.apply_grad_buffer` (the all-reduce moves no
            memory). Passed in, not imported: a parallel engine and a technique meet only
            in :mod:`memfit.apply`.

    Returns:
        The :class:`DataParallel` handle.

    Raises:
        ValueError: outside a process group of ``config.data`` ranks, or in a dry run of
            stages 0 and 1 without ``dry_stand_in``.
    """
    _, world = rank_and_world()
    if world != config.data or not dist.is_initialized():
        raise ValueError(
            f"the plan trains on {config.data} processes but this one is in a group of {world}; "
            f"launch with `memfit train --nproc-per-node {config.data}` or `torchrun "
            f"--nproc-per-node {config.data} -m memfit train`"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    experts = None
    if config.expert > 1:
        from .expert import apply_expert_parallel

        experts = apply_expert_parallel(model, config.expert, config.data, device.type)
    handle = _engine(model, config, device, mixed_dtype, dry_stand_in, experts)
    handle.experts = experts
    return handle


def _engine(model: nn.Module, config: ParallelConfig, device: torch.device,
            mixed_dtype: torch.dtype | None, dry_stand_in: Callable[[nn.Module], Any] | None,
            experts: Any) -> DataParallel:
    """DDP, or FSDP2 on each block and the root (the experts, with ``experts``, sharded over
    their replicas only), as :func:`apply_data_parallel` describes."""
    world = config.data
    if not config.sharded and _dry():
        # DDP's C++ constructor reads parameter values, which a dry run's fake tensors lack:
        # the caller's stand-in holds its buckets (see ``dry_stand_in``).
        if dry_stand_in is None:
            raise ValueError(
                "a dry run cannot build DDP (its constructor reads parameter values, which "
                "fake tensors lack); pass dry_stand_in, what holds its buckets instead"
            )
        return DataParallel(model, model, config, stand_in=dry_stand_in(model))
    if not config.sharded:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if experts is not None:  # averaged over their replicas only (ExpertParallel.sync)
            DDP._set_params_and_buffers_to_ignore_for_model(model, list(experts.parameters))
        ddp = DDP(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=config.bucket_bytes / (1 << 20),
            gradient_as_bucket_view=True,  # gradients live in the buckets: no second copy
        )
        return DataParallel(model, ddp, config)
    _report_fsdp_resizes()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..blocks import find_blocks

    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=mixed_dtype, reduce_dtype=torch.float32)
        if mixed_dtype is not None
        else MixedPrecisionPolicy()
    )
    reshard = config.zero_stage == 3 and config.reshard_after_forward
    before = {name: weakref.ref(p) for name, p in model.named_parameters()}
    if experts is not None:
        from .expert import moe_blocks

        for _, moe in moe_blocks(model):
            # The experts shard over their replicas; their gradient sums the whole expert
            # group's contributions, so it is divided by the data degree, not the mesh's.
            fully_shard(moe.experts, mesh=experts.replica_mesh, reshard_after_forward=reshard,
                        mp_policy=mp)
            moe.experts.set_gradient_divide_factor(float(world))
    for _, block in find_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root (embeddings, head) is gathered for the whole step: it is needed first in
    # forward and last in backward.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    replaced = {}
    for name, p in model.named_parameters():
        old = before[name]()
        if old is not None and old is not p:
            replaced[id(old)] = (before[name], p)
    return DataParallel(model, model, config, replaced=replaced)


def _dry() -> bool:
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


_PATCHED = False


def _report_fsdp_resizes() -> None:
    """Make FSDP2's storage frees and re-allocations visible to memfit's trackers (once per
    process; a no-op while no tracker is open)."""
    global _PATCHED
    if _PATCHED:
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        storage_resized([tensor])
        label_open([tensor], "parameters")  # a gathered (unsharded) parameter

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        storage_resized([tensor])

    _fsdp_param.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    _PATCHED = True


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> DataParallel | None:
    if ctx.engine == "lightning":
        return None  # Lightning's own strategy (DDP, FSDP) wraps the model
    plan = ctx.plan
    mixed = {"bf16-mixed": torch.bfloat16}.get(plan.precision.mode)
    parallel = apply_data_parallel(
        model, plan.parallel, mixed_dtype=mixed, dry_stand_in=ctx.dry_stand_in
    )
    ctx.parallel = parallel
    ctx.info["data_parallel"] = plan.parallel.engine
    return parallel


def _check(plan: Any) -> None:
    """What several processes cannot run yet (``Technique.check``)."""
    par = plan.parallel
    if par.expert > 1 and par.tensor > 1:
        raise ValueError(
            "parallel expert is not composed with tensor parallelism yet (memfit's tensor "
            "split does not know mixture-of-experts blocks); set tensor 1, or expert 1"
        )
    if par.expert > 1 and par.context > 1:
        raise ValueError(
            "parallel expert is not composed with context parallelism yet (the expert groups "
            "would have to be carved from data x context); set context 1, or expert 1"
        )
    if par.expert > 1 and par.pipeline > 1 and par.zero_stage:
        raise ValueError(
            "parallel expert under a pipeline runs with zero_stage 0 only (FSDP2 does not "
            "shard a stage's experts over their replicas yet); set zero_stage 0"
        )
    if par.expert > 1 and par.zero_stage == 1:
        raise ValueError(
            "parallel expert is not composed with zero_stage 1 (ZeroRedundancyOptimizer "
            "partitions every rank's parameters as if they were the same, and expert ranks "
            "hold different experts); use zero_stage 0, 2 or 3"
        )
    if par.world_size == 1 and par.zero_stage == 0:
        return
    if plan.precision.mode == "bf16-pure":
        raise ValueError(
            "bf16-pure cannot be combined with data parallelism yet: its fp32 step swaps "
            "each parameter's dtype, which drops DDP's gradient hooks and mixes dtypes in "
            "FSDP2's shards; use bf16-mixed"
        )


#: Data parallelism and ZeRO (DDP, ZeroRedundancyOptimizer, FSDP2), after every single-device
#: technique (FSDP2 shards the checkpointed blocks in place) and before the optimizer, which
#: steps FSDP2's shards or is sharded by ZeRO stage 1.
TECHNIQUE = Technique(
    name="data_parallel",
    engines=frozenset(ENGINES),
    plan_field="parallel",
    order=110,
    is_on=lambda plan: (plan.parallel.data > 1 or bool(plan.parallel.zero_stage))
    and not plan.parallel.splits_model,
    apply=_apply_technique,
    info_key="data_parallel",
    check=_check,
)
