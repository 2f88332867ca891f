"""Step-time model: FLOPs (with recomputation), memory traffic, op overhead, optimizer cost.

The model is deliberately simple and explicit; every term is listed in :class:`StepCost` so the
planner can say why one plan is slower than another:

* ``matmul``: forward + backward (+ recomputed forward) FLOPs, counted by PyTorch's
  :class:`~torch.utils.flop_counter.FlopCounterMode`, at the plan's compute dtype's rate,
  derated for small micro-batches (efficiency ``t / (t + half_tokens)`` for ``t`` tokens);
  with the fused loss, one more forward of the output head (its chunk logits are recomputed
  in backward);
* ``pointwise``: activation bytes written in forward and read in backward (and written again
  when recomputed), at memory bandwidth;
* ``launch``: per-op overhead times the ops of every micro-batch (and of recomputation);
* ``optimizer``: bytes the optimizer reads and writes per trainable parameter at memory
  bandwidth, plus per-tensor op overhead when it loops over tensors;
* ``extra_backward``: the norm-only backward of exact clipping with the step in backward;
* ``offload``: with the optimizer on the host (ZeRO-Offload), the gradients' trip down and the
  weights' trip up over the host link (``host_bandwidth``; the trip down overlaps backward's
  compute, so only what exceeds it shows, as in ZeRO-Offload's overlapped transfers), plus the
  host step at host memory bandwidth (``host_mem_bandwidth``), in place of the device step
  (with the step in backward, the three overlap the last backward as a pipeline);
  with parameter offload, every parameter's fetch before each forward and each backward; with
  activation offload, the saved tensors' trips down (during forward) and back (during
  backward); each showing only where it exceeds the compute it overlaps;
* ``communication``: with several processes (:func:`communication`, shared with the 3-D
  planner's :func:`~memfit.estimate.layout_cost.estimate_layout`): the data-parallel gradient
  reduction (DDP's all-reduce; ZeRO 1 and 2 reduce-scatter the gradients and all-gather the
  parameters after the step, the same volume; ZeRO 3 all-gathers the parameters in forward
  and again in backward besides), showing only beyond the backward it overlaps; tensor
  parallelism's all-reduces of each block's output; the pipeline's point-to-point
  activations. Links within a node at ``intra_node_bandwidth``, across nodes at
  ``network_bandwidth``. Zero with one process;
* ``bubble``: the pipeline's idle share, ``(p - 1) / M`` of the compute for GPipe and 1F1B,
  less for interleaved and zero-bubble schedules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..distributed.config import ParallelConfig
from ..optim.registry import get as optimizer_spec
from ..plan import Plan
from ..strategies.fp8 import FP8_EAGER_SLOWDOWN
from ..targets import DeviceProfile
from ..workload import Workload, call_model
from .depth import SHALLOW_DEPTHS, extrapolate

__all__ = [
    "FP8_EAGER_SLOWDOWN",
    "StepCost",
    "WorkloadProfile",
    "bubble_fraction",
    "communication",
    "deeper_half",
    "has_profile",
    "profile_workload",
    "step_cost",
]

@dataclass(frozen=True)
class WorkloadProfile:
    """Size facts of a workload, measured once on fake tensors.

    Attributes:
        fwd_flops_per_sample: Forward FLOPs of one sample at full depth.
        bwd_flops_per_sample: Backward FLOPs of one sample (about twice the forward).
        block_fwd_flops_per_sample: Forward FLOPs of the repeated blocks (what full
            checkpointing recomputes).
        act_bytes_per_sample: Activation bytes kept per sample after the forward (fp32).
        ops_per_micro_batch: Operations dispatched by one micro-batch's forward and backward.
        block_ops: Operations of the blocks' forward (what recomputation dispatches again).
        num_parameters: Parameters of the model.
        num_tensors: Parameter tensors of the model.
        seq_len: Sequence length the profile was measured at.
        head_fwd_flops_per_sample: Forward FLOPs of the output head (the model's
            ``get_output_embeddings()`` linear layer), what the fused loss computes again in
            backward; 0 for a model without one.
        hidden_size: The width of a block's output (its config's ``hidden_size`` or
            ``n_embd``; 0 when it has none): what tensor parallelism all-reduces and a
            pipeline sends per token.
        num_blocks: The model's blocks (its config's layer count; 0 when it has none).
    """

    fwd_flops_per_sample: float
    bwd_flops_per_sample: float
    block_fwd_flops_per_sample: float
    act_bytes_per_sample: float
    ops_per_micro_batch: float
    block_ops: float
    num_parameters: int
    num_tensors: int
    seq_len: int
    head_fwd_flops_per_sample: float = 0.0
    hidden_size: int = 0
    num_blocks: int = 0


def _measure(workload: Workload) -> dict[str, float]:
    """Forward/backward FLOPs, ops and kept activations of one sample, on fake tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..accounting import track
    from .fake_kernels import dry_tensors

    with dry_tensors():
        model, batch = workload.replace(batch_size=1).build()
        head_flops = [0.0]
        hook = _head_flops_hook(model, head_flops)
        with track(model) as tracker:
            tracker.add_inputs(batch)
            with FlopCounterMode(display=False) as fwd_counter:
                loss = workload.loss_fn(call_model(model, batch), batch)
            acts = tracker.snapshot()["activations"]
            fwd_ops = tracker.num_ops
            with FlopCounterMode(display=False) as bwd_counter:
                loss.backward()
            ops = tracker.num_ops
        if hook is not None:
            hook.remove()
        n_params = sum(p.numel() for p in model.parameters())
        n_tensors = len(list(model.parameters()))
        cfg = getattr(model, "config", None)
    return {
        "fwd": float(fwd_counter.get_total_flops()),
        "bwd": float(bwd_counter.get_total_flops()),
        "acts": float(acts),
        "ops": float(ops),
        "fwd_ops": float(fwd_ops),
        "params": float(n_params),
        "tensors": float(n_tensors),
        "head": head_flops[0],
        "hidden": float(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or 0),
        "blocks": float(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
                        or 0),
    }


