"""4-D parallelism: tensor x pipeline x data x context parallelism composed at run time,
:func:`build_layout`.

Every rank of a world of ``pipeline x data x context x tensor`` processes calls
:func:`build_layout` with the same model (same seed) and the same
:class:`~memfit.distributed.config.ParallelConfig`. The ranks form a
:class:`~torch.distributed.device_mesh.DeviceMesh` with dimensions ``("pp", "dp", "cp",
"tp")``, tensor parallelism innermost, so that a tensor-parallel group is consecutive ranks
(one node, the fast link its per-block all-reduces want), context parallelism next (its
per-block ring or all-to-all wants the node's links too)::

    rank = ((pp_index * data + dp_index) * context + cp_index) * tensor + tp_index

Each rank then holds:

* its pipeline stage(s) of the model, cut on the ``pp`` dimension's process group by
  :func:`~memfit.distributed.pipeline.build_pipeline` (a stage keeps the model's own module
  names);
* each stage split over the ``tp`` dimension by
  :func:`~memfit.distributed.tensor.apply_tensor_parallel` (the model's built-in plan, less
  the entries for modules the stage lacks; with ``sequence`` the stages pass their local
  sequence shards, :class:`~memfit.distributed.pipeline.StageModule`). The last stage's
  logits stay sharded over the
  vocabulary and the loss, and its backward, run under ``loss_parallel``: full-vocabulary
  logits never exist on one rank;
* with ``data > 1``, gradients reduced over the ``dp`` dimension by torch's data-parallel
  engines, which torch's pipeline schedules drive themselves (a reduction in the last
  micro-batch's backward only): ``zero_stage`` 0 wraps each stage in ``DistributedDataParallel``
  on ``mesh["dp"]``'s group, its gradients views of DDP's buckets, which live for the whole run
  (:mod:`memfit.distributed.replicas`; under tensor parallelism DDP takes the stage's local
  shards); 2 and 3 shard each stage with FSDP2 (``fully_shard`` on ``mesh["dp"]``, every block
  then the stage; gradient reduce-scatter after the last micro-batch's backward).

* with ``context > 1``, each sample's sequence cut over the ``cp`` dimension by
  :func:`~memfit.distributed.context.apply_context_parallel` (on each pipeline stage, whose
  first cuts the ids and every one places its chunk's positions; the stages pass the chunk's
  tokens, and the ring runs within each stage's context group): the rank runs its chunk, the
  attention exchanges keys and values (ring) or re-splits by heads (all-to-all), and the
  gradients are averaged over ``dp x cp`` together (DDP's or FSDP2's group is ``dp`` and
  ``cp`` flattened), each context rank's loss being its share of the whole samples' mean.

With ``pipeline == 1`` the "stage" is the whole model and a step runs its ``microbatches``
(default 1) as gradient accumulation; with ``tensor == 1`` nothing is split by tensor.

:func:`check_layout` refuses, before any process group work, settings that cannot work, one
sentence each naming what would. :func:`memfit.estimate.layout.predict_layout` predicts every
rank's peak without launching.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MemfitError
from ..stepping import BaseStepper
from ..workload import Batch
from .config import PIPEDREAM_SCHEDULES, ParallelConfig
from .context import ContextParallel, apply_context_parallel, check_context_parallel
from .pipeline import (
    Pipeline,
    PipelineConfig,
    StageModule,
    build_pipeline,
    causal_lm_loss,
    model_blocks,
    run_pipeline_step,
)
from .replicas import LocalShards, Replicas, replicate
from .tensor import (
    TensorParallel,
    TensorParallelConfig,
    apply_tensor_parallel,
    check_tensor_parallel,
    shifted_cross_entropy,
    supported_models,
)

__all__ = [
    "MESH_DIMS",
    "Layout",
    "LayoutError",
    "LayoutStepper",
    "build_layout",
    "check_layout",
    "data_groups",
    "layout_coords",
    "layout_microbatches",
    "mesh_shape",
    "pipeline_config",
]

#: The device mesh's dimension names, outermost first.
MESH_DIMS = ("pp", "dp", "cp", "tp")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LayoutError(MemfitError, ValueError):
    """A parallel layout that cannot work; the message says what would."""


# --------------------------------------------------------------------------- arithmetic
def layout_coords(rank: int, parallel: ParallelConfig) -> dict[str, int]:
    """Where ``rank`` sits in the ``("pp", "dp", "cp", "tp")`` mesh: its pipeline stage index
    (rank in the pipeline), data-parallel replica, context chunk and tensor-parallel rank.

    ``rank = ((pp * data + dp) * context + cp) * tensor + tp``, tensor parallelism innermost.
    """
    where = parallel.coordinates(rank)
    return {"pp": where["stage"], "dp": where["replica"], "cp": where["chunk"],
            "tp": where["shard"]}


def mesh_shape(parallel: ParallelConfig) -> tuple[int, int, int, int]:
    """The device mesh's shape, in :data:`MESH_DIMS` order."""
    return parallel.pipeline, parallel.data, parallel.context, parallel.tensor


