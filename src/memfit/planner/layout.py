"""The 3-D planner: data x tensor x pipeline degrees for a per-rank budget.

``memfit plan --world-size N --gpus-per-node G`` searches every way to write ``N = data x
tensor x pipeline`` that the model's shapes allow, and with each layout the ZeRO stage, the
pipeline schedule and micro-batch count, and activation checkpointing. Tensor parallelism stays
within a node (its ranks are consecutive, ``tensor <= G``), so its per-layer all-reduces run at
the node's link bandwidth; data and pipeline groups run over the network once they span
nodes. Ranks are numbered as :mod:`memfit.distributed.layout` places them: ``rank = (stage x
data + replica) x tensor + shard``.

How a layout is priced, per rank:

* **Memory.** One micro-batch through a one-block model of the rank's *local* shapes (for the
  Llama layout: the heads, key-value heads, MLP width and vocabulary divided by the tensor
  degree, exactly the per-rank matrices of Megatron's split) is dry-run on fake tensors
  (:func:`memfit.estimate.pipeline.profile_blocks`): the bytes a block's forward keeps for
  backward, the embeddings' and the head's with the loss, the parameters and the FLOPs, at the
  target's kernels. A stage's ranks then hold their parameters, gradients and optimizer state
  (sharded over ``data`` by the ZeRO stage: :func:`~memfit.estimate.distributed.
  zero_model_state_bytes`), the activations of the micro-batches the schedule keeps in flight
  (:func:`~memfit.distributed.pipeline_plan.microbatches_in_flight`; with checkpointing only
  each block's input), and one block's backward working set.
* **Time.** The stage's FLOPs at the device's rate (its efficiency falls for small
  micro-batches), times the pipeline's bubble (``(M + p - 1) / M``, less for interleaved and
  zero-bubble schedules), plus tensor parallelism's four all-reduces per block per
  micro-batch, the point-to-point activations between stages, and the data-parallel gradient
  reduction that backward does not hide (stage 3 gathers the parameters twice more).

The fastest layout whose every rank fits wins; the winner's every rank is then predicted by
dry runs of its own program in a fake process group when
:func:`memfit.estimate.layout.predict_layout` is available, else by the model above.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..distributed.config import ParallelConfig
from ..plan import Plan
from ..units import format_bytes
from ..workload import Workload, WorkloadError, load_workload
from .result import NothingFits, PlanResult

__all__ = [
    "LayoutCandidate",
    "ModelShape",
    "estimate_layout",
    "layout_problems",
    "layout_table",
    "model_shape",
    "plan_layout",
    "rank_coordinates",
]

#: Fraction of the budget a layout may use: the caching allocator's rounding and
#: fragmentation, which the layout model does not follow block by block.
_ALLOCATOR_SLACK = 0.95
#: Share of backward the data-parallel gradient reduction overlaps with.
_DP_OVERLAP = 0.8
#: Optimizer state bytes per parameter by optimizer name (fp32 AdamW: two moments).
_STATE_BYTES = {"adamw": 8, "adam": 8, "adamw8bit": 2, "sgd": 0, "lion": 4, "adafactor": 0.1}


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
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    config: Any = dataclasses.field(compare=False, repr=False)


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
    if family not in ("llama", "gpt2"):
        raise WorkloadError(
            f"the 3-D planner splits causal LMs of the Llama and GPT-2 layouts, not "
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
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problems(shape: ModelShape, parallel: ParallelConfig, batch_size: int,
                    gpus_per_node: int | None = None) -> list[str]:
    """What stops ``parallel`` from training ``shape`` at ``batch_size``, one sentence each
    naming what would work (empty when it can run).

    Checks: tensor parallelism within a node and dividing the heads, key-value heads and MLP
    width; the pipeline's stages no more than the blocks, dividing them evenly; the batch
    split evenly over the replicas and the micro-batches; the schedule's micro-batch count.
    """
    from ..distributed.pipeline_plan import PipelineConfig

    out: list[str] = []
    t, p, d = parallel.tensor, parallel.pipeline, parallel.data
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
        if shape.layers % p:
            works = [x for x in _divisors(shape.layers) if x > 1]
            out.append(
                f"a pipeline of {p} stages does not divide the {shape.layers} layers evenly; "
                f"use pipeline {', '.join(map(str, works))}"
            )
        else:
            cfg = PipelineConfig(p, parallel.schedule, _microbatches(parallel))
            out.extend(cfg.problems(shape.layers))
    m = _microbatches(parallel)
    if batch_size % (d * m):
        out.append(
            f"a batch of {batch_size} samples does not split into {d} replicas x {m} "
            f"micro-batches; use a batch size that is a multiple of {d * m}"
        )
    return out


def _microbatches(parallel: ParallelConfig) -> int:
    if parallel.microbatches is not None:
        return parallel.microbatches
    return 2 * parallel.pipeline if parallel.pipeline > 1 else 1


# ------------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class _Profile:
    """One micro-batch of one sample through one tensor-parallel rank's shapes."""

    block_params: int  # elements
    first_params: int
    last_params: int
    block_acts: int  # bytes kept for backward by one block
    first_acts: int
    last_acts: int
    block_flops: float  # forward + backward
    first_flops: float
    last_flops: float


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

    from ..estimate.pipeline import profile_blocks
    from ..targets import emulate, get_device
    from ..workload import _hf_model_from_config_impl

    cfg = _local_config(shape, tensor)
    with torch.device("meta"):
        model = _hf_model_from_config_impl(cfg, None)
    model = model.to_empty(device="cpu")
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    autocast = (
        torch.autocast("cpu", dtype=getattr(torch, dtype))
        if dtype in ("bfloat16", "float16")
        else _null()
    )
    with emulate(get_device(device)), autocast:
        prof = profile_blocks(model, ids, ids)
    block = prof.blocks[0]
    out = _Profile(
        block_params=block.state_bytes // 4,
        first_params=prof.first.state_bytes // 4,
        last_params=prof.last.state_bytes // 4,
        block_acts=block.activation_bytes,
        first_acts=prof.first.activation_bytes,
        last_acts=prof.last.activation_bytes,
        block_flops=block.compute,
        first_flops=prof.first.compute,
        last_flops=prof.last.compute,
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
        block_flops=prof.block_flops / t,
        first_flops=prof.first_flops / t,
        last_flops=prof.last_flops / t,
    )


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


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
            ``data``).
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
        if par.data > 1:
            bits.append(f"ZeRO {par.zero_stage}")
        if self.checkpointing:
            bits.append("checkpointing")
        return ", ".join(bits)

    def describe(self) -> str:
        """The layout in words."""
        par = self.parallel
        degrees = f"data {par.data}, tensor {par.tensor}, pipeline {par.pipeline}"
        rest = self.settings().replace(f" x{self.microbatches}", f" x {self.microbatches} micro-batches")
        return degrees + (", " + rest if rest else "")