def _head_flops_hook(model: Any, out: list[float]) -> Any:
    """Count the output head's forward FLOPs into ``out[0]`` (2 per multiply-add)."""
    import torch

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear):
        return None

    def count(module: Any, args: tuple, output: Any) -> None:
        tokens = args[0].numel() // module.in_features
        out[0] += 2.0 * tokens * module.in_features * module.out_features

    return head.register_forward_hook(count)


_PROFILES: dict[tuple[str, int, int], WorkloadProfile] = {}


def deeper_half(workload: Workload) -> dict[str, float] | None:
    """The deeper of the two shallow measurements :func:`profile_workload` takes (``None`` when
    it takes one): picklable, so another process can take it meanwhile."""
    if not (workload.scalable and (workload.depth or 0) > 3):
        return None
    assert workload.with_depth is not None
    return _measure(workload.with_depth(SHALLOW_DEPTHS[-1]))


def _profile(
    workload: Workload, deeper: Callable[[], dict[str, float] | None] | None
) -> WorkloadProfile:
    if workload.scalable and (workload.depth or 0) > 3:
        assert workload.with_depth is not None and workload.depth is not None
        two = _measure(workload.with_depth(SHALLOW_DEPTHS[0]))
        three = (deeper() if deeper is not None else None) or _measure(
            workload.with_depth(SHALLOW_DEPTHS[-1])
        )
        n = workload.depth

        def at(k: str) -> float:
            return extrapolate(two[k], three[k], n)

        block_fwd = n * (three["fwd"] - two["fwd"])
        block_ops = n * (three["fwd_ops"] - two["fwd_ops"])
        full = {k: at(k) for k in two}
    else:
        full = _measure(workload)
        # Without a depth knob, treat the whole forward as recomputable.
        block_fwd, block_ops = full["fwd"], full["fwd_ops"]
    return WorkloadProfile(
        fwd_flops_per_sample=full["fwd"],
        bwd_flops_per_sample=full["bwd"],
        block_fwd_flops_per_sample=block_fwd,
        act_bytes_per_sample=full["acts"],
        ops_per_micro_batch=full["ops"],
        block_ops=block_ops,
        num_parameters=int(full["params"]),
        num_tensors=int(full["tensors"]),
        seq_len=workload.seq_len,
        head_fwd_flops_per_sample=full["head"],
        hidden_size=round(full["hidden"]),
        num_blocks=round(full["blocks"]),
    )