def replica_mesh(mesh: Any, parallel: ParallelConfig) -> Any:
    """The one-dimensional mesh of the ranks that average their gradients: ``dp``, or ``dp``
    and ``cp`` flattened into one (torchtitan's ``dp_shard_cp``) with context parallelism."""
    if parallel.context == 1:
        return mesh["dp"]
    # DeviceMesh has no public flatten in torch 2.13; _flatten is what torchtitan uses.
    return mesh["dp", "cp"]._flatten("dp_cp")


def layout_microbatches(parallel: ParallelConfig) -> int:
    """Micro-batches per step: the pipeline's (default ``2 x pipeline``) or, without a
    pipeline, the gradient-accumulation count (default 1)."""
    if parallel.pipeline > 1:
        return pipeline_config(parallel).num_microbatches
    return parallel.microbatches or 1


def pipeline_config(parallel: ParallelConfig, cuts: tuple[int, ...] | None = None) -> PipelineConfig:
    """The :class:`~memfit.distributed.pipeline.PipelineConfig` of ``parallel`` (its
    ``pipeline`` degree, ``schedule`` and ``microbatches``; ``cuts`` when given, else the
    plan's ``parallel.cuts``, else an even split)."""
    if cuts is None and parallel.cuts:
        cuts = tuple(parallel.cuts)
    return PipelineConfig(parallel.pipeline, parallel.schedule, parallel.microbatches, cuts,
                          vertical_sync=parallel.vertical_sync)