def _rank_of(stage: int, replica: int, shard: int, par: ParallelConfig) -> int:
    return (stage * par.data + replica) * par.tensor + shard


def rank_coordinates(rank: int, parallel: ParallelConfig) -> dict[str, int]:
    """Where ``rank`` sits: its pipeline ``stage``, data-parallel ``replica`` and
    tensor-parallel ``shard`` (``rank = (stage x data + replica) x tensor + shard``)."""
    shard = rank % parallel.tensor
    replica = rank // parallel.tensor % parallel.data
    stage = rank // (parallel.tensor * parallel.data)
    return {"stage": stage, "replica": replica, "shard": shard}


def estimate_layout(shape: ModelShape, parallel: ParallelConfig, *, batch_size: int,
                    seq_len: int, checkpointing: bool, device: Any, precision: str,
                    optimizer: str, gpus_per_node: int,
                    microbatches: int | None = None) -> LayoutCandidate:
    """Price one layout (see the module docstring): every rank's peak and the step time.

    ``microbatches``: with one stage, the gradient-accumulation steps per step (default 1);
    with a pipeline, its ``parallel.microbatches``.
    """
    from ..distributed.pipeline_plan import microbatches_in_flight
    from ..estimate.distributed import zero_model_state_bytes

    t, p, d = parallel.tensor, parallel.pipeline, parallel.data
    m = _microbatches(parallel) if p > 1 else (microbatches or 1)
    mb = batch_size // (d * m)  # samples per micro-batch
    dtype = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(precision, "float32")
    prof = _profile(shape, t, seq_len, dtype, device.name)
    act_bytes = 2 if dtype != "float32" else 4
    per_stage = shape.layers // p
    state = _STATE_BYTES.get(optimizer, 8)
    v = 1 if parallel.schedule in ("gpipe", "1f1b") else 2
    block_input = mb * seq_len * shape.hidden * act_bytes

    peaks_by_stage: list[int] = []
    cats_by_stage: list[dict[str, int]] = []
    stage_flops = []
    for s in range(p):
        first, last = s == 0, s == p - 1
        if v == 2:  # two chunks per rank: the first chunk's rank also holds the last
            first, last = s == 0, s == 0
        params = per_stage * prof.block_params
        params += prof.first_params if first else 0
        params += prof.last_params if last else 0
        states = zero_model_state_bytes(params, d, parallel.zero_stage, state_bytes=state)
        if parallel.zero_stage == 3:  # two blocks' parameters gathered at a time
            states += 2 * 4 * prof.block_params * (1 - 1 / d)
        if parallel.zero_stage == 2:  # whole between a block's forward and its backward
            states += 4 * params * (1 - 1 / d)
        per_block = block_input if checkpointing else prof.block_acts * mb
        acts = per_stage * per_block
        acts += prof.first_acts * mb if first else 0
        acts += prof.last_acts * mb if last else 0
        n = microbatches_in_flight(parallel.schedule, p, m, s, v if v > 1 else None) if p > 1 else 1
        kept = n * acts / v
        # One block's backward: its saved tensors again as gradients (recomputed first when
        # checkpointed), and on the last stage the logits' gradient in fp32.
        work = prof.block_acts * mb * (2 if checkpointing else 1)
        if last:
            work = max(work, 2 * 4 * mb * seq_len * (-(-shape.vocab // t)))
        peaks_by_stage.append(int(states + kept + work))
        grads = zero_model_state_bytes(params, d, parallel.zero_stage, param_bytes=0,
                                       grad_bytes=4, state_bytes=0)
        opt = zero_model_state_bytes(params, d, parallel.zero_stage, param_bytes=0,
                                     grad_bytes=0, state_bytes=state)
        cats_by_stage.append({
            "parameters": int(states - grads - opt), "gradients": int(grads),
            "optimizer_state": int(opt), "activations": int(kept), "temporaries": int(work),
        })
        flops = per_stage * prof.block_flops * (4 / 3 if checkpointing else 1)
        flops += (prof.first_flops if first else 0) + (prof.last_flops if last else 0)
        stage_flops.append(flops * mb * m)

    rate = device.flops.get("bf16" if dtype == "bfloat16" else "fp16" if dtype == "float16" else "fp32")
    tokens = mb * seq_len
    eff = device.matmul_efficiency * tokens / (tokens + device.half_tokens)
    busy = [f / (rate * eff) for f in stage_flops]
    compute = max(busy)
    bubble = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved-1f1b": (p - 1) / (2 * m),
              "zero-bubble": (p - 1) / (6 * m)}[parallel.schedule] if p > 1 else 0.0
    node = device.node_link_bandwidth
    net = device.cross_node_bandwidth
    g = gpus_per_node
    # Tensor parallelism: 2 all-reduces forward, 2 backward (3 forward with recomputation)
    # of a block's output per micro-batch, each moving 2 (t - 1) / t of it per rank.
    per_allreduce = block_input * 2 * (t - 1) / t / node if t > 1 else 0.0
    tp = (6 if checkpointing else 4) * per_allreduce * per_stage * m
    # Pipeline: each micro-batch's hidden state forward and its gradient back, per boundary.
    pp_bw = node if t * d < g else net
    pp = 2 * block_input * m / pp_bw if p > 1 else 0.0
    # Data parallelism: the gradients (fp32) reduced once per step; stage 3 also gathers the
    # parameters in forward and in backward.
    local_params = max(per_stage * prof.block_params + prof.first_params, 1)
    dp_bw = node if t * d <= g else net
    volume = 4 * local_params * 2 * (d - 1) / d * (1.5 if parallel.zero_stage == 3 else 1)
    dp_total = volume / dp_bw if d > 1 else 0.0
    dp = max(0.0, dp_total - _DP_OVERLAP * compute * 2 / 3)
    step = compute * (1 + bubble) + tp + pp + dp
    parts = {"compute": compute, "bubble": compute * bubble, "tensor": tp, "pipeline": pp,
             "data": dp}
    peaks = [0] * parallel.world_size
    for s in range(p):
        for r in range(d):
            for k in range(t):
                peaks[_rank_of(s, r, k, parallel)] = peaks_by_stage[s]
    top = max(range(p), key=lambda i: peaks_by_stage[i])
    return LayoutCandidate(parallel, checkpointing, peaks, step, parts, microbatches=m,
                           by_category=cats_by_stage[top], stages=cats_by_stage,
                           stage_busy_seconds=busy)


# -------------------------------------------------------------------------------- planning
def _layouts(world: int, gpus_per_node: int) -> Iterable[tuple[int, int, int]]:
    """``(data, tensor, pipeline)`` with tensor parallelism inside a node."""
    for t in _divisors(min(world, gpus_per_node)):
        if world % t or gpus_per_node % t:
            continue
        for p in _divisors(world // t):
            yield world // (t * p), t, p


def _fixed_layout(par: ParallelConfig, world: int, shape: ModelShape, batch_size: int,
                  gpus_per_node: int) -> tuple[int, int, int]:
    """The one layout a plan's own tensor and pipeline degrees leave, or one sentence why
    they cannot run."""
    t, p = par.tensor, par.pipeline
    if par.data > 1 and par.world_size != world:
        raise ValueError(
            f"the plan's data {par.data} x tensor {t} x pipeline {p} is {par.world_size} "
            f"processes but --world-size is {world}; give --world-size {par.world_size} or "
            f"degrees whose product is {world}"
        )
    if world % (t * p):
        raise ValueError(
            f"the plan's tensor {t} x pipeline {p} is {t * p} processes per replica, which does "
            f"not divide --world-size {world}; use a world size that is a multiple of {t * p}"
        )
    d = world // (t * p)
    trial = dataclasses.replace(par, data=d)
    problems = layout_problems(shape, trial, batch_size, gpus_per_node)
    if problems:
        raise ValueError(problems[0])
    return d, t, p


def _settings(d: int, t: int, p: int, batch_size: int, base: ParallelConfig,
              shape: ModelShape, gpus_per_node: int,
              fixed: bool = False) -> Iterable[tuple[ParallelConfig, int]]:
    """Every valid setting of one layout, with its micro-batch count (the pipeline's, or
    gradient accumulation's with one stage). ``fixed``: the plan's own schedule and
    micro-batch count, when it gives them, are kept."""
    if batch_size % d:
        return
    # With a tensor or pipeline split, replicas shard through FSDP2 (stages 2 and 3) or
    # all-reduce (stage 0); ZeroRedundancyOptimizer is not composed with them.
    stages = ((0, 1, 2, 3) if t == 1 and p == 1 else (0, 2, 3)) if d > 1 else (0,)
    schedules: tuple[str, ...] = (
        ("1f1b", "interleaved-1f1b", "zero-bubble", "gpipe") if p > 1 else ("1f1b",)
    )
    counts = _divisors(batch_size // d)
    if fixed and p > 1:
        schedules = (base.schedule,)
        if base.microbatches is not None:
            counts = [base.microbatches]
    for stage in stages:
        for schedule in schedules:
            for m in counts:
                par = dataclasses.replace(base, data=d, tensor=t, pipeline=p, zero_stage=stage,
                                          schedule=schedule if p > 1 else base.schedule,
                                          microbatches=m if p > 1 else None)
                if not layout_problems(shape, par, batch_size, gpus_per_node):
                    yield par, m


def plan_layout(
    workload: Workload | str,
    budget: int | str,
    world_size: int,
    gpus_per_node: int | None = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    base: Plan | None = None,
    device: Any = None,
    progress: Callable[[str], None] | None = None,
    confirm: bool = True,
    **_: Any,
) -> PlanResult:
    """The fastest 3-D layout over ``world_size`` processes whose every rank fits ``budget``.

    Args:
        workload: The workload at its global batch, or a SPEC (a Hugging Face transformer).
        budget: Per-process budget (bytes, a size string or a device name).
        world_size: Processes in all.
        gpus_per_node: Devices per node (default: ``min(world_size, 8)``); tensor
            parallelism stays within one.
        batch_size: With a SPEC: the global batch (default 8).
        seq_len: With a SPEC: tokens per sample (default 128).
        base: The user's plan: its precision and optimizer are kept (default: bf16-mixed
            where the device computes in bf16, and AdamW).
        device: The target device (its memory, speed and links).
        progress: Called with a short message as the search advances.
        confirm: Predict the winner's every rank by dry runs of its own program
            (:func:`memfit.estimate.layout.predict_layout`) when that is available.

    Raises:
        ValueError: for a world size or node size that is not a whole number >= 1, or a node
            size that does not divide the world.
        WorkloadError: for a model the planner cannot split.
        NothingFits: when no layout fits; ``.result`` holds the closest.
    """
    from ..estimate.dryrun import plan_for_target
    from ..targets import get_device, parse_budget

    started = time.perf_counter()
    say = progress or (lambda msg: None)
    for name, value in (("--world-size", world_size), ("--gpus-per-node", gpus_per_node)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    g = gpus_per_node if gpus_per_node is not None else min(world_size, 8)
    if world_size % g and world_size > g:
        raise ValueError(
            f"--gpus-per-node {g} does not divide --world-size {world_size}; nodes hold the "
            f"same number of devices, so use a world size that is a multiple of {g}"
        )
    if isinstance(workload, str):
        workload = load_workload(workload, batch_size or 8, seq_len or 128)
    budget_bytes, budget_device = parse_budget(budget)
    target = get_device(device) if device else (budget_device or get_device(None))
    # On a GPU: the CUDA context and workspaces outside the allocator, and its rounding.
    limit = (budget_bytes * _ALLOCATOR_SLACK - target.overhead_bytes if target.is_cuda
             else budget_bytes)
    base = base or Plan()
    precision = base.precision.mode
    if precision == "fp32" and target.is_cuda and target.supports_bf16:
        precision = "bf16-mixed"  # what every multi-GPU recipe trains in
    base = plan_for_target(base.replace(precision=precision), target)
    say("reading the model's shapes")
    shape = model_shape(workload)
    layouts = list(_layouts(world_size, g))
    fixed = base.parallel if base.parallel.tensor > 1 or base.parallel.pipeline > 1 else None
    if fixed is not None:
        layouts = [_fixed_layout(fixed, world_size, shape, workload.batch_size, g)]
    candidates: list[LayoutCandidate] = []
    refused: list[str] = []
    for d, t, p in layouts:
        settings = list(_settings(d, t, p, workload.batch_size, base.parallel, shape, g,
                                  fixed=fixed is not None))
        if not settings:
            trial = dataclasses.replace(base.parallel, data=d, tensor=t, pipeline=p,
                                        microbatches=2 * p if p > 1 else None)
            problems = layout_problems(shape, trial, workload.batch_size, g)
            refused.append(f"data {d} x tensor {t} x pipeline {p}: "
                           + (problems[0] if problems else "no setting works"))
            continue
        say(f"pricing data {d} x tensor {t} x pipeline {p}")
        for par, m in settings:
            for ckpt in (False, True):
                cand = estimate_layout(
                    shape, par, batch_size=workload.batch_size, seq_len=workload.seq_len,
                    checkpointing=ckpt, device=target, precision=precision,
                    optimizer=base.optimizer.name, gpus_per_node=g, microbatches=m,
                )
                cand.fits = cand.max_peak_bytes <= limit
                candidates.append(cand)
    if not candidates:
        raise ValueError(
            f"no layout of {world_size} processes can split {workload.name} at a batch of "
            f"{workload.batch_size}: " + "; ".join(refused[:3])
        )
    # Equal times go to the lower ZeRO stage (it moves no more data), then the smaller peak.
    candidates.sort(key=lambda c: (round(c.step_seconds, 12), c.parallel.zero_stage,
                                   c.max_peak_bytes))
    fitting = [c for c in candidates if c.fits]
    result_of = functools.partial(_result, workload=workload, base=base, budget=budget_bytes,
                                  target=target, candidates=candidates)
    if not fitting:
        closest = min(candidates, key=lambda c: c.max_peak_bytes)
        raise NothingFits(
            result_of(closest, fits=False, explanation=""),
            f"no layout of {world_size} processes fits {format_bytes(budget_bytes)} per "
            f"process; the closest ({closest.describe()}) needs "
            f"{format_bytes(closest.max_peak_bytes)} on its largest rank. Use more processes, "
            "a smaller batch or sequence length, or a device with more memory.",
        )
    best = fitting[0]
    confirmed = None
    if confirm:
        for cand in fitting[:3]:
            peaks = _confirm(workload, result_of(cand, fits=True, explanation="").plan, target, say)
            if peaks is None:
                break
            if max(peaks) <= limit:
                best, confirmed = cand, peaks
                break
    runner_up = next((c for c in fitting if _layout_key(c) != _layout_key(best)), None)
    why = _explain(best, runner_up, world_size, g, confirmed is not None)
    result = result_of(best, fits=True, explanation=why)
    if confirmed is not None:
        result.rank_peak_bytes = list(confirmed)
        result.predicted_peak_bytes = max(confirmed)
    result.seconds = time.perf_counter() - started
    return result


def _layout_key(c: LayoutCandidate) -> tuple[int, int, int]:
    return c.parallel.data, c.parallel.tensor, c.parallel.pipeline


def _confirm(workload: Workload, plan: Plan, target: Any,
             say: Callable[[str], None]) -> list[int] | None:
    """Each rank's peak from dry runs of its own program in a fake process group
    (:func:`memfit.estimate.layout.predict_layout`), for what those dry runs model: a
    tensor or pipeline split in fp32, without checkpointing, with AdamW or SGD, replicas
    all-reducing (stage 0). ``None`` otherwise (the layout model's figures stand)."""
    from ..estimate.layout import predict_layout

    par = plan.parallel
    if (
        (par.tensor == 1 and par.pipeline == 1)
        or par.zero_stage != 0
        or plan.precision.mode != "fp32"
        or plan.checkpointing.mode != "none"
        or plan.optimizer.name not in ("adamw", "sgd")
    ):
        return None
    say(f"predicting every rank of {plan.summary()}")
    try:
        pred = predict_layout(workload, par, optimizer=plan.optimizer.name,
                              foreach=True if target.is_cuda else None)
    except ValueError:
        return None
    return [int(x) for x in pred.peak_bytes]


def _result(cand: LayoutCandidate, *, fits: bool, explanation: str, workload: Workload,
            base: Plan, budget: int, target: Any, candidates: list[LayoutCandidate]) -> PlanResult:
    from ..strategies.checkpointing import CheckpointConfig

    changes: dict[str, Any] = {
        "parallel": cand.parallel,
        "checkpointing": CheckpointConfig("full") if cand.checkpointing else base.checkpointing,
    }
    if cand.parallel.pipeline == 1 and cand.microbatches > 1:
        local = workload.batch_size // cand.parallel.data
        changes.update(micro_batch_size=local // cand.microbatches,
                       grad_accum_steps=cand.microbatches)
    plan = base.replace(**changes)
    # The ideal: the same work spread perfectly, no bubble, no communication, no recompute.
    ideal = cand.parts["compute"] / (4 / 3 if cand.checkpointing else 1)
    result = PlanResult(
        fits=fits,
        plan=plan,
        budget_bytes=budget,
        predicted_peak_bytes=cand.max_peak_bytes,
        predicted_peak_by_category=dict(cand.by_category),
        predicted_step_time_ratio=cand.step_seconds / ideal if ideal else 1.0,
        candidates=[],
        frontier=[],
        explanation=explanation,
        device=target.name,
        rank_peak_bytes=list(cand.rank_peak_bytes),
        layout={
            "step_seconds": cand.step_seconds,
            "parts_seconds": dict(cand.parts),
            "stage_busy_seconds": list(cand.stage_busy_seconds),
            "checkpointing": cand.checkpointing,
            "microbatches": cand.microbatches,
            "alternatives": _alternatives(cand, candidates),
        },
    )
    result.layout_candidate = cand  # type: ignore[attr-defined]
    result.layouts = candidates  # type: ignore[attr-defined]
    return result


def _alternatives(chosen: LayoutCandidate, candidates: list[LayoutCandidate],
                  n: int = 3) -> list[dict[str, Any]]:
    """The fastest fitting setting of the next ``n`` layouts (``candidates`` sorted fastest
    first)."""
    seen, out = {_layout_key(chosen)}, []
    for c in candidates:
        if c.fits and _layout_key(c) not in seen:
            seen.add(_layout_key(c))
            out.append({"layout": c.describe(), "step_seconds": c.step_seconds,
                        "largest_rank_bytes": c.max_peak_bytes})
            if len(out) == n:
                break
    return out


def _explain(best: LayoutCandidate, other: LayoutCandidate | None, world: int, g: int,
             confirmed: bool) -> str:
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in best.parts.items() if v > 0)
    text = (
        f"{best.describe()} on {world} processes ({g} per node): predicted "
        f"{best.step_seconds:.3g} s per step ({parts}); largest rank "
        f"{format_bytes(best.max_peak_bytes)}"
        + (" (every rank dry-run in its own program)" if confirmed else "")
        + "."
    )
    if other is not None:
        slower = other.step_seconds / best.step_seconds
        text += (
            f" The next best layout, {other.describe()}, is {slower:.2f}x slower"
            + _why_slower(best, other)
            + "."
        )
    return text


def _why_slower(best: LayoutCandidate, other: LayoutCandidate) -> str:
    diffs = {k: other.parts[k] - best.parts.get(k, 0.0) for k in other.parts}
    key = max(diffs, key=lambda k: diffs[k])
    if diffs[key] <= 0:
        return ""
    what = {"compute": "more compute per rank (recomputation or a smaller share of the work)",
            "bubble": "a larger pipeline bubble", "tensor": "more tensor-parallel all-reduces",
            "pipeline": "more point-to-point traffic between stages",
            "data": "more gradient traffic across replicas"}[key]
    return f": {what}, {diffs[key]:.3g} s more per step"


def layout_table(result: PlanResult, limit: int = 12) -> Any:
    """A rich renderable: the best setting of each layout, its step time and largest rank."""
    from rich.console import Group
    from rich.table import Table

    layouts: list[LayoutCandidate] = getattr(result, "layouts", [])
    chosen: LayoutCandidate | None = getattr(result, "layout_candidate", None)
    table = Table(
        title=f"Layouts weighed against {format_bytes(result.budget_bytes)} per process "
        f"(cost model: {result.device})",
        title_justify="left",
    )
    for name, justify in (("data x tensor x pipeline", "left"), ("settings", "left"),
                          ("step", "right"), ("largest rank", "right"), ("fits", "center")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    best_of: dict[tuple[int, int, int], LayoutCandidate] = {}
    for c in layouts:  # fastest first: the first fitting one of each layout, else its smallest
        key = _layout_key(c)
        held = best_of.get(key)
        if held is None or (c.fits and not held.fits) or (
            not held.fits and not c.fits and c.max_peak_bytes < held.max_peak_bytes
        ):
            best_of[key] = c
    rows = sorted(best_of.values(), key=lambda c: (not c.fits, c.step_seconds))
    for c in rows[:limit]:
        won = chosen is not None and _layout_key(c) == _layout_key(chosen)
        table.add_row(
            ("★ " if won else "") + " x ".join(map(str, _layout_key(c))),
            c.settings(),
            f"{c.step_seconds * 1e3:.1f} ms",
            format_bytes(c.max_peak_bytes),
            "yes" if c.fits else "no",
            style="bold green" if won else None,
        )
    notes: list[Any] = [table]
    if len(rows) > limit:
        notes.append(f"(+{len(rows) - limit} more layouts)")
    verdict = "Winner" if result.fits else "Closest"
    notes.append(f"{verdict}: {result.plan.summary()}: {result.explanation}")
    return Group(*notes)