def has_profile(workload: Workload) -> bool:
    """Whether :func:`profile_workload` has ``workload``'s profile already (no measuring)."""
    return (workload.name, workload.depth or 0, workload.seq_len) in _PROFILES


def profile_workload(
    workload: Workload, *, deeper: Callable[[], dict[str, float] | None] | None = None
) -> WorkloadProfile:
    """Measure (once per workload name, depth and sequence length) what the cost model needs.

    ``deeper``, if given, returns :func:`deeper_half` measured elsewhere (``None``: measure it
    here), after this process measured the other half.
    """
    key = (workload.name, workload.depth or 0, workload.seq_len)
    if key not in _PROFILES:
        _PROFILES[key] = _profile(workload, deeper)
    return _PROFILES[key]


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one optimizer step, term by term."""

    matmul: float
    pointwise: float
    launch: float
    optimizer: float
    extra_backward: float
    offload: float = 0.0
    communication: float = 0.0
    bubble: float = 0.0

    @property
    def total(self) -> float:
        """Seconds per step."""
        return (
            self.matmul + self.pointwise + self.launch + self.optimizer + self.extra_backward
            + self.offload + self.communication + self.bubble
        )

    def to_dict(self) -> dict[str, float]:
        """Terms and total, in seconds."""
        return {
            "matmul": self.matmul,
            "pointwise": self.pointwise,
            "launch": self.launch,
            "optimizer": self.optimizer,
            "extra_backward": self.extra_backward,
            "offload": self.offload,
            "communication": self.communication,
            "bubble": self.bubble,
            "total": self.total,
        }




def _compute_dtype(plan: Plan) -> str:
    return {
        "fp32": "fp32",
        "bf16-mixed": "bf16",
        "fp16-mixed": "fp16",
        "bf16-pure": "bf16",
        "fp8": "bf16",  # the rate is bf16's times FP8_EAGER_SLOWDOWN (see _matmul)
    }[plan.precision.mode]


def step_cost(
    profile: WorkloadProfile,
    plan: Plan,
    device: DeviceProfile,
    *,
    batch_size: int,
    trainable_fraction: float = 1.0,
    gpus_per_node: int | None = None,
) -> StepCost:
    """Predict one optimizer step's time of a workload of ``profile`` under ``plan``.

    With several processes (``plan.parallel``), one rank's communication and the pipeline's
    bubble are added (:func:`communication`, :func:`bubble_fraction`); the other terms are
    the step of ``batch_size`` samples (for data parallelism: pass one replica's share).

    Args:
        profile: The workload's measured sizes.
        plan: The plan.
        device: The device profile.
        batch_size: Samples per optimizer step (over every replica).
        trainable_fraction: Share of parameters that train (freezing): backward work and the
            optimizer scale with it.
        gpus_per_node: Devices per node (default: ``min(world size, 8)``): which links the
            process groups use.
    """
    par = plan.parallel
    s = _step_sizes(profile, plan, device, batch_size, trainable_fraction)
    opt = _optimizer_figures(plan.optimizer)
    optimizer = _device_step(plan, device, s, opt)
    off = plan.offload
    offload = 0.0
    if off is not None and off.optimizer is not None:
        offload = _host_step(plan, device, s, opt)
        optimizer = 0.0  # no step on the device
    if off is not None and off.parameters is not None:
        offload += _parameter_fetches(profile, plan, device, s)
    if off is not None and off.activations:
        offload += _activation_trips(device, s)
    matmul = _matmul(profile, plan, s)
    comm = 0.0
    bubble = 0.0
    if par.world_size > 1:
        m = _microbatches(par, s)
        comm = sum(_communication(profile, plan, device, s, m, gpus_per_node).values())
        bubble = matmul * bubble_fraction(par.schedule, par.pipeline, m)
    return StepCost(
        matmul,
        _pointwise(plan, device, s),
        _launch(profile, plan, device, s),
        optimizer,
        _extra_backward(plan, device, s),
        offload,
        comm,
        bubble,
    )


@dataclass(frozen=True)
class _Step:
    """The sizes of one optimizer step that :func:`step_cost`'s terms share."""

    batch_size: int  # samples per optimizer step
    seq_scale: float  # the plan's sequence length over the profile's (1 or less)
    n_micro: int  # micro-batches per step
    rate: float  # matmul FLOP/s at the micro-batch's size
    fwd: float  # forward FLOPs of the step
    bwd: float  # backward FLOPs of the step (trainable share only)
    act_bytes: float  # activation bytes kept by the step, at the compute precision
    params: float  # trainable parameters
    tensors: float  # trainable parameter tensors


def _step_sizes(
    profile: WorkloadProfile,
    plan: Plan,
    device: DeviceProfile,
    batch_size: int,
    trainable_fraction: float,
) -> _Step:
    seq_scale = 1.0
    if plan.max_seq_len is not None and plan.max_seq_len < profile.seq_len:
        seq_scale = plan.max_seq_len / profile.seq_len
    micro = min(plan.micro_batch_for(batch_size), batch_size)
    tokens = micro * profile.seq_len * seq_scale
    efficiency = tokens / (tokens + device.half_tokens)
    act_bytes = profile.act_bytes_per_sample * batch_size * seq_scale
    if plan.precision.mode != "fp32":
        act_bytes /= 2
    return _Step(
        batch_size=batch_size,
        seq_scale=seq_scale,
        n_micro=-(-batch_size // micro),
        rate=device.flops[_compute_dtype(plan)] * device.matmul_efficiency * efficiency,
        fwd=profile.fwd_flops_per_sample * batch_size * seq_scale,
        bwd=profile.bwd_flops_per_sample * batch_size * seq_scale * trainable_fraction,
        act_bytes=act_bytes,
        params=profile.num_parameters * trainable_fraction,
        tensors=profile.num_tensors * trainable_fraction,
    )


def _matmul(profile: WorkloadProfile, plan: Plan, s: _Step) -> float:
    """Forward, backward and recomputed FLOPs at the matmul rate."""
    # Each technique states what it runs again and what slows its matmuls, in its own module.
    recompute, slowdown = 0.0, 1.0
    for technique, _ in plan.techniques():
        if technique.recompute_flops is not None:
            recompute += technique.recompute_flops(plan, profile) * s.batch_size * s.seq_scale
        if technique.matmul_slowdown is not None:
            slowdown *= technique.matmul_slowdown(plan)
    return (s.fwd + s.bwd + recompute) / s.rate * slowdown


def _pointwise(plan: Plan, device: DeviceProfile, s: _Step) -> float:
    """Activation traffic at memory bandwidth."""
    traffic = 2 * s.act_bytes  # written in forward, read in backward
    if plan.checkpointing.mode != "none":
        traffic += s.act_bytes  # recomputed activations are written again
    return traffic / device.mem_bandwidth


def _launch(profile: WorkloadProfile, plan: Plan, device: DeviceProfile, s: _Step) -> float:
    """Per-op overhead of every micro-batch's ops (and of recomputation's)."""
    ops = profile.ops_per_micro_batch * s.n_micro
    if plan.checkpointing.mode != "none":
        ops += profile.block_ops * s.n_micro
    return ops * device.launch_overhead


@dataclass(frozen=True)
class _OptimizerFigures:
    """One optimizer's figures, from the optimizer registry (:mod:`memfit.optim.registry`)."""

    step_bytes: float  # bytes read + written per parameter by one fp32 step
    host_step_bytes: float  # bytes the offloaded host step streams per parameter
    state_bytes: float  # bytes of state kept per parameter (with the plan's settings)
    ops_per_tensor: int  # ops per tensor when it loops over tensors
    foreach: bool  # whether it can step all tensors at once (torch's foreach kernels)


def _optimizer_figures(config: Any) -> _OptimizerFigures:
    spec = optimizer_spec(config.name)
    return _OptimizerFigures(
        step_bytes=spec.step_bytes,
        host_step_bytes=spec.host_step_bytes(),
        state_bytes=spec.bytes_per_parameter(config.kwargs),
        ops_per_tensor=spec.ops_per_tensor,
        foreach=spec.foreach,
    )


def _device_step(plan: Plan, device: DeviceProfile, s: _Step, opt: _OptimizerFigures) -> float:
    """The optimizer's bytes at memory bandwidth, plus launches when it loops over tensors."""
    opt_bytes = opt.step_bytes
    if plan.precision.mode == "bf16-pure":
        opt_bytes = opt_bytes / 2 + 4  # half-size tensors, plus stochastic rounding's draw
    optimizer = s.params * opt_bytes / device.mem_bandwidth
    loops = plan.optimizer.foreach is False or plan.optimizer_in_backward or not opt.foreach
    if loops:
        optimizer += s.tensors * opt.ops_per_tensor * device.launch_overhead
    return optimizer


def _extra_backward(plan: Plan, device: DeviceProfile, s: _Step) -> float:
    """Exact clipping with the step in backward: a norm-only backward first."""
    if (
        plan.optimizer_in_backward
        and plan.max_grad_norm is not None
        and plan.grad_clip_mode == "exact"
    ):
        return s.bwd / s.rate + s.act_bytes / device.mem_bandwidth
    return 0.0


def _host_step(plan: Plan, device: DeviceProfile, s: _Step, opt: _OptimizerFigures) -> float:
    """The optimizer on the host (ZeRO-Offload): gradients down, the host step, weights up,
    each showing only beyond the backward it overlaps."""
    off = plan.offload
    assert off is not None
    weight_bytes = 2.0 if plan.precision.mode == "bf16-pure" else 4.0
    moves = s.n_micro if off.gradients_on_host else 1
    down = s.params * weight_bytes / device.host_bandwidth  # one micro-batch's gradients
    up = s.params * weight_bytes / device.host_bandwidth
    bwd_micro = s.bwd / s.rate / s.n_micro
    # The host step streams the fp32 masters and state (the same bytes as on the device
    # in fp32) plus the gradients' fp32 copy, at host memory bandwidth.
    host_step = s.params * opt.host_step_bytes / device.host_mem_bandwidth
    if off.optimizer == "disk":
        # Masters and state are read and written back every step; the next group's read
        # overlaps the current group's step, so the slower of the two sets the pace.
        state = opt.state_bytes + 4.0
        host_step = max(host_step, 2 * s.params * state / device.disk_bandwidth)
    # Each move overlaps its micro-batch's backward; only the excess shows.
    offload = (moves - 1) * max(0.0, down - bwd_micro)
    if plan.optimizer_in_backward:
        # Buckets step on the host as they land: the link down, the host step and the
        # link up run as a pipeline beside the last backward; its slowest stage sets the
        # pace (ZeRO-Offload's and torchao's overlapped step).
        offload += max(0.0, max(down, host_step, up) - bwd_micro)
    else:
        offload += max(0.0, down - bwd_micro) + up + host_step
    return offload


def _parameter_fetches(
    profile: WorkloadProfile, plan: Plan, device: DeviceProfile, s: _Step
) -> float:
    """Parameter offload: every parameter fetched before each forward and each backward."""
    # Every block parameter comes up before its block's forward and again before its
    # backward, each micro-batch, the next block prefetched while the current computes:
    # each pass's fetches show only beyond that pass's compute. (Non-block parameters,
    # embeddings and head, stay; counted as moving too, so this errs slow.)
    weight_bytes = 2.0 if plan.precision.mode == "bf16-pure" else 4.0
    fetch = profile.num_parameters * weight_bytes / device.host_bandwidth
    fwd_micro = s.fwd / s.rate / s.n_micro
    bwd_micro = s.bwd / s.rate / s.n_micro
    return s.n_micro * (max(0.0, fetch - fwd_micro) + max(0.0, fetch - bwd_micro))


def _activation_trips(device: DeviceProfile, s: _Step) -> float:
    """Activation offload: saved tensors down in forward and back in backward."""
    # Saved tensors go down during forward and come back during backward, each trip
    # overlapped with that pass's compute (a side stream on CUDA). Counted as every kept
    # activation byte: with checkpointing only the block inputs move, so this errs slow.
    trip = s.act_bytes / device.host_bandwidth
    return max(0.0, trip - s.fwd / s.rate) + max(0.0, trip - s.bwd / s.rate)


#: Share of backward the data-parallel gradient reduction overlaps with (buckets reduced as
#: backward produces them; the last buckets' reduction shows).
DP_OVERLAP = 0.8


def bubble_fraction(schedule: str, pipeline: int, microbatches: int) -> float:
    """The pipeline's idle time over its compute: ``(p - 1) / M`` for GPipe and 1F1B, half
    that interleaved (two chunks per rank), a sixth with zero-bubble's split backward; 0
    without a pipeline."""
    if pipeline <= 1:
        return 0.0
    # PipeDream's steps drain as 1F1B's do (memfit.distributed.pipedream): the same bubble.
    per = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 6, "pipedream": 1,
           "pipedream-2bw": 1}[schedule]
    return (pipeline - 1) / (per * microbatches)


def communication(
    parallel: ParallelConfig,
    device: DeviceProfile,
    *,
    gpus_per_node: int | None,
    parameters: float,
    block_output_bytes: float,
    blocks: int,
    microbatches: int,
    checkpointing: bool,
    backward_seconds: float,
    gradient_bytes: float = 4.0,
    context_bytes: float = 0.0,
    routed_bytes: float = 0.0,
) -> dict[str, float]:
    """One rank's seconds of communication per step, by kind (``tensor``, ``pipeline``,
    ``data``, ``context``): what :func:`step_cost` and the 3-D planner's
    :func:`~memfit.estimate.layout_cost.estimate_layout` both add.

    Args:
        parallel: The degrees and ZeRO stage.
        device: Its links: ``intra_node_bandwidth`` within a node, ``network_bandwidth``
            across (:attr:`~memfit.targets.DeviceProfile.node_link_bandwidth`,
            :attr:`~memfit.targets.DeviceProfile.cross_node_bandwidth`).
        gpus_per_node: Devices per node (default ``min(world size, 8)``). Ranks are placed
            tensor innermost, then data, then pipeline (:meth:`ParallelConfig.coordinates`).
        parameters: Parameters whose gradients this rank's replicas reduce (its stage's, its
            tensor shard's).
        block_output_bytes: One micro-batch's block output (a hidden state), what tensor
            parallelism all-reduces and a pipeline sends between stages.
        blocks: Blocks on this rank's stage.
        microbatches: Micro-batches per step.
        checkpointing: Whether blocks are recomputed (a third forward all-reduce each).
        backward_seconds: The backward's compute, which the gradient reduction overlaps.
        gradient_bytes: Bytes per gradient element reduced (fp32: 4).
        context_bytes: With context parallelism, one micro-batch's chunk of a block's keys
            and values (``ring``: what travels per hop) or of its queries, keys, values and
            output (``all-to-all``: what is re-split), on this rank.
        routed_bytes: With ``parallel.expert > 1``: one micro-batch's routed tokens per
            mixture-of-experts block (``tokens x top_k x hidden`` elements), what each
            all-to-all of the dispatch or the combine moves (``expert``).
    """
    t, p, d, c = parallel.tensor, parallel.pipeline, parallel.data, parallel.context
    g = gpus_per_node if gpus_per_node is not None else min(parallel.world_size, 8)
    node, net = device.node_link_bandwidth, device.cross_node_bandwidth
    m = microbatches
    # Tensor parallelism: 2 all-reduces forward, 2 backward (3 forward with recomputation)
    # of a block's output per micro-batch, each moving 2 (t - 1) / t of it per rank.
    per_allreduce = block_output_bytes * 2 * (t - 1) / t / node if t > 1 else 0.0
    tp = (6 if checkpointing else 4) * per_allreduce * blocks * m
    if checkpointing and parallel.partition_activations and t > 1:
        # ZeRO-R: each block's partitioned input all-gathered once per backward.
        tp += block_output_bytes * (t - 1) / t / node * blocks * m
    # Pipeline: each micro-batch's hidden state forward and its gradient back, per boundary.
    pp_bw = node if t * c * d < g else net
    pp = 2 * block_output_bytes * m / pp_bw if p > 1 else 0.0
    # Context (placed inside the data replicas, outside tensor): per block and micro-batch, the
    # ring's c - 1 hops of the keys and values forward and c hops of them with their gradients
    # backward (counted as not hidden by compute); all-to-all's 4 exchanges forward and 4
    # backward, each moving (c - 1) / c of its share.
    cp_bw = node if t * c <= g else net
    hops = (3 * c - 1) if parallel.context_mode == "ring" else 2 * (c - 1) / c
    recompute = 1.5 if checkpointing else 1.0  # a recomputed forward exchanges again
    cp = context_bytes * hops * recompute * blocks * m / cp_bw if c > 1 else 0.0
    # Data parallelism: the gradients reduced once per step (an all-reduce, or ZeRO's
    # reduce-scatter and the parameters' all-gather after the step: the same 2 (d - 1) / d);
    # stage 3 also gathers the parameters in forward and in backward.
    dp_bw = node if t * c * d <= g else net
    r = d * c  # context ranks average their gradients with the data replicas
    volume = (gradient_bytes * max(parameters, 1) * 2 * (r - 1) / r
              * (1.5 if parallel.zero_stage == 3 else 1))
    dp_total = volume / dp_bw if r > 1 else 0.0
    dp = max(0.0, dp_total - DP_OVERLAP * backward_seconds)
    # Expert parallelism: per MoE block and micro-batch, two all-to-alls forward (dispatch,
    # combine), two backward (a third pair forward with recomputation), each sending
    # (e - 1) / e of the routed tokens away; within a node while the group fits in one.
    e = parallel.expert
    ep_bw = node if e <= g else net
    ep = ((6 if checkpointing else 4) * routed_bytes * (e - 1) / e / ep_bw * blocks * m
          if e > 1 else 0.0)
    return {"tensor": tp, "pipeline": pp, "data": dp, "context": cp, "expert": ep}


def _microbatches(par: ParallelConfig, s: _Step) -> int:
    """Micro-batches per step: the pipeline's (``2 p`` by default), else accumulation's."""
    if par.pipeline > 1:
        return par.microbatches or 2 * par.pipeline
    return s.n_micro


def _communication(
    profile: WorkloadProfile, plan: Plan, device: DeviceProfile, s: _Step, m: int,
    gpus_per_node: int | None,
) -> dict[str, float]:
    """:func:`communication` of one rank of ``plan`` over ``m`` micro-batches, from the
    workload's profile."""
    par = plan.parallel
    act = 4 if plan.precision.mode == "fp32" else 2
    micro = s.batch_size / m
    # The replicas reduce the gradients of what trains, a tensor shard of a stage's share.
    params = s.params / (par.tensor * par.pipeline)
    return communication(
        par, device, gpus_per_node=gpus_per_node, parameters=params,
        block_output_bytes=micro * profile.seq_len * s.seq_scale * profile.hidden_size * act,
        blocks=-(-profile.num_blocks // par.pipeline), microbatches=m,
        checkpointing=plan.checkpointing.mode != "none", backward_seconds=s.bwd / s.rate,
        gradient_bytes=2.0 if plan.precision.mode == "bf16-pure" else 4.0,
    )


def describe(cost: StepCost) -> dict[str, Any]:
    """Shares of each term, for explanations."""
    total = cost.total or 1.0
    return {k: v / total for k, v in cost.to_dict().items() if k != "total"}