def check_layout(
    model: nn.Module,
    parallel: ParallelConfig,
    *,
    batch_size: int | None = None,
    world_size: int | None = None,
    num_blocks: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Refuse a layout that cannot work, before any process group is touched.

    Checks, one sentence each naming what would work: the settings themselves; the degrees'
    product against the world; the heads, key-value heads, MLP width and vocabulary against the
    tensor degree (:func:`~memfit.distributed.tensor.check_tensor_parallel`); the blocks
    against the pipeline stages and the micro-batches against the schedule
    (:meth:`~memfit.distributed.pipeline.PipelineConfig.problems`); the batch against ``data x
    microbatches``; ZeRO stage 1, which memfit does not compose with the other dimensions;
    context parallelism against the sequence and (all-to-all) the heads
    (:func:`~memfit.distributed.context.check_context_parallel`).

    Args:
        model: The whole model (a Hugging Face Llama or GPT-2 causal LM for tensor or pipeline
            parallelism; any model for data parallelism alone), or only its HF config with
            ``num_blocks`` given.
        parallel: The degrees and their settings.
        batch_size: The global batch (samples per step over all replicas), when known.
        world_size: The processes launched, when known (default: the process group's, if one
            is open).
        num_blocks: The model's block count, when ``model`` is only its HF config (a
            prediction that builds no whole model).
        seq_len: Tokens per sample, when known: context parallelism must divide it.

    Raises:
        LayoutError: naming every problem found.
    """
    problems = list(parallel.problems())
    if problems:
        raise LayoutError("; ".join(problems))
    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    d, t, p, c = parallel.data, parallel.tensor, parallel.pipeline, parallel.context
    if world_size is not None and world_size != parallel.world_size:
        problems.append(
            f"the layout data {d} x tensor {t} x pipeline {p} x context {c} needs "
            f"{parallel.world_size} processes but {world_size} were launched; choose degrees "
            f"whose product is {world_size}")
    if parallel.zero_stage == 1:
        problems.append(
            "zero_stage 1 (ZeroRedundancyOptimizer) is not composed with tensor or pipeline "
            "parallelism; use zero_stage 0 (gradients all-reduced by DDP) or 2 or 3 (FSDP2)")
    if parallel.sequence and p > 1 and seq_len is not None and seq_len % t:
        problems.append(
            f"with sequence parallelism under a pipeline the stages pass sequence / tensor "
            f"tokens each, so the sequence of {seq_len} must be a multiple of tensor {t}; use "
            f"a sequence length divisible by {t}")
    if c > 1:
        problems.extend(check_context_parallel(model, c, parallel.context_mode, tensor=t,
                                               seq_len=seq_len))
    if t > 1:
        known = (*supported_models(), "LlamaConfig", "GPT2Config")
        if type(model).__name__ not in known and not isinstance(model, StageModule):
            problems.append(
                f"memfit has no tensor-parallel plan for {type(model).__name__}; tensor "
                f"parallelism in a layout takes {', '.join(supported_models())}")
        else:
            try:
                check_tensor_parallel(model, t)
            except ValueError as e:
                problems.append(str(e).rstrip("."))
    if p > 1:
        if num_blocks is None:
            try:
                num_blocks = len(model_blocks(model))
            except ValueError as e:
                problems.append(str(e).rstrip("."))
        if num_blocks is not None:
            problems.extend(pipeline_config(parallel).problems(num_blocks))
        config = getattr(model, "hf_config", None) or getattr(model, "config", model)
        if parallel.schedule in PIPEDREAM_SCHEDULES and getattr(
                config, "tie_word_embeddings", False):
            problems.append(
                f"the {parallel.schedule} schedule updates each stage's weights on its own, so "
                "the embedding tied to the head (on the first and last stages) would drift "
                "apart; use a model with tie_word_embeddings false (llama-tiny) or a "
                "synchronous schedule such as 1f1b")
    if batch_size is not None:
        m = layout_microbatches(parallel) if not problems else (parallel.microbatches or 1)
        per = d * m
        if batch_size % per or batch_size < per:
            problems.append(
                f"a batch of {batch_size} does not split into data {d} x microbatches {m} = "
                f"{per} equal micro-batches; use a batch that is a multiple of {per}, or "
                f"degrees and micro-batches whose product divides {batch_size}")
    if problems:
        raise LayoutError("; ".join(problems))


# --------------------------------------------------------------------------- the layout
@dataclass
class Layout:
    """This rank's share of a 3-D layout, and how to train it.

    Attributes:
        parallel: The settings.
        mesh: The ``("pp", "dp", "tp")`` device mesh of the whole world.
        coords: This rank's place in it (:func:`layout_coords`).
        modules: The modules this rank trains: its pipeline stage(s), or the whole model
            without a pipeline. Their parameters (DTensors under tensor parallelism or FSDP2)
            are :meth:`parameters`.
        pipeline: The pipeline (its schedule), ``None`` when ``parallel.pipeline == 1``.
        tensor: The tensor-parallel handle of each module (empty when ``tensor == 1``).
        loss_fn: ``loss_fn(output, labels)``, a mean over the micro-batch, on the last stage.
        replicas: With ``data x context > 1`` and ZeRO 0, each module under DDP
            (:class:`~memfit.distributed.replicas.Replicas`); ``None`` otherwise.
        context: The context-parallel handle (``None`` when ``context == 1``); under a
            pipeline, a list of one per stage.
    """

    parallel: ParallelConfig
    mesh: Any
    coords: dict[str, int]
    modules: list[nn.Module]
    pipeline: Pipeline | None
    tensor: list[TensorParallel] = field(default_factory=list)
    loss_fn: LossFn = causal_lm_loss
    replicas: Replicas | None = None
    context: ContextParallel | list[ContextParallel] | None = None
    #: With ``parallel.expert > 1``: each module's expert split (:mod:`.expert`).
    experts: list[Any] = field(default_factory=list)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step (:func:`layout_microbatches`)."""
        return layout_microbatches(self.parallel)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once: what its optimizer steps (under DDP with tensor
        parallelism, the local shards DDP reduces, which share the DTensors' storage)."""
        if self.replicas is not None:
            return self.replicas.parameters()
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    @property
    def steps_optimizer(self) -> bool:
        """Whether the schedule steps the optimizer itself, inside :meth:`step` (the
        asynchronous PipeDream schedules: :mod:`memfit.distributed.pipedream`)."""
        return self.pipeline is not None and hasattr(self.pipeline.schedule, "optimizer")

    def attach_optimizer(self, optimizer: Any) -> None:
        """Give a schedule that steps the optimizer itself (:attr:`steps_optimizer`) the
        optimizer over :meth:`parameters`; a no-op for the others."""
        if self.steps_optimizer:
            self.pipeline.schedule.optimizer = optimizer

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """``loss_parallel()`` when the logits are vocabulary-sharded (tensor > 1), else a no-op:
        the loss and its backward run inside it."""
        if self.parallel.tensor > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One training step's forwards and backwards: gradients in ``.grad``, reduced over
        the data-parallel replicas. Zero the gradients before, step the optimizer after.
        Under a PipeDream schedule (:attr:`steps_optimizer`) the step also updates the
        weights, with the optimizer given to :meth:`attach_optimizer`; no gradients are
        left in ``.grad``.

        Args:
            inputs: This replica's batch of input ids (``global batch / data`` samples; the
                same on every rank of the replica). Ranks without the first stage ignore it.
            labels: Its labels (usually the input ids; ``-100`` marks tokens that do not
                count). Ranks without the last stage ignore them.

        Returns:
            The step's loss (mean over micro-batches and replicas), on every rank.
        """
        m = self.microbatches
        if inputs.shape[0] % m or inputs.shape[0] < m:
            raise LayoutError(
                f"a replica's batch of {inputs.shape[0]} does not split into {m} equal "
                f"micro-batches; give each replica a multiple of {m} samples")
        if self.replicas is not None:
            self.replicas.before_step()
        with self.loss_context():
            if self.pipeline is not None:
                loss = run_pipeline_step(self.pipeline, inputs, labels)
            else:
                loss = self._accumulate(inputs, labels, m)
        if self.replicas is not None:
            self.replicas.after_step()
        for split in self.experts:  # each expert's gradient over its replicas only
            split.sync()
        if self.parallel.replicas > 1:
            loss = self._mean_over_replicas(loss)
        return loss

    def _accumulate(self, inputs: torch.Tensor, labels: torch.Tensor, m: int) -> torch.Tensor:
        """Gradient accumulation over ``m`` micro-batches; under DDP only the last one's
        backward reduces the (accumulated) gradients."""
        replicas = self.replicas
        model = replicas.ddps[0] if replicas is not None else self.modules[0]
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(m), labels.chunk(m), strict=True)):
            hold = replicas.no_sync() if replicas is not None and i < m - 1 else None
            with hold or contextlib.nullcontext():
                out = model(x)  # DDP decides in its forward whether this backward reduces
                loss = self.loss_fn(getattr(out, "logits", out), y) / m
                loss.backward()
            loss = loss.detach()
            total = total + (loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        return total

    def _mean_over_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        """The reported loss averaged over the data-parallel replicas (one scalar: a metric;
        the gradients were reduced by DDP or FSDP2 in backward)."""
        loss = loss.clone()
        # Data x context: each context rank's loss is its share of its samples' mean.
        dist.all_reduce(loss, group=replica_mesh(self.mesh, self.parallel).get_group())
        return loss / self.parallel.replicas

    def full_grads(self) -> dict[str, torch.Tensor]:
        """This rank's modules' gradients whole, under the model's parameter names (a
        collective over the tensor-parallel group: each of its ranks must call it). Copies:
        under DDP the gradients are its buckets, which the next step zeroes and refills."""
        out: dict[str, torch.Tensor] = {}
        for i, module in enumerate(self.modules):
            tied = getattr(module, "tied", {})
            shards = self.replicas.ddps[i].module if self.replicas is not None else None
            if self.tensor:
                named = shards.named_grads() if isinstance(shards, LocalShards) else None
                grads = self.tensor[i].full_grads(named)
            else:
                grads = {n: p.grad.detach() for n, p in module.named_parameters()
                         if p.grad is not None}
            for name, g in grads.items():
                if hasattr(g, "full_tensor"):  # FSDP2's shards over the data dimension
                    g = g.full_tensor()
                out[tied.get(name, name)] = g.clone() if self.replicas is not None else g
        return out


class LayoutStepper(BaseStepper):
    """The :class:`~memfit.stepping.Stepper` of a layout, for
    :func:`~memfit.apply.stepper.run_step`: this replica's share of the global batch, the
    step's forwards and backwards by :meth:`Layout.step` (the pipeline schedule, or gradient
    accumulation without one, under ``loss_parallel`` with tensor parallelism; gradients
    reduced over the data dimension), then the optimizer's step and ``zero_grad``.

    Args:
        layout: This rank's :class:`Layout`.
        optimizer: The optimizer over :meth:`Layout.parameters`.
        device: Where the batch goes (default: where the layout's parameters are).
    """

    #: The layout's schedule runs the forwards and backwards, and splits the micro-batches.
    owns_forward = True

    def __init__(self, layout: Layout, optimizer: Any, device: torch.device | None = None) -> None:
        self.layout = layout
        self.optimizer = optimizer
        layout.attach_optimizer(optimizer)
        if device is None:
            device = next((p.device for p in layout.parameters()), torch.device("cpu"))
        self.device = device

    def local_batch(self, batch: Batch) -> Batch:
        """This replica's share of the global ``batch`` (every rank of the replica trains on
        the same one), as ``{"input_ids", "labels"}`` on the device; the labels are the input
        ids when the batch has none. Inside
        :func:`~memfit.distributed.data.batches_are_local` the batch is the share already."""
        from .data import batches_local, local_batch

        share = batch
        if not batches_local():
            share = local_batch(batch, self.layout.coords["dp"], self.layout.parallel.data)
        if isinstance(share, torch.Tensor):
            ids = labels = share
        else:
            ids = share["input_ids"]
            labels = share.get("labels", ids)
        return {"input_ids": ids.to(self.device), "labels": labels.to(self.device)}

    def forward_backward(self, batch: Batch, *, autocast: Callable[[], Any]) -> torch.Tensor:
        """:meth:`Layout.step` on the share, under ``autocast`` (the whole schedule: its
        forwards and backwards interleave); returns the step's loss, averaged over the
        micro-batches and replicas, on every rank."""
        with autocast():
            return self.layout.step(batch["input_ids"], batch["labels"]).detach()

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Not used: :meth:`forward_backward` runs the backwards."""
        raise RuntimeError("a layout's schedule runs its own backwards; use run_step")

    def step(self) -> None:
        if not self.layout.steps_optimizer:  # PipeDream stepped it inside the schedule
            self.optimizer.step()

    def zero_grad(self) -> None:
        # Under DDP the gradients are views of its buckets, live for the whole run: zeroed in
        # place they stay views (dropping them frees nothing, and Layout.step would re-attach).
        self.optimizer.zero_grad(set_to_none=self.layout.replicas is None)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


