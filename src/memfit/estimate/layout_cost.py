"""How the 3-D planner prices a layout: each rank's peak and the step time.

How a layout is priced, per rank:

* **Memory.** One micro-batch through a one-block model of the rank's *local* shapes (for the
  Llama layout: the heads, key-value heads, MLP width and vocabulary divided by the tensor
  degree, exactly the per-rank matrices of Megatron's split) is dry-run on fake tensors
  (:func:`memfit.estimate.pipeline.profile_blocks`): the bytes a block's forward keeps for
  backward, the embeddings' and the head's with the loss, the parameters and the FLOPs, at the
  target's kernels. A stage's ranks then hold their parameters, gradients and optimizer state
  for the whole step (sharded over ``data`` by the ZeRO stage: :func:`~memfit.estimate.
  distributed.zero_model_state_bytes`; at ZeRO 0 the gradients are DDP's buckets, live from
  the run's start, :mod:`memfit.distributed.replicas`), the activations of the micro-batches the schedule keeps in flight
  (:func:`~memfit.distributed.pipeline_plan.microbatches_in_flight`; with checkpointing only
  each block's input), and one block's backward working set; under a pipeline also torch's
  receive buffers (a block input per micro-batch and direction) and each non-last stage's
  output, kept until its micro-batch's backward. Sequence parallelism divides a checkpointed
  block's input, the norms' saved tensors (measured on the model's own norm), the stage
  outputs and the receive buffers by the tensor degree (the stages pass their local shards).
* **Time.** A :class:`~memfit.estimate.cost.StepCost`, as every plan's: the stage's FLOPs at
  the device's rate (its efficiency falls for small micro-batches), the pipeline's bubble
  (:func:`~memfit.estimate.cost.bubble_fraction`: ``(p - 1) / M`` of the compute, less for
  interleaved and zero-bubble schedules), and the communication (:func:`~memfit.estimate.
  cost.communication`): tensor parallelism's all-reduces, the activations between stages,
  and the gradient reduction backward does not hide (stage 3 gathers parameters twice more).
* **Context parallelism.** A context rank is profiled at ``seq_len / context`` tokens (its
  chunk's activations, logits and FLOPs), its model states are sharded over ``data x
  context`` under ZeRO 2/3, its backward's working set adds the attention's buffers (the
  ring's keys, values and their gradients in flight, or all-to-all's re-split copies), the
  last chunk's compute adds its attention to every earlier chunk (contiguous chunks under
  the causal mask), and the communication adds the ring's hops or the all-to-alls.
* **Partitioned checkpoints** (``parallel.partition_activations``, ZeRO-R): each checkpointed
  block input at ``1/tensor`` per rank (none on the device with ``partition_offload``), one
  block's input whole again during its recomputation, and one all-gather of each block's
  input per micro-batch's backward over the tensor group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..distributed.config import ParallelConfig
from ..optim.registry import get as optimizer_spec
from ..workload import Workload, WorkloadError
from .cost import StepCost, bubble_fraction, communication
from .pipeline_terms import gradient_buffer_bytes as grad_buffer
from .pipeline_terms import norm_kept_bytes, receive_buffer_bytes, stage_outputs_kept

if TYPE_CHECKING:
    from ..optim.config import OptimizerConfig

__all__ = [
    "LayoutCandidate",
    "ModelShape",
    "balanced_cuts",
    "estimate_layout",
    "layout_problems",
    "model_shape",
    "rank_coordinates",
]

@dataclass(frozen=True)
class ModelShape:
    """The sizes a layout must divide, read from the model's config.

    Attributes:
        family: ``llama`` (Llama, Mistral, Qwen2 layout), ``gpt2``, or another HF model type.
        layers: Transformer blocks.
        hidden: Hidden width.
        heads: Attention heads.
        kv_heads: Key-value heads.
        mlp: MLP width.
        vocab: Vocabulary rows.
        config: The HF config itself.
        experts: Routed experts per mixture-of-experts block (0: a dense model).
        top_k: Experts each token is routed to.
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    config: Any = dataclasses.field(compare=False, repr=False)
    experts: int = 0
    top_k: int = 0

    @property
    def expert_block_params(self) -> int:
        """Elements of one block's experts (Mixtral's: ``gate_up_proj`` and ``down_proj``,
        ``3 x hidden x mlp`` each); 0 for a dense model."""
        return self.experts * 3 * self.hidden * self.mlp