def _make_mesh(parallel: ParallelConfig, device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, mesh_shape(parallel), mesh_dim_names=MESH_DIMS)


def build_layout(
    model: nn.Module,
    parallel: ParallelConfig,
    *,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    cuts: tuple[int, ...] | None = None,
) -> Layout:
    """Build this rank's share of ``model`` under a tensor x pipeline x data x context layout.

    Every rank of the default process group (``parallel.world_size`` of them) calls this with
    the same model (same weights: seed alike) and settings. Create the optimizer afterwards over
    :meth:`Layout.parameters`, then per step: zero the gradients, :meth:`Layout.step`, step
    the optimizer (or :func:`~memfit.apply.stepper.run_step` with a :class:`LayoutStepper`,
    which does all three). Drop ``model`` afterwards: a rank keeps only its stages' modules.

    Memory per rank: its stages' parameters, gradients and optimizer state, divided by
    ``tensor`` (the blocks, embedding and head; norms are replicated) and, under ZeRO 2/3, by
    ``data``; plus the activations of the micro-batches its schedule keeps in flight
    (:func:`~memfit.distributed.pipeline.microbatches_in_flight`), divided by ``tensor`` for the
    attention and MLP, and the last stage's logits at ``vocab / tensor`` per token, of
    ``seq_len / context`` tokens (:mod:`memfit.distributed.context`).
    :func:`memfit.estimate.layout.predict_layout` predicts it per rank.

    Args:
        model: A Hugging Face Llama-layout or GPT-2 causal LM (any model :func:`~memfit.
            distributed.pipeline.build_stage` can cut and :func:`~memfit.distributed.tensor.
            tp_plan_for` has a plan for; with ``tensor == 1`` an ``nn.Sequential`` works too).
        parallel: The degrees (``data x tensor x pipeline x context`` must be the world
            size), the pipeline ``schedule`` and ``microbatches``, the ZeRO stage (0, 2 or 3),
            the ``context_mode``.
        loss_fn: ``loss_fn(output, labels)`` on the last stage, a mean over the micro-batch.
            Default: the causal LM's shifted cross-entropy, computed on vocabulary-sharded
            logits when ``tensor > 1``. A custom one runs inside ``loss_parallel`` then, on
            logits that are a DTensor sharded on the last dimension. Unset with context.
        device: Where this rank computes (default: CPU with gloo; ``cuda:<local rank>`` on GPUs).
        batch_size: The global batch, to check it splits into ``data x microbatches``.
        cuts: The pipeline's cut points (default: ``parallel.cuts``, or an even split when
            that is empty; see :attr:`~memfit.distributed.pipeline.PipelineConfig.cuts`).

    Returns:
        This rank's :class:`Layout`.

    Raises:
        LayoutError: when the layout cannot work (see :func:`check_layout`), or when no
            process group is open.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise LayoutError(
            f"a layout of {parallel.world_size} processes needs a process group: launch with "
            f"`torchrun --nproc-per-node {parallel.world_size}` (or init_process_group first)")
    check_layout(model, parallel, batch_size=batch_size)
    if parallel.pipeline > 1 and cuts is not None:
        problems = pipeline_config(parallel, cuts).problems(len(model_blocks(model)))
        if problems:
            raise LayoutError("; ".join(problems))
    device = torch.device(device) if device is not None else torch.device("cpu")
    mesh = _make_mesh(parallel, device)
    coords = layout_coords(dist.get_rank(), parallel)
    loss_fn, context = _loss_and_context(model, parallel, mesh, loss_fn)
    handles: list[TensorParallel] = []
    shard_mesh = replica_mesh(mesh, parallel)  # dp, or dp and cp flattened
    ddps: list[nn.Module] = []
    experts: list[Any] = []

    def prepare(module: nn.Module) -> nn.Module | None:
        _split(module, parallel, mesh, device, handles, experts, context)
        if parallel.replicas == 1 or parallel.schedule in PIPEDREAM_SCHEDULES:
            return None  # PipeDream's updates average the gradients themselves (below)
        if parallel.sharded:
            _fully_shard(module, parallel, shard_mesh)
            return None
        ddp = replicate(module, shard_mesh.get_group(), bucket_bytes=parallel.bucket_bytes,
                        device=device)
        if parallel.pipeline > 1:
            # torch's pipeline stage arms DDP's reduction itself, before the last
            # micro-batch's backward, and runs every forward under no_sync. Its shape
            # inference at the first step runs one more forward, outside no_sync, and no
            # weight backward: that forward would arm the reduction for the first
            # micro-batch's backward instead. Never arming it in a forward fixes that.
            ddp.require_backward_grad_sync = False
        ddps.append(ddp)
        return ddp

    pipeline = None
    if parallel.pipeline > 1:
        pipeline = build_pipeline(model, pipeline_config(parallel, cuts), loss_fn=loss_fn,
                                  group=mesh["pp"].get_group(), device=device, prepare=prepare)
        modules: list[nn.Module] = list(pipeline.stages)
        _average_pipedream_updates(pipeline, parallel, shard_mesh)
    else:
        model.to(device)
        prepare(model)
        modules = [model]
    replicas = Replicas(ddps) if ddps else None
    if replicas is not None and pipeline is not None and parallel.tensor > 1:
        _tie_shards(pipeline, ddps)
    return Layout(parallel, mesh, coords, modules, pipeline, handles, loss_fn, replicas,
                  context, experts)


def _average_pipedream_updates(pipeline: Pipeline, parallel: ParallelConfig,
                               shard_mesh: Any) -> None:
    """With data replicas, a PipeDream stage averages each update's gradients over its
    replicas' group (:mod:`.pipedream`; no DDP: the updates happen inside the schedule)."""
    if parallel.schedule in PIPEDREAM_SCHEDULES and parallel.replicas > 1:
        pipeline.schedule.stage.replica_group = shard_mesh.get_group()