def model_shape(workload: Workload) -> ModelShape:
    """The shapes of ``workload``'s model, from a one-block copy built on the meta device.

    Raises:
        WorkloadError: for a model that is not a Hugging Face transformer with a depth.
    """
    import torch

    if workload.with_depth is None or workload.depth is None:
        raise WorkloadError(
            f"the 3-D planner splits transformer blocks, and {workload.name!r} is not a "
            "Hugging Face transformer with a known depth; use a preset or a config "
            "(--world-size without --gpus-per-node plans data parallelism for any model)"
        )
    with torch.device("meta"):
        model = workload.with_depth(1).build_model()
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise WorkloadError(f"{workload.name!r} has no Hugging Face config to read shapes from")
    from ..distributed.tensor import _split_sizes

    sizes = _split_sizes(cfg)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    model_type = str(getattr(cfg, "model_type", ""))
    family = "llama" if model_type in ("llama", "mistral", "qwen2") else model_type
    if family not in ("llama", "gpt2", "mixtral"):
        raise WorkloadError(
            f"the 3-D planner splits causal LMs of the Llama, Mixtral and GPT-2 layouts, not "
            f"{workload.name!r} ({model_type}); plan data parallelism for it with --world-size "
            "alone"
        )
    return ModelShape(
        family=family,
        layers=int(workload.depth),
        hidden=int(hidden),
        heads=sizes["attention heads"],
        kv_heads=sizes.get("key-value heads", sizes["attention heads"]),
        mlp=sizes.get("MLP width", 4 * int(hidden)),
        vocab=int(cfg.vocab_size),
        config=cfg,
        experts=int(getattr(cfg, "num_local_experts", 0) or 0) if family == "mixtral" else 0,
        top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if family == "mixtral" else 0,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problems(shape: ModelShape, parallel: ParallelConfig, batch_size: int,
                    gpus_per_node: int | None = None, *, seq_len: int | None = None) -> list[str]:
    """What stops ``parallel`` from training ``shape`` at ``batch_size``, one sentence each
    naming what would work (empty when it can run).

    Checks: tensor parallelism within a node and dividing the heads, key-value heads and MLP
    width; the pipeline's stages no more than the blocks (the plan's cuts fitting them); the batch
    split evenly over the replicas and the micro-batches; the schedule's micro-batch count;
    context parallelism dividing the sequence (and, all-to-all, each tensor rank's heads).
    """
    from ..distributed.context import check_context_parallel
    from ..distributed.pipeline_plan import PipelineConfig

    out: list[str] = []
    t, p, d, c = parallel.tensor, parallel.pipeline, parallel.data, parallel.context
    if c > 1 and not shape.heads % t:
        out.extend(check_context_parallel(shape.config, c, parallel.context_mode, tensor=t,
                                          seq_len=seq_len))
    if gpus_per_node is not None and t > gpus_per_node:
        out.append(
            f"tensor parallelism of {t} does not fit in a node of {gpus_per_node} devices "
            f"(its all-reduces need the node's links); use tensor <= {gpus_per_node}"
        )
    sizes = {"attention heads": shape.heads, "key-value heads": shape.kv_heads,
             "MLP width": shape.mlp}
    bad = [f"the {v} {k}" for k, v in sizes.items() if v % t]
    if bad:
        works = [x for x in _divisors(min(sizes.values())) if all(v % x == 0 for v in sizes.values())]
        out.append(
            f"tensor parallelism of {t} does not divide {' and '.join(bad)}; use tensor "
            f"{', '.join(map(str, works))}"
        )
    if p > 1:
        # The stages need not divide the layers: the cuts (even, or the plan's) say who holds
        # which; a stage must hold one at least.
        cfg = PipelineConfig(p, parallel.schedule, _microbatches(parallel),
                             tuple(parallel.cuts) or None)
        out.extend(cfg.problems(shape.layers))
    out.extend(_expert_problems(shape, parallel))
    m = _microbatches(parallel)
    if batch_size % (d * m):
        out.append(
            f"a batch of {batch_size} samples does not split into {d} replicas x {m} "
            f"micro-batches; use a batch size that is a multiple of {d * m}"
        )
    return out


def _expert_problems(shape: ModelShape, parallel: ParallelConfig) -> list[str]:
    """What stops a mixture-of-experts model's layout, or an expert degree, from running."""
    t, p, e = parallel.tensor, parallel.pipeline, parallel.expert
    out = []
    if shape.experts and t > 1:
        out.append(
            "memfit's tensor parallelism does not split mixture-of-experts blocks yet; use "
            "tensor 1 (expert parallelism splits the experts)")
    if e > 1:
        if not shape.experts:
            out.append(f"parallel expert {e} needs a mixture-of-experts model; use expert 1")
        elif shape.experts % e:
            works = [x for x in _divisors(shape.experts) if parallel.data % x == 0]
            out.append(f"parallel expert {e} does not divide the {shape.experts} experts; use "
                       f"expert {', '.join(map(str, works))}")
        if parallel.data % e:
            out.append(f"parallel expert {e} must divide data {parallel.data}")
        if t > 1:
            out.append("parallel expert is not composed with tensor parallelism yet; use "
                       "tensor 1 with it")
        if parallel.context > 1:
            out.append("parallel expert is not composed with context parallelism yet; use "
                       "context 1 with it")
        if p > 1 and parallel.zero_stage:
            out.append("parallel expert under a pipeline runs with zero_stage 0 only")
        if parallel.zero_stage == 1:
            out.append("parallel expert is not composed with zero_stage 1; use 0, 2 or 3")
    return out


def _microbatches(parallel: ParallelConfig) -> int:
    if parallel.microbatches is not None:
        return parallel.microbatches
    return 2 * parallel.pipeline if parallel.pipeline > 1 else 1


# ------------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class _Profile:
    """One tensor-parallel rank's shapes, per sample of a micro-batch and per micro-batch.

    What a forward keeps for backward is ``*_acts`` per sample plus ``*_fixed`` per
    micro-batch, whatever its samples: autocast's half-precision copies of the weights, which
    each forward makes and saves once (measured as the difference of a one- and a two-sample
    forward: counting them per sample put 4 copies of every weight in a 4-sample micro-batch).
    """

    block_params: int  # elements
    first_params: int
    last_params: int
    block_acts: int  # bytes kept for backward by one block, per sample
    first_acts: int
    last_acts: int
    block_flops: float  # forward + backward, per sample
    first_flops: float
    last_flops: float
    block_fixed: int = 0  # bytes kept for backward by one block's forward, per micro-batch
    first_fixed: int = 0
    last_fixed: int = 0
    norm_acts: int = 0  # bytes one norm keeps for backward, per sample (its input, output)

    def kept(self, part: str, samples: int) -> int:
        """Bytes ``part`` (``block``, ``first``, ``last``) keeps for a micro-batch of
        ``samples``."""
        return getattr(self, f"{part}_fixed") + getattr(self, f"{part}_acts") * samples


def _local_config(shape: ModelShape, tensor: int) -> Any:
    """The HF config whose one block holds one tensor-parallel rank's matrices (Llama
    layout; other models keep their shapes and are scaled in :func:`_scale_other`)."""
    cfg = shape.config
    if shape.family != "llama" or tensor == 1:
        return cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": 1})
    head_dim = getattr(cfg, "head_dim", None) or shape.hidden // shape.heads
    return cfg.__class__(**{
        **cfg.to_dict(),
        "num_hidden_layers": 1,
        "num_attention_heads": shape.heads // tensor,
        "num_key_value_heads": shape.kv_heads // tensor,
        "intermediate_size": shape.mlp // tensor,
        "vocab_size": -(-shape.vocab // tensor),
        "head_dim": head_dim,
        "tie_word_embeddings": False,
    })


@functools.lru_cache(maxsize=64)
def _profile(shape: ModelShape, tensor: int, seq_len: int, dtype: str, device: str) -> _Profile:
    """Dry-run one sample through a one-block model of one rank's shapes (fake tensors; the
    weights are never written, so they take address space, not memory)."""
    import torch

    from ..targets import emulate, get_device
    from ..workload import _hf_model_from_config_impl
    from .pipeline import profile_blocks

    cfg = _local_config(shape, tensor)
    with torch.device("meta"):
        model = _hf_model_from_config_impl(cfg, None)
    model = model.to_empty(device="cpu")
    runs = []
    for samples in (1, 2):
        ids = torch.zeros(samples, seq_len, dtype=torch.long)
        autocast = (
            torch.autocast("cpu", dtype=getattr(torch, dtype))
            if dtype in ("bfloat16", "float16")
            else contextlib.nullcontext()
        )
        with emulate(get_device(device)), autocast:
            runs.append(profile_blocks(model, ids, ids))
    one, two = runs

    def per_sample(part: str) -> int:  # what a second sample adds
        a = getattr(two, part) if part != "block" else two.blocks[0]
        b = getattr(one, part) if part != "block" else one.blocks[0]
        return a.activation_bytes - b.activation_bytes

    def fixed(part: str) -> int:  # what the first sample keeps beyond that
        b = getattr(one, part) if part != "block" else one.blocks[0]
        return max(0, b.activation_bytes - per_sample(part))

    block = one.blocks[0]
    norm = norm_kept_bytes(model, seq_len, dtype)
    out = _Profile(
        block_params=block.state_bytes // 4,
        first_params=one.first.state_bytes // 4,
        last_params=one.last.state_bytes // 4,
        block_acts=per_sample("block"),
        first_acts=per_sample("first"),
        last_acts=per_sample("last"),
        block_flops=block.compute,
        first_flops=one.first.compute,
        last_flops=one.last.compute,
        block_fixed=fixed("block"),
        first_fixed=fixed("first"),
        last_fixed=fixed("last"),
        norm_acts=norm,
    )
    if shape.family != "llama" and tensor > 1:
        out = _scale_other(out, tensor)
    return out


def _scale_other(prof: _Profile, t: int) -> _Profile:
    """Another model's rank under Megatron's split, from its unsplit profile: the block's
    matrices, FLOPs, head and embeddings divided by ``t``; of its activations, the share
    inside attention and the MLP (24 of Korthikanti et al.'s 34 per token and width)."""
    return dataclasses.replace(
        prof,
        block_params=prof.block_params // t,
        first_params=prof.first_params // t,
        last_params=prof.last_params // t,
        block_acts=round(prof.block_acts * (10 + 24 / t) / 34),
        last_acts=prof.last_acts // t,
        block_fixed=prof.block_fixed // t,  # weight copies, split like the weights
        last_fixed=prof.last_fixed // t,
        block_flops=prof.block_flops / t,
        first_flops=prof.first_flops / t,
        last_flops=prof.last_flops / t,
    )


# ------------------------------------------------------------------------------ estimating
@dataclass
class LayoutCandidate:
    """One layout with its settings, priced.

    Attributes:
        parallel: The degrees, ZeRO stage, schedule and micro-batches.
        checkpointing: Whether every block is checkpointed.
        rank_peak_bytes: Predicted peak per rank, in rank order.
        step_seconds: Predicted seconds per step.
        parts: The step's seconds by part (``compute``, ``bubble``, ``tensor``, ``pipeline``,
            ``data``, ``context``).
        fits: Whether every rank fits the budget.
        microbatches: Micro-batches per step (the pipeline's, or accumulation's).
        by_category: The largest rank's peak by category.
        stages: Each pipeline stage's ranks' peak by category.
        stage_busy_seconds: Each stage's compute seconds per step (the rest of the step it
            waits: the bubble, and the slowest stage).
    """

    parallel: ParallelConfig
    checkpointing: bool
    rank_peak_bytes: list[int]
    step_seconds: float
    parts: dict[str, float]
    fits: bool = False
    microbatches: int = 1
    by_category: dict[str, int] = dataclasses.field(default_factory=dict)
    stages: list[dict[str, int]] = dataclasses.field(default_factory=list)
    stage_busy_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def max_peak_bytes(self) -> int:
        """The largest rank's peak."""
        return max(self.rank_peak_bytes)

    def settings(self) -> str:
        """The settings besides the degrees, in short."""
        par = self.parallel
        bits = []
        if par.pipeline > 1:
            bits.append(f"{par.schedule} x{self.microbatches}")
        elif self.microbatches > 1:
            bits.append(f"accumulation {self.microbatches}")
        if par.expert > 1:
            bits.append(f"expert {par.expert}")
        if par.replicas > 1:
            bits.append(f"ZeRO {par.zero_stage}")
        if self.checkpointing:
            bits.append("checkpointing, partitioned" + (" to host" if par.partition_offload
                                                        else "")
                        if par.partition_activations else "checkpointing")
        return ", ".join(bits)

    def describe(self) -> str:
        """The layout in words."""
        par = self.parallel
        degrees = f"data {par.data}, tensor {par.tensor}, pipeline {par.pipeline}"
        if par.context > 1:
            degrees += f", context {par.context} ({par.context_mode})"
        rest = self.settings().replace(f" x{self.microbatches}", f" x {self.microbatches} micro-batches")
        return degrees + (", " + rest if rest else "")


def rank_coordinates(rank: int, parallel: ParallelConfig) -> dict[str, int]:
    """Where ``rank`` sits: :meth:`ParallelConfig.coordinates`."""
    return parallel.coordinates(rank)


def _state_bytes(optimizer: OptimizerConfig | str) -> float:
    """Optimizer state bytes per parameter (the registry's; a name: its default settings)."""
    if isinstance(optimizer, str):
        return optimizer_spec(optimizer).bytes_per_parameter()
    return optimizer_spec(optimizer.name).bytes_per_parameter(optimizer.kwargs)


def _rank_peaks(parallel: ParallelConfig, peaks_by_stage: list[int]) -> list[int]:
    """Every rank's peak: its stage's (all replicas and tensor shards of a stage alike)."""
    return [peaks_by_stage[parallel.coordinates(r)["stage"]]
            for r in range(parallel.world_size)]


def estimate_layout(shape: ModelShape, parallel: ParallelConfig, *, batch_size: int,
                    seq_len: int, checkpointing: bool, device: Any, precision: str,
                    optimizer: OptimizerConfig | str, gpus_per_node: int,
                    microbatches: int | None = None,
                    expert_load: float = 1.0) -> LayoutCandidate:
    """Price one layout (see the module docstring): every rank's peak and the step time.

    ``optimizer``: the plan's (a name: its default settings); its state bytes per parameter
    are the registry's (:meth:`~memfit.optim.registry.OptimizerSpec.bytes_per_parameter`).
    ``microbatches``: with one stage, the gradient-accumulation steps per step (default 1);
    with a pipeline, its ``parallel.microbatches``. The pipeline's stages hold the blocks
    ``parallel.cuts`` gives them (an even split when empty; the layers need not divide).
    ``expert_load``: with ``parallel.expert > 1``, the routing the ranks holding expert 0 (the
    first of each expert group) must fit: ``c`` times expert 0's balanced share of every
    group member's routed tokens, kept by its experts for backward
    (:func:`_routed_token_bytes` per token).
    """
    model = _RankModel(shape, parallel, batch_size=batch_size, seq_len=seq_len,
                       checkpointing=checkpointing, device=device, precision=precision,
                       optimizer=optimizer, microbatches=microbatches)
    p, m = parallel.pipeline, model.m
    blocks = model.blocks_per_rank(parallel.cuts)
    peaks_by_stage, cats_by_stage, stage_flops = [], [], []
    for r in range(p):
        peak, cats = model.memory(r, blocks[r])
        peaks_by_stage.append(peak)
        cats_by_stage.append(cats)
        stage_flops.append(model.flops(r, blocks[r]))
    busy = [f / model.rate for f in stage_flops]
    compute = max(busy)
    bubble = bubble_fraction(parallel.schedule, p, m)
    most = max(blocks)
    comm = communication(
        parallel, device, gpus_per_node=gpus_per_node,
        parameters=most * model.reduced_block_params + model.prof.first_params,
        block_output_bytes=model.block_input, blocks=most, microbatches=m,
        checkpointing=checkpointing, backward_seconds=compute * 2 / 3,
        context_bytes=model.context_bytes,
        routed_bytes=model.routed,
    )
    tp, pp, dp, cp = comm["tensor"], comm["pipeline"], comm["data"], comm["context"]
    ep = comm["expert"]
    cost = StepCost(matmul=compute, pointwise=0.0, launch=0.0, optimizer=0.0,
                    extra_backward=0.0, communication=tp + pp + dp + cp + ep,
                    bubble=compute * bubble)
    step = cost.total
    parts = {"compute": compute, "bubble": compute * bubble, "tensor": tp, "pipeline": pp,
             "data": dp, "context": cp, "expert": ep}
    peaks = _rank_peaks(parallel, peaks_by_stage)
    if parallel.expert > 1 and expert_load > 1:
        extra = _overload_bytes(shape, parallel, model, expert_load, device.name)
        for rank in range(parallel.world_size):
            c = parallel.coordinates(rank)
            if c["replica"] % parallel.expert == 0:  # holds expert 0
                peaks[rank] += blocks[c["stage"]] * extra
        for i, cats in enumerate(cats_by_stage):
            cats["activations"] += blocks[i] * extra
            peaks_by_stage[i] += blocks[i] * extra
    top = max(range(p), key=lambda i: peaks_by_stage[i])
    return LayoutCandidate(parallel, checkpointing, peaks, step, parts, microbatches=m,
                           by_category=cats_by_stage[top], stages=cats_by_stage,
                           stage_busy_seconds=busy)


def _context_costs(shape: ModelShape, parallel: ParallelConfig, mb: int, chunk: int,
                   act_bytes: int) -> tuple[int, float, float]:
    """What context parallelism adds to a rank, per block and micro-batch: its attention's
    buffers in backward (bytes), the last chunk's attention FLOPs beyond its own chunk's
    (forward and backward, per sample), and the bytes its exchanges move (keys and values for
    the ring; queries, keys, values and output for all-to-all)."""
    c, t = parallel.context, parallel.tensor
    if c == 1:
        return 0, 0.0, 0.0
    head_dim = getattr(shape.config, "head_dim", None) or shape.hidden // shape.heads
    q = mb * chunk * (shape.heads // t) * head_dim * act_bytes
    kv = 2 * mb * chunk * (shape.kv_heads // t) * head_dim * act_bytes  # keys and values
    if parallel.context_mode == "ring":
        # Backward: keys, values and their gradients' sums travel together, one bundle held
        # and one received (4 kv); the queries' gradient sum in fp32; one block's keys and
        # values repeated to the query heads and their gradients (GQA).
        extra = 4 * kv + q * 4 // act_bytes + 2 * kv * (shape.heads // shape.kv_heads)
        moved = kv
    else:
        # Queries, keys, values and the output re-split: a sent and a received copy of each.
        extra = 2 * (2 * q + kv)
        moved = 2 * q + kv
    # The last chunk attends to all c - 1 earlier chunks in full: 4 FLOPs per query, key and
    # head dimension forward (scores and the weighted sum), twice that backward.
    flops = 3 * 4 * (shape.heads // t) * head_dim * chunk * chunk * (c - 1)
    return int(extra), float(flops), float(moved)


def _overload_bytes(shape: ModelShape, parallel: ParallelConfig, model: _RankModel,
                    load: float, device: str) -> float:
    """What one block of the rank holding expert 0 keeps beyond its balanced share under
    ``load``: each of its group's ``expert`` ranks sends it ``(load - 1)`` times expert 0's
    share (``tokens x top_k / experts``) more tokens, at most every token."""
    tokens = model.mb * model.seq_len
    share = tokens * shape.top_k / shape.experts
    more = min(tokens, load * share) - share
    dtype = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(model.precision, "float32")
    per_token = _routed_token_bytes(shape, model.seq_len, dtype, device)
    return parallel.expert * more * per_token


@functools.lru_cache(maxsize=16)
def _routed_token_bytes(shape: ModelShape, seq_len: int, dtype: str, device: str) -> float:
    """Bytes an MoE block keeps for backward per routed token (one token at one expert):
    the difference of one-block profiles at top-2 and top-1 routing, per token."""
    one = dataclasses.replace(shape, top_k=1, config=shape.config.__class__(
        **{**shape.config.to_dict(), "num_experts_per_tok": 1}))
    two = dataclasses.replace(shape, top_k=2, config=shape.config.__class__(
        **{**shape.config.to_dict(), "num_experts_per_tok": 2}))
    a, b = _profile(one, 1, seq_len, dtype, device), _profile(two, 1, seq_len, dtype, device)
    return max(0, b.block_acts - a.block_acts) / seq_len


class _RankModel:
    """The per-rank arithmetic of :func:`estimate_layout`: a pipeline rank's peak and FLOPs
    as functions of how many blocks it holds (its stages' together), so that cuts can be
    priced, and chosen (:func:`balanced_cuts`), without a dry run each."""

    def __init__(self, shape: ModelShape, parallel: ParallelConfig, *, batch_size: int,
                 seq_len: int, checkpointing: bool, device: Any, precision: str,
                 optimizer: OptimizerConfig | str, microbatches: int | None = None) -> None:
        from ..distributed.pipeline_plan import PipelineConfig

        t, p, d = parallel.tensor, parallel.pipeline, parallel.data
        self.shape, self.parallel, self.checkpointing = shape, parallel, checkpointing
        self.m = _microbatches(parallel) if p > 1 else (microbatches or 1)
        self.mb = batch_size // (d * self.m)  # samples per micro-batch
        # A context rank's tokens of each sample: its activations, logits and FLOPs.
        self.seq_len = seq_len = seq_len // parallel.context
        dtype = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(precision, "float32")
        self.precision = precision
        self.prof = _profile(shape, t, seq_len, dtype, device.name)
        self.state = _state_bytes(optimizer)
        self.v = 1 if p == 1 else PipelineConfig(p, parallel.schedule).local_stages
        act_bytes = 2 if dtype != "float32" else 4
        self.block_input = self.mb * seq_len * shape.hidden * act_bytes
        # Sequence parallelism: a block's input (what checkpointing keeps, and what the
        # stages pass) holds seq / t tokens, and so do the norms' saved tensors.
        self.split = t if parallel.sequence and t > 1 else 1
        self.stage_input = self.block_input // self.split
        self.norm_saved = self.prof.norm_acts * self.mb * (1 - 1 / self.split)
        self.attention, self.attention_flops, self.context_bytes = _context_costs(
            shape, parallel, self.mb, seq_len, act_bytes)
        # Expert parallelism: a rank keeps 1/e of each block's experts; each MoE block's
        # dispatch moves a micro-batch's routed tokens (``top_k`` per token).
        e = parallel.expert
        self.expert_params = shape.expert_block_params / e if e > 1 else 0.0
        self.block_params = self.prof.block_params - (
            shape.expert_block_params - self.expert_params if e > 1 else 0)
        self.routed = self.block_input * shape.top_k if e > 1 else 0.0
        # The gradients a replica reduces: an expert's only over its replicas (d / e of them).
        self.reduced_block_params = self.block_params - (
            self.expert_params if e > 1 and parallel.data == e else 0)
        # torch's FLOP counter has no formula for transformers' grouped expert matmul
        # (aten._grouped_mm): a routed token's expert FLOPs (top_k experts, three matrices,
        # forward and backward) are added per sample here.
        self.expert_flops = (6 * shape.top_k * 3 * shape.hidden * shape.mlp * seq_len
                             if shape.experts else 0)
        self.config = PipelineConfig(p, parallel.schedule, self.m) if p > 1 else None
        if self.config is not None:
            last = self.config.num_stages - 1
            held = [self.config.stage_indices(r) for r in range(p)]
            self.ends = [(0 in h, last in h) for h in held]
        else:
            self.ends = [(True, True)]
        rate = device.flops.get(
            "bf16" if dtype == "bfloat16" else "fp16" if dtype == "float16" else "fp32")
        tokens = self.mb * seq_len
        self.rate = rate * device.matmul_efficiency * tokens / (tokens + device.half_tokens)

    @property
    def num_stages(self) -> int:
        """Stages in all (1 without a pipeline)."""
        return self.config.num_stages if self.config is not None else 1

    def blocks_per_rank(self, cuts: tuple[int, ...] = ()) -> list[int]:
        """Each pipeline rank's blocks under ``cuts`` (an even split when empty)."""
        if self.config is None:
            return [self.shape.layers]
        cfg = self.config
        sizes = [len(dataclasses.replace(cfg, cuts=tuple(cuts) or None).stage_blocks(
            self.shape.layers, s)) for s in range(cfg.num_stages)]
        return [sum(sizes[s] for s in cfg.stage_indices(r)) for r in range(cfg.degree)]

    def memory(self, r: int, blocks: int) -> tuple[int, dict[str, int]]:
        """Pipeline rank ``r``'s peak holding ``blocks`` blocks, and its bytes by category."""
        from ..distributed.pipeline_plan import microbatches_in_flight
        from .distributed import zero_model_state_bytes

        # The parameters' replicas (data x context) share ZeRO's shards.
        par, prof, mb, d = self.parallel, self.prof, self.mb, self.parallel.replicas
        first, last = self.ends[r]
        # The experts' share of this rank's parameters shards over their replicas only.
        experts = blocks * self.expert_params
        params = blocks * self.block_params - experts
        params += prof.first_params if first else 0
        params += prof.last_params if last else 0
        groups = ((params, d), (experts, d // par.expert)) if experts else ((params, d),)

        def zero(**kw: float) -> float:
            return sum(zero_model_state_bytes(n, w, par.zero_stage, **kw) for n, w in groups)

        states = zero(state_bytes=self.state)
        if par.zero_stage == 3:  # two blocks' parameters gathered at a time
            dense = self.block_params - self.expert_params
            states += 2 * 4 * (dense * (1 - 1 / d)
                               + self.expert_params * (1 - par.expert / d))
        if par.zero_stage == 2:  # whole between a block's forward and its backward
            states += 4 * sum(n * (1 - 1 / w) for n, w in groups)
        block_kept = prof.kept("block", mb) - 2 * self.norm_saved  # two norms per block
        per_block = self.stage_input if self.checkpointing else block_kept
        # ZeRO-R's partitioned checkpoints: a 1/t slice of each input (none with offload: the
        # host's), and during a block's recomputation its input whole again (all-gathered).
        partitioned = self.checkpointing and par.partition_activations
        if partitioned:
            per_block = 0 if par.partition_offload else self.block_input / par.tensor
        # The combine's weighted product keeps the routed tokens it received back.
        per_block += 0 if self.checkpointing else self.routed
        acts = blocks * per_block
        acts += prof.kept("first", mb) if first else 0
        acts += prof.kept("last", mb) - self.norm_saved if last else 0
        v, p = self.v, par.pipeline
        ddp = par.replicas > 1 and not par.sharded
        acts += stage_outputs_kept(self.ends[r], ddp) * self.stage_input if p > 1 else 0
        n = microbatches_in_flight(par.schedule, p, self.m, r, v if v > 1 else None) \
            if p > 1 else 1
        kept = n * acts / v
        # One block's backward: its saved tensors again as gradients (recomputed first when
        # checkpointed), torch 2.15's gradient receive buffer, the last's fp32 logits' gradient.
        work = block_kept * (2 if self.checkpointing else 1) + self.attention
        work += grad_buffer(self.ends[r], self.stage_input)
        work += (self.block_input - per_block) if partitioned else 0
        if last:
            work = max(work, 2 * 4 * mb * self.seq_len * (-(-self.shape.vocab // par.tensor)))
        grads = zero(param_bytes=0, grad_bytes=4, state_bytes=0)
        opt = zero(param_bytes=0, grad_bytes=0, state_bytes=self.state)
        cats = {"parameters": int(states - grads - opt), "gradients": int(grads),
                "optimizer_state": int(opt), "activations": int(kept), "temporaries": int(work)}
        stash = self._stash(r, params + experts)
        if stash:
            cats["stashed_weights"] = stash
        buffers = receive_buffer_bytes(self.config, r, self.m, self.stage_input) \
            if self.config is not None else 0
        if buffers:
            cats["pipeline_buffers"] = buffers
        return int(states + kept + work + stash + buffers), cats

    def _stash(self, r: int, params: float) -> int:
        """PipeDream's stashed weight versions on pipeline rank ``r``: a copy of its fp32
        parameters per version in flight (:func:`~memfit.distributed.pipedream.
        stashed_versions`); 0 for the synchronous schedules."""
        from ..distributed.config import PIPEDREAM_SCHEDULES
        from ..distributed.pipedream import stashed_versions

        par = self.parallel
        if par.schedule not in PIPEDREAM_SCHEDULES or par.pipeline == 1:
            return 0
        copies = stashed_versions(par.schedule, par.pipeline, self.m, r, par.vertical_sync)
        return int(copies * 4 * params)

    def flops(self, r: int, blocks: int) -> float:
        """Pipeline rank ``r``'s forward and backward FLOPs per step holding ``blocks``."""
        prof = self.prof
        first, last = self.ends[r]
        flops = blocks * (prof.block_flops + self.attention_flops + self.expert_flops) * (
            4 / 3 if self.checkpointing else 1)
        flops += (prof.first_flops if first else 0) + (prof.last_flops if last else 0)
        return flops * self.mb * self.m

    def cuts_of(self, blocks: list[int]) -> tuple[int, ...]:
        """The cuts that give each rank ``blocks[r]`` blocks, a rank's split as evenly as
        may be over its stages (the earlier stage taking the odd block)."""
        cfg = self.config
        assert cfg is not None
        sizes = [0] * cfg.num_stages
        for r, k in enumerate(blocks):
            mine = sorted(cfg.stage_indices(r))
            for j, s in enumerate(mine):
                sizes[s] = k // len(mine) + (1 if j < k % len(mine) else 0)
        cuts, at = [], 0
        for n in sizes[:-1]:
            at += n
            cuts.append(at)
        return tuple(cuts)


def _fill(total: int, start: list[int], key: Callable[[int, int], float],
          allowed: Callable[[int, int], bool] | None = None) -> list[int] | None:
    """Hand out ``total`` blocks one at a time, each to the rank whose ``key`` after taking it
    is least (among the ranks ``allowed`` one more): for keys that grow with the blocks, the
    split whose largest key is least. ``allowed`` must stay false once false (a bound on a
    growing figure). ``None`` when the ``allowed`` ranks cannot take them all."""
    counts = list(start)
    heap = [(key(r, k + 1), r) for r, k in enumerate(counts)]
    heapq.heapify(heap)
    for _ in range(total - sum(start)):
        while heap and allowed is not None and not allowed(heap[0][1], counts[heap[0][1]] + 1):
            heapq.heappop(heap)  # this rank is full for good
        if not heap:
            return None
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (key(r, counts[r] + 1), r))
    return counts


def balanced_cuts(shape: ModelShape, parallel: ParallelConfig, *, batch_size: int,
                  seq_len: int, checkpointing: bool, device: Any, precision: str,
                  optimizer: OptimizerConfig | str) -> dict[str, tuple[int, ...]]:
    """The pipeline cuts the planner weighs for one setting, by the per-rank model of
    :func:`estimate_layout` (a rank's peak and FLOPs grow with its blocks, so handing blocks
    out one at a time to the rank that stays least is exact for the largest of them):

    * ``time``: the least step compute (the busiest rank's FLOPs), and among the splits
      that reach it, the one whose largest rank's peak is least: the stages' peaks as equal
      as the fastest step allows;
    * ``memory``: the least largest peak (each rank's peak equalised as far as whole blocks
      go), and among those splits, the least step compute: for when memory binds.

    Returns:
        ``{"time": cuts, "memory": cuts}`` (the same cuts twice when they agree); empty
        without a pipeline.
    """
    if parallel.pipeline == 1:
        return {}
    model = _RankModel(shape, parallel, batch_size=batch_size, seq_len=seq_len,
                       checkpointing=checkpointing, device=device, precision=precision,
                       optimizer=optimizer)
    p, layers = parallel.pipeline, shape.layers
    start = [model.v] * p  # a block on each of a rank's stages at least
    # Both figures are affine in a rank's blocks (each block adds its states, its in-flight
    # activations and its FLOPs): two evaluations per rank give them for every count.
    peaks = [(model.memory(r, 1)[0], model.memory(r, 2)[0]) for r in range(p)]
    works = [(model.flops(r, 1), model.flops(r, 2)) for r in range(p)]

    def peak(r: int, k: int) -> float:
        one, two = peaks[r]
        return one + (two - one) * (k - 1)

    def flops(r: int, k: int) -> float:
        one, two = works[r]
        return one + (two - one) * (k - 1)

    fastest = _fill(layers, start, flops)
    assert fastest is not None  # no bound: every block finds a rank
    t_best = max(flops(r, k) for r, k in enumerate(fastest)) * (1 + 1e-9)
    time_split = _fill(layers, start, peak, lambda r, k: flops(r, k) <= t_best)
    smallest = _fill(layers, start, peak)
    assert smallest is not None and time_split is not None
    m_best = max(peak(r, k) for r, k in enumerate(smallest))
    memory_split = _fill(layers, start, flops, lambda r, k: peak(r, k) <= m_best)
    return {"time": model.cuts_of(time_split),
            "memory": model.cuts_of(memory_split or smallest)}