class _StageContexts(list):
    """The context-parallel handles of a rank's pipeline stages, one per stage."""


def _split(module: nn.Module, parallel: ParallelConfig, mesh: Any, device: torch.device,
           handles: list[TensorParallel], experts: list[Any], context: Any = None) -> None:
    """``module``'s chunk of each sample under a pipeline with context parallelism (into
    ``context``), its experts split over its expert ranks (into ``experts``), then its
    matrices over the tensor-parallel ranks (into ``handles``)."""
    if isinstance(context, _StageContexts):
        context.append(apply_context_parallel(module, mesh["cp"].get_group(),
                                              parallel.context_mode))
    if parallel.expert > 1:
        experts.append(_split_experts(module, parallel, device))
    if parallel.tensor > 1:
        config = TensorParallelConfig(parallel.tensor, sequence_parallel=parallel.sequence)
        handles.append(apply_tensor_parallel(module, config, mesh["tp"]))


def _split_experts(module: nn.Module, parallel: ParallelConfig, device: torch.device) -> Any:
    """``module``'s experts split over its data group's expert ranks (:mod:`.expert`), and
    left out of DDP: their replicas average them (``ExpertParallel.sync``, after the step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .expert import apply_expert_parallel

    split = apply_expert_parallel(module, parallel.expert, parallel.data, device.type,
                                  data_groups(parallel))
    DDP._set_params_and_buffers_to_ignore_for_model(module, list(split.parameters))
    return split


def data_groups(parallel: ParallelConfig) -> list[list[int]]:
    """Every data-parallel group's ranks (one per stage, context chunk and tensor shard)."""
    d, c, t = parallel.data, parallel.context, parallel.tensor
    return [[((s * d + r) * c + ch) * t + k for r in range(d)]
            for s in range(parallel.pipeline) for ch in range(c) for k in range(t)]


def _loss_and_context(model: nn.Module, parallel: ParallelConfig, mesh: Any,
                      loss_fn: LossFn | None) -> tuple[LossFn, ContextParallel | None]:
    """The last stage's loss, and with ``context > 1`` the model cut into this rank's chunk
    (its loss the chunk's share of the whole samples' mean)."""
    if parallel.context == 1:
        if loss_fn is None:
            loss_fn = shifted_cross_entropy if parallel.tensor > 1 else causal_lm_loss
        return loss_fn, None
    if loss_fn is not None:
        raise LayoutError(
            "with context parallelism the loss is each chunk's share of the whole samples' "
            "causal LM loss (ContextParallel.loss); leave loss_fn unset")
    if parallel.pipeline == 1:
        context = apply_context_parallel(model, mesh["cp"].get_group(), parallel.context_mode)
        return context.loss, context
    # Under a pipeline each stage is prepared on its own (_split); the loss is the last
    # stage's handle's (every handle computes it alike: the group's share of the mean).
    stages = _StageContexts()
    return (lambda logits, labels: stages[-1].loss(logits, labels)), stages


def _tie_shards(pipeline: Pipeline, ddps: list[nn.Module]) -> None:
    """Under DDP with tensor parallelism the gradients are the local shards': sum a tied
    weight's copies across stages there (the stages' DTensor parameters get none)."""
    shard: dict[int, nn.Parameter] = {}
    for ddp in ddps:
        if isinstance(ddp.module, LocalShards):
            shard.update(ddp.module.shard_of())
    pipeline.ties = [([shard.get(id(p), p) for p in params], group)
                     for params, group in pipeline.ties]


def _fully_shard(module: nn.Module, parallel: ParallelConfig, dp_mesh: Any) -> None:
    """FSDP2 over the data dimension: every block, then the module (ZeRO 2 keeps a block's
    gathered parameters until its backward, ZeRO 3 frees them after its forward, as
    ``reshard_after_forward`` says)."""
    from torch.distributed.fsdp import fully_shard

    from .data import _report_fsdp_resizes

    _report_fsdp_resizes()  # FSDP2 frees and re-gathers by resizing storages: tell the tracker
    reshard = parallel.zero_stage == 3 and parallel.reshard_after_forward
    blocks = module.blocks() if isinstance(module, StageModule) else [
        b for _, b in _blocks_or_empty(module)]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)


def _blocks_or_empty(model: nn.Module) -> list[tuple[str, nn.Module]]:
    try:
        return model_blocks(model)
    except ValueError:
        return []
