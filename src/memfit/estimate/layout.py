"""Every rank's peak under a tensor x pipeline x data layout, predicted without launching:
:func:`predict_layout`.

For each distinct role (a pipeline rank: its stages; the ranks of a tensor-parallel group are
symmetric, so tensor rank 0 stands for all, whose vocabulary shard is the largest, and so do
the data-parallel replicas) the rank's own program runs on fake tensors inside a fake process
group (:func:`~memfit.estimate.distributed.fake_process_group`) in which this process is that
rank, as torchtitan's memory estimator does:

1. the ``("pp", "dp", "cp", "tp")`` device mesh is built as :func:`~memfit.distributed.layout.
   build_layout` builds it; the rank's stages are built with
   :func:`~memfit.distributed.pipeline.build_stage` and split by
   :func:`~memfit.distributed.tensor.apply_tensor_parallel` on ``mesh["tp"]`` (DTensors whose
   shards are fake tensors), then the optimizer's state is made by one step. Data parallelism
   without sharding (ZeRO 0) is torch's DDP in the real run, which cannot be built on fake
   tensors: its memory, the buckets that are the gradients for the whole run
   (:mod:`memfit.distributed.replicas`), is held by a contiguous gradient buffer
   (:func:`~memfit.strategies.grad_buffer.apply_grad_buffer`) over what DDP would take (the
   local shards under tensor parallelism), live from the step's start; its all-reduce, in
   place in the buckets, allocates nothing. ZeRO 2/3 is FSDP2, run as it is;
2. under memfit's tracker, two micro-batches go through the rank's stages (forward, the last
   stage's loss under ``loss_parallel``, backward from a received gradient), as torch's
   pipeline stage runs them (inputs received into per-micro-batch buffers, output gradients
   likewise), then gradient scaling (and FSDP2's reduce-scatter) and the optimizer step;
3. each event's cost is read off the trace: what a forward keeps (its activations), the
   transient above the start of each forward and backward (the first backward, which creates
   the gradients, apart from the later ones, which accumulate), and the optimizer step's;
4. torch's own schedule order for the rank (built in a fake process group,
   :func:`~memfit.estimate.pipeline._schedule_orders`) is replayed with those costs: the peak
   of that replay is the rank's.

Nothing is allocated and no whole model is built: a stage with more than two blocks is run at
one and two blocks and its costs extrapolated linearly in the block count (identical blocks add
identical activations, gradients and states; the transients are either independent of depth
or linear in it). The other stages are one block each, so building costs little.

Accuracy, against memfit's tracker on four real processes (tests/distributed/test_layout.py):
within 1% for tensor x pipeline, and for data x pipeline and data x tensor with ZeRO 0 (DDP:
0.2-0.5% on the test's tiny Llama). FSDP2
(ZeRO 2/3) is followed as torch's pipeline stage drives it, but is less exact: 5% over for data
2 x tensor 2 under ZeRO 3, and 24% over for data 2 x pipeline 2 under ZeRO 2 (the emulated
unsharded-gradient accumulation holds more than the real run does; not yet understood).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..accounting import track
from ..apply.layout import checkpoint_layout_modules
from ..distributed.config import PIPEDREAM_SCHEDULES, ParallelConfig
from ..distributed.context import apply_context_parallel
from ..distributed.layout import (
    MESH_DIMS,
    LayoutError,
    _fully_shard,
    check_layout,
    layout_coords,
    layout_microbatches,
    mesh_shape,
    pipeline_config,
    replica_mesh,
)
from ..distributed.pipeline import PipelineConfig, build_stage, causal_lm_loss
from ..distributed.replicas import local_shards
from ..distributed.tensor import TensorParallelConfig, apply_tensor_parallel, shifted_cross_entropy
from ..optim import registry as optim_registry
from ..optim.config import OptimizerConfig
from ..strategies.checkpointing import CheckpointConfig
from ..strategies.grad_buffer import apply_grad_buffer
from ..workload import Workload, load_workload
from .distributed import fake_process_group
from .pipedream import pipedream_rank_peak
from .pipeline import _fake, _schedule_orders
from .pipeline_terms import receive_buffers_kept, stage_outputs_released

__all__ = ["LayoutPrediction", "RoleCosts", "predict_layout"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Stages of at most this many blocks are run whole; deeper ones at one and two blocks.
EXACT_BLOCKS = 2

_DEPTH_KEYS = ("num_hidden_layers", "n_layer")


@dataclass(frozen=True)
class RoleCosts:
    """One pipeline rank's measured costs, per event of its schedule (bytes).

    Attributes:
        static: Live at the step's start: parameters, optimizer state, the pipeline's receive
            buffers (up to torch 2.14; 2.15's are made per receive, in the events' costs), the
            batch; at ZeRO 0 with data replicas, the gradients (DDP's buckets).
        forward_kept: Per local stage: what a micro-batch's forward keeps until its backward.
        forward_over: Per local stage: the forward's transient peak above its start.
        backward_over: Per local stage: ``(first, later)`` backward transient peaks above their
            start (the first creates the gradients, the later ones accumulate).
        backward_delta: Per local stage: ``(first, later)`` change in live bytes over a
            backward (``gradients - forward_kept`` for the first, ``-forward_kept`` after;
            ``-forward_kept`` for both under DDP, whose buckets hold the gradients already).
        optimizer_over: The gradient reduction and optimizer step's transient above their start.
        parameter_bytes: This rank's parameter shards.
        gradient_bytes: Its gradients.
        optimizer_state_bytes: Its optimizer state.
        sent_bytes: Per local stage: the input gradient a backward sends to the previous
            stage's rank (0 where that stage is on this rank, or there is none). torch's
            schedule keeps it, in the send's operation, past the backward: 1F1B until the next
            backward on the stage has run, GPipe until the last backward (:func:`_replay`).
    """

    static: int
    forward_kept: dict[int, int]
    forward_over: dict[int, int]
    backward_over: dict[int, tuple[int, int]]
    backward_delta: dict[int, tuple[int, int]]
    optimizer_over: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    sent_bytes: dict[int, int] = field(default_factory=dict)


@dataclass
class LayoutPrediction:
    """Every rank's predicted peak under a layout.

    Attributes:
        parallel: The layout.
        peak_bytes: Predicted peak per rank, in rank order (``parallel.world_size`` of them).
        roles: Each pipeline rank's costs (:class:`RoleCosts`), by pipeline index.
        in_flight: Each pipeline rank's most micro-batches in flight (chunks, with several
            stages per rank), by pipeline index.
        microbatch_size: Samples per micro-batch on a rank.
    """

    parallel: ParallelConfig
    peak_bytes: list[int]
    roles: dict[int, RoleCosts] = field(default_factory=dict)
    in_flight: dict[int, int] = field(default_factory=dict)
    microbatch_size: int = 0
    #: By pipeline index, the bytes by category at the rank's peak, where the prediction
    #: measured them (the PipeDream schedules, whose stashed weight versions show here).
    categories: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def max_peak_bytes(self) -> int:
        """The largest rank's peak: what must fit the per-rank budget."""
        return max(self.peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``predicted_peak_bytes`` per rank, the largest, the in-flight counts."""
        return {
            "predicted_peak_bytes": list(self.peak_bytes),
            "predicted_max_rank_peak_bytes": self.max_peak_bytes,
            "microbatch_size": self.microbatch_size,
            "in_flight_by_pipeline_rank": dict(self.in_flight),
        }


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class _Source:
    """How to build the model at any depth on fake tensors."""

    build: Callable[[int], nn.Module]  # depth -> model (inside the open fake mode)
    config: Any  # the HF config (for checks)
    num_blocks: int


def _source(model_or_workload: Any, batch_size: int | None,
            seq_len: int | None) -> tuple[_Source, int, int]:
    if isinstance(model_or_workload, str):
        model_or_workload = load_workload(model_or_workload, batch_size or 8, seq_len or 128)
    if isinstance(model_or_workload, Workload):
        w = model_or_workload
        if not w.scalable:
            raise LayoutError(f"workload {w.name!r} cannot be rebuilt at another depth; "
                              "predict_layout takes a preset, an HF config or the model")
        with _fake():
            config = w.with_depth(1).build_model().config
        return (_Source(lambda n: w.with_depth(n).build_model(), config, int(w.depth or 0)),
                batch_size or w.batch_size, seq_len or w.seq_len)
    config = getattr(model_or_workload, "config", None)
    key = next((k for k in _DEPTH_KEYS if isinstance(getattr(config, k, None), int)), None)
    if not isinstance(model_or_workload, nn.Module) or key is None:
        raise LayoutError(
            f"predict_layout takes a Hugging Face causal LM (Llama or GPT-2 layout), a Workload "
            f"or a preset name, got {type(model_or_workload).__name__}")
    if batch_size is None or seq_len is None:
        raise LayoutError("predict_layout needs batch_size and seq_len with a model")
    cls = type(model_or_workload)

    def build(n: int) -> nn.Module:
        cfg = copy.deepcopy(config)
        setattr(cfg, key, n)
        return _hf_model(cls, cfg)

    return _Source(build, config, int(getattr(config, key))), batch_size, seq_len


def _hf_model(cls: type, config: Any) -> nn.Module:
    """``cls(config)`` without weight initialisation (fake tensors have no values)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
    with no_init_weights():
        model = cls(config)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model.train()


def _shallow(parallel: ParallelConfig, num_blocks: int, mine: tuple[int, ...],
             depth: int | None) -> tuple[PipelineConfig, int, dict[int, int]]:
    """A pipeline config for a model in which this rank's stages hold ``depth`` blocks each
    (their real count when ``None``) and every other stage one: its cuts, the model's depth,
    and the real block count of each of this rank's stages."""
    full = pipeline_config(parallel)
    real = {s: len(full.stage_blocks(num_blocks, s)) for s in range(full.num_stages)}
    sizes = [(real[s] if depth is None else min(depth, real[s])) if s in mine else 1
             for s in range(full.num_stages)]
    cuts, at = [], 0
    for n in sizes[:-1]:
        at += n
        cuts.append(at)
    cfg = dataclasses.replace(full, cuts=tuple(cuts))
    return cfg, sum(sizes), {s: real[s] for s in mine}


# --------------------------------------------------------------------------- one role
def _make_optimizer(optimizer: str | OptimizerConfig | Callable[..., Any],
                    params: list[nn.Parameter], foreach: bool | None) -> Any:
    if callable(optimizer):
        return optimizer(params)
    config = OptimizerConfig(name=optimizer) if isinstance(optimizer, str) else optimizer
    if not optim_registry.get(config.name).layout:
        known = ", ".join(s.name for s in optim_registry.specs() if s.layout)
        raise LayoutError(f"predict_layout builds the optimizers the layout path trains with "
                          f"({known}) or takes a callable params -> optimizer, got "
                          f"{config.name!r}")
    return dataclasses.replace(config, foreach=foreach).build(params)


def _curve(tracker: Any) -> list[int]:
    """Live device bytes after each event stamp of ``tracker``'s run."""
    t = tracker.trace()
    delta = [0] * (t.num_events + 2)
    for nb, born, died, tier in zip(t.nbytes, t.birth, t.death, t.tier, strict=True):
        if tier:
            continue
        delta[born] += nb
        if died >= 0:
            delta[died] -= nb
    out, live = [], 0
    for d in delta:
        live += d
        out.append(live)
    return out


def _nbytes(ts: Any) -> int:
    total = 0
    for t in ts:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _role_costs(src: _Source, parallel: ParallelConfig, pipe_rank: int, depth: int | None,
                mb: int, seq_len: int, loss_fn: LossFn | None, optimizer: Any,
                foreach: bool | None,
                checkpointing: CheckpointConfig | None = None) -> tuple[RoleCosts, dict[int, int]]:
    """Run pipeline rank ``pipe_rank``'s program for two micro-batches on fake tensors and
    read its event costs; also return its stages' real block counts."""
    from torch.distributed.device_mesh import init_device_mesh

    world = parallel.world_size
    # dp 0, tp 0, and the last context chunk (the causal mask's fullest: it attends to all)
    c = parallel.context
    rank = (pipe_rank * parallel.data * c + c - 1) * parallel.tensor
    m = layout_microbatches(parallel)
    piped = parallel.pipeline > 1
    mine = pipeline_config(parallel).stage_indices(pipe_rank) if piped else (0,)
    with fake_process_group(world, rank):
        mesh = init_device_mesh("cpu", mesh_shape(parallel), mesh_dim_names=MESH_DIMS)
        # The replicas' mesh (dp, or dp and cp flattened), made outside the fake mode: the
        # mesh computes its ranks with tensor ops, which must be real.
        replicas = replica_mesh(mesh, parallel)
        with _fake():
            if piped:
                cfg, total, real = _shallow(parallel, src.num_blocks, mine, depth)
                model = src.build(total)
                stages = {s: build_stage(model, cfg, s) for s in mine}
                num_stages = cfg.num_stages
            else:
                n = src.num_blocks if depth is None else min(depth, src.num_blocks)
                model = src.build(n)
                stages, real, num_stages = {0: model}, {0: src.num_blocks}, 1
            del model
            if c > 1:  # the rank's chunk of every sample, and its share of the loss
                for stage in stages.values():  # each pipeline stage chunks on its own
                    loss_fn = apply_context_parallel(stage, mesh["cp"].get_group(),
                                                     parallel.context_mode).loss
            for stage in stages.values():
                if parallel.expert > 1:  # this rank's experts (build_layout's split)
                    from ..distributed.expert import apply_expert_parallel
                    from ..distributed.layout import data_groups

                    apply_expert_parallel(stage, parallel.expert, parallel.data, "cpu",
                                          data_groups(parallel))
                if parallel.tensor > 1:
                    config = TensorParallelConfig(parallel.tensor,
                                                  sequence_parallel=parallel.sequence)
                    apply_tensor_parallel(stage, config, mesh["tp"])
                if parallel.replicas > 1 and parallel.sharded:
                    from torch._subclasses.fake_tensor import unset_fake_temporarily

                    # FSDP2 computes the rank's mesh coordinates with tensor ops, which must be
                    # real; the parameters stay fake (their own mode follows them).
                    with unset_fake_temporarily():
                        _fully_shard(stage, parallel, replicas)
            if checkpointing is not None:  # as the trainer checkpoints the rank's modules
                checkpoint_layout_modules(list(stages.values()), checkpointing, parallel,
                                          mesh["tp"])
            if parallel.replicas > 1 and not parallel.sharded:
                # What DDP takes (the local shards under tensor parallelism), and runs.
                stages = {s: local_shards(st) for s, st in stages.items()}
            # Expert parallelism reads the routing's token counts: memfit's balanced policy.
            from .values import DryRunValues

            with DryRunValues() if parallel.expert > 1 else contextlib.nullcontext():
                costs = _run_role(stages, num_stages, parallel, mesh, m, mb, seq_len, loss_fn,
                                  optimizer, foreach, piped)
    return costs, real


def _run_role(stages: dict[int, nn.Module], num_stages: int, parallel: ParallelConfig,
              mesh: Any, m: int, mb: int, seq_len: int, loss_fn: LossFn | None,
              optimizer: Any, foreach: bool | None, piped: bool) -> RoleCosts:
    """Run two micro-batches through the rank's ``stages`` under the tracker, then the
    gradient reduction and the optimizer step, and read each event's costs off the trace."""
    from torch.distributed.fsdp import FSDPModule

    # torch's pipeline stage drives FSDP2 itself: no gradient sync and no resharding in each
    # micro-batch's backward, one reduction after the last (PipelineStage.perform_reduce_grad).
    fsdp = [st for st in stages.values() if piped and isinstance(st, FSDPModule)]
    params = list({id(p): p for stage in stages.values() for p in stage.parameters()}.values())
    opt, state_bytes = _primed_optimizer(optimizer, params, foreach)
    # DDP (ZeRO 0) cannot be built on fake tensors (its constructor reads values). Its memory
    # is its buckets: every gradient, contiguous, the .grad views of them, live for the whole
    # run (memfit.distributed.replicas keeps them so); the contiguous gradient buffer holds
    # exactly that, and DDP's all-reduce of them in place allocates nothing.
    buckets = [apply_grad_buffer(st) for st in stages.values()] \
        if parallel.replicas > 1 and not parallel.sharded else []
    if loss_fn is None:
        loss_fn = shifted_cross_entropy if parallel.tensor > 1 else causal_lm_loss
    run = _RoleRun(stages, num_stages, m, mb, seq_len, loss_fn, fsdp)
    if parallel.sequence and piped:
        run.sequence_split = parallel.tensor
    run.context = parallel.context
    run.release_outputs = stage_outputs_released() and not buckets
    ctx = contextlib.nullcontext()
    if parallel.tensor > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        ctx = loss_parallel()
    with track(None, opt) as tracker, ctx:
        run.tracker = tracker
        tracker.label(params, "parameters")
        tracker.label([list(b.buffers.values()) for b in buckets], "gradients")
        static = run.inputs_and_buffers(params)
        for i in range(min(m, 2)):
            run.forwards(i)
            run.backwards(i)
        run.losses.clear()  # kept by the schedule for the step (2.15: their inputs too)
        a = tracker.event_stamp
        for st in fsdp:
            _fsdp_reduce(st)
        grad_bytes = _scale_gradients(params, m)
        opt.step()
        run.marks["O"] = (a, tracker.event_stamp)
    for b in buckets:
        b.remove()
    costs = _read_costs(_curve(tracker), run.marks, stages, m, static=static,
                        parameter_bytes=_nbytes(params), gradient_bytes=grad_bytes,
                        state_bytes=state_bytes)
    return dataclasses.replace(costs, sent_bytes=dict(run.sent))


def _primed_optimizer(optimizer: Any, params: list[nn.Parameter],
                      foreach: bool | None) -> tuple[Any, int]:
    """The optimizer after the step before (its state made, the gradients set to ``None``),
    and its state's bytes."""
    opt = _make_optimizer(optimizer, params, foreach)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_bytes = _nbytes(t for s in opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor))
    return opt, state_bytes


class _RoleRun:
    """A pipeline rank's micro-batches through its stages, as torch's pipeline stage runs
    them, with each forward's and backward's span of the tracker's events in ``marks``."""

    def __init__(self, stages: dict[int, nn.Module], num_stages: int, m: int, mb: int,
                 seq_len: int, loss_fn: LossFn, fsdp: list[Any]) -> None:
        self.stages, self.num_stages, self.m, self.mb = stages, num_stages, m, mb
        self.seq_len, self.loss_fn, self.fsdp = seq_len, loss_fn, fsdp
        self.order = sorted(stages)
        self.tracker: Any = None
        self.marks: dict[Any, tuple[int, int]] = {}
        self.cache: dict[tuple[int, int], Any] = {}
        self.ids: Any = None  # the batch's input ids (first stage only)...
        self.labels: Any = None  # ...and labels (last stage only)
        self.recv: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_recv: dict[tuple[int, int], torch.Tensor] = {}
        self.sent: dict[int, int] = {}  # by stage: the input gradient a backward sends
        #: What the tokens passed between stages are divided by (the tensor degree under
        #: sequence parallelism, whose stages pass their local shards).
        self.sequence_split = 1
        #: The context degree: a stage passes its chunk of each sample.
        self.context = 1
        self.release_outputs = False  # torch 2.15 lets go of a sent output (not under DDP)
        self.losses: list[Any] = []  # the last stage's: their graphs hold their leaf inputs

    def inputs_and_buffers(self, params: list[nn.Parameter]) -> int:
        """Make the batch and the receive buffers; returns the live bytes then (the static)."""
        stages, m, mb, seq_len, tracker = self.stages, self.m, self.mb, self.seq_len, self.tracker
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        hf = next(iter(stages.values()))
        hf = getattr(hf, "inner", hf)  # DDP's LocalShards of a tensor-parallel stage
        hidden = getattr(getattr(hf, "hf_config", None) or getattr(hf, "config", None),
                         "hidden_size", None)
        first, last = min(stages) == 0, max(stages) == self.num_stages - 1
        local_batch = mb * m
        # The batch: input ids on the first stage, labels on the last (one tensor each).
        self.ids = torch.empty((local_batch, seq_len), dtype=torch.long) if first else None
        self.labels = torch.empty((local_batch, seq_len), dtype=torch.long) if last else None
        tracker.add_inputs((self.ids, self.labels))
        # torch's PipelineStage receives each micro-batch's input, and each output gradient,
        # into its own buffer; under sequence parallelism the stages pass their local sequence
        # shards (StageModule.sequence_mesh).
        tokens = seq_len // self.sequence_split // self.context
        self.buffer_shape, self.buffer_dtype = (mb, tokens, hidden), dtype
        if not receive_buffers_kept():
            return tracker.live_bytes  # torch 2.15: each made at its receive (_receive)
        # Up to torch 2.14: every micro-batch's, made at the first step and kept.
        for s in stages:
            for i in range(m):
                if s > 0:
                    self.recv[s, i] = self._buffer(requires_grad=True)
                if s < self.num_stages - 1:
                    self.grad_recv[s, i] = self._buffer()
        tracker.label((list(self.recv.values()), list(self.grad_recv.values())), "other")
        return tracker.live_bytes

    def _buffer(self, requires_grad: bool = False) -> torch.Tensor:
        return torch.empty(self.buffer_shape, dtype=self.buffer_dtype, requires_grad=requires_grad)

    def _receive(self, into: dict[tuple[int, int], torch.Tensor], s: int, i: int,
                 requires_grad: bool = False) -> torch.Tensor:
        """Stage ``s``'s receive buffer for micro-batch ``i`` in ``into``: the one made at the
        start (torch 2.13, 2.14), or, as torch 2.15 does, one made now and handed over."""
        if (s, i) in into:
            return into[s, i]
        buffer = self._buffer(requires_grad)
        self.tracker.label([buffer], "other")
        return buffer

    def forwards(self, i: int) -> None:
        """Micro-batch ``i``'s forward through each of the rank's stages, in order."""
        mb, tracker, cache = self.mb, self.tracker, self.cache
        for s in self.order:
            a = tracker.event_stamp
            if s == 0:
                x = self.ids[i * mb:(i + 1) * mb]
            elif s - 1 in self.stages:
                x = cache[s - 1, i][0]  # the same rank's previous stage feeds it directly
            else:
                x = self._receive(self.recv, s, i, requires_grad=True)
            out = self.stages[s](x)
            out = getattr(out, "logits", out)
            loss = None
            if s == self.num_stages - 1:
                loss = self.loss_fn(out, self.labels[i * mb:(i + 1) * mb])
            if self.release_outputs and loss is None and s + 1 not in self.stages and not \
                    isinstance(out, torch.distributed.tensor.DTensor):  # 2.15: sent, let go of
                out = torch.autograd.graph.get_gradient_edge(out)  # (the backward's root)
            cache[s, i] = (out, x, loss)
            self.marks["F", s, i] = (a, tracker.event_stamp)

    def backwards(self, i: int) -> None:
        """Micro-batch ``i``'s backward through each of the rank's stages, last first."""
        tracker = self.tracker
        for s in reversed(self.order):
            a = tracker.event_stamp
            out, x, loss = self.cache.pop((s, i))
            stage = self.stages[s]
            if stage in self.fsdp:
                stage.set_is_last_backward(False)
                stage.set_reshard_after_backward(False)
                stage.set_requires_gradient_sync(False)
            if loss is not None:
                loss.backward()
                self.losses += [loss] if self.num_stages > 1 and not receive_buffers_kept() else []
            elif s + 1 in self.stages:
                pass  # run with the next stage's backward, as one graph
            else:
                torch.autograd.backward(out, self._receive(self.grad_recv, s, i))
            grad_in = x.grad if x.requires_grad else None
            if grad_in is not None and s > 0 and s - 1 not in self.stages:
                self.sent[s] = _nbytes([grad_in])
            if x.requires_grad and x.is_leaf:
                x.grad = None  # sent to the previous stage: how long it lives is _replay's
            del out, x, loss, grad_in
            self.marks["B", s, i] = (a, tracker.event_stamp)


def _scale_gradients(params: list[nn.Parameter], m: int) -> int:
    """The schedule's scaling of the gradients by the micro-batch count, in place; returns
    the gradients' bytes. (The data-parallel reduction happened in backward: DDP's in its
    buckets, in place; FSDP2's by :func:`_fsdp_reduce`.)"""
    for p in params:
        if p.grad is not None:
            p.grad.div_(m)
    return _nbytes(p.grad for p in params if p.grad is not None)


def _read_costs(live: list[int], marks: dict[Any, tuple[int, int]],
                stages: dict[int, nn.Module], m: int, *, static: int, parameter_bytes: int,
                gradient_bytes: int, state_bytes: int) -> RoleCosts:
    """The events' costs from the live-bytes curve: each marked span's rise over its start
    (``over``) and its change (``delta``), beside the rank's own figures."""

    def over(key: Any) -> int:
        a, b = marks[key]
        return max(live[a:b + 1]) - live[a]

    def delta(key: Any) -> int:
        a, b = marks[key]
        return live[b] - live[a]

    later = 1 if m > 1 else 0
    return RoleCosts(
        static=static,
        forward_kept={s: delta(("F", s, 0)) for s in stages},
        forward_over={s: over(("F", s, 0)) for s in stages},
        backward_over={s: (over(("B", s, 0)), over(("B", s, later))) for s in stages},
        backward_delta={s: (delta(("B", s, 0)), delta(("B", s, later))) for s in stages},
        optimizer_over=over("O"),
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=state_bytes,
    )


def _fsdp_reduce(module: Any) -> None:
    """What ``PipelineStage.perform_reduce_grad`` does for an FSDP2 stage after its last
    backward: reduce-scatter the accumulated gradients and reshard."""
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _extrapolate(one: RoleCosts, two: RoleCosts, real: dict[int, int]) -> RoleCosts:
    """Costs at the stages' real block counts from runs at one and two blocks per stage: each
    per-stage figure linear in its stage's blocks, each rank figure in all its blocks."""
    extra = {s: n - 1 for s, n in real.items()}
    n_stages = len(real)

    def rank_level(a: int, b: int) -> int:
        return round(a + (b - a) * sum(extra.values()) / n_stages)

    def per(a: dict[int, Any], b: dict[int, Any]) -> dict[int, Any]:
        out = {}
        for s in a:
            if isinstance(a[s], tuple):
                out[s] = tuple(x + (y - x) * extra[s] for x, y in zip(a[s], b[s], strict=True))
            else:
                out[s] = a[s] + (b[s] - a[s]) * extra[s]
        return out

    return RoleCosts(
        static=rank_level(one.static, two.static),
        forward_kept=per(one.forward_kept, two.forward_kept),
        forward_over=per(one.forward_over, two.forward_over),
        backward_over=per(one.backward_over, two.backward_over),
        backward_delta=per(one.backward_delta, two.backward_delta),
        optimizer_over=rank_level(one.optimizer_over, two.optimizer_over),
        parameter_bytes=rank_level(one.parameter_bytes, two.parameter_bytes),
        gradient_bytes=rank_level(one.gradient_bytes, two.gradient_bytes),
        optimizer_state_bytes=rank_level(one.optimizer_state_bytes, two.optimizer_state_bytes),
        sent_bytes=dict(one.sent_bytes),  # a stage's input: the same at any depth
    )


def _replay(costs: RoleCosts, actions: list[tuple[str, int]],
            hold: str | None = None) -> tuple[int, int]:
    """The rank's peak over its schedule's actions, and its most chunks in flight.

    ``hold`` says how long a backward's input gradient, sent to the previous stage's rank,
    stays alive in torch's schedule: ``"next"`` (1F1B: its send operation is replaced after
    the stage's next backward), ``"step"`` (GPipe: every send's work is waited on after the
    last backward) or ``None`` (freed at once). All are gone before the optimizer step."""
    live = peak = costs.static
    started: set[int] = set()
    held: dict[int, int] = {}
    flight = most = 0
    for kind, s in actions:
        if kind == "F":
            peak = max(peak, live + costs.forward_over[s])
            live += costs.forward_kept[s]
            flight += 1
            most = max(most, flight)
        elif kind == "B":
            k = 1 if s in started else 0
            peak = max(peak, live + costs.backward_over[s][k])
            live += costs.backward_delta[s][k]
            started.add(s)
            flight -= 1
            sent = costs.sent_bytes.get(s, 0) if hold else 0
            if hold == "next":
                live += sent - held.get(s, 0)
                held[s] = sent
            elif hold == "step":
                live += sent
                held[s] = held.get(s, 0) + sent
            peak = max(peak, live)
    live -= sum(held.values())
    return max(peak, live + costs.optimizer_over), most


#: How long each single-stage schedule keeps a backward's sent input gradient (see
#: :func:`_replay`); the looped schedules' sends are not modelled.
SEND_HOLD = {"1f1b": "next", "gpipe": "step"}


def _actions(parallel: ParallelConfig, orders: dict[int, list[Any]] | None,
             pipe_rank: int) -> list[tuple[str, int]]:
    """The rank's forwards and backwards in order: torch's schedule's, or without a pipeline
    one micro-batch after another (gradient accumulation)."""
    if orders is None:
        m = layout_microbatches(parallel)
        return [a for _ in range(m) for a in (("F", 0), ("B", 0))]
    out = []
    for action in orders[pipe_rank]:
        if action is None:
            continue
        kind = str(action.computation_type).rsplit(".", 1)[-1]
        if kind in ("FORWARD", "F"):
            out.append(("F", action.stage_index))
        elif kind in ("FULL_BACKWARD", "B", "BACKWARD_INPUT", "I"):
            out.append(("B", action.stage_index))
    return out


# --------------------------------------------------------------------------- the API
def predict_layout(
    model_or_workload: nn.Module | Workload | str,
    parallel: ParallelConfig,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    optimizer: str | OptimizerConfig | Callable[[list[nn.Parameter]], Any] = "adamw",
    loss_fn: LossFn | None = None,
    foreach: bool | None = None,
    checkpointing: CheckpointConfig | str | None = None,
) -> LayoutPrediction:
    """Predict every rank's peak bytes for one training step under ``parallel``'s layout,
    without launching: each pipeline rank's real program on fake tensors in a fake process
    group (see the module docstring).

    The step predicted is a warm one, as :func:`~memfit.distributed.layout.build_layout`'s
    :meth:`~memfit.distributed.layout.Layout.step` runs it after the first: gradients set to
    ``None`` before it (at ZeRO 0 with data replicas, DDP's buckets, which hold them, stay),
    the optimizer's state already made; forwards and backwards in the schedule's order, the
    gradient reduction, the optimizer step.

    Args:
        model_or_workload: A Hugging Face causal LM of the Llama or GPT-2 layout (real, meta or
            fake: only its class and config are used), a :class:`~memfit.workload.Workload`
            or a preset name (``llama-70b``).
        parallel: The layout: ``data``, ``tensor``, ``pipeline`` degrees, ``schedule``,
            ``microbatches`` and ``zero_stage`` (0, 2 or 3).
        batch_size: The global batch (over all replicas); a workload's by default.
        seq_len: Tokens per sample; a workload's by default.
        optimizer: One the layout path trains with (the registry's ``layout`` ones: torch's
            AdamW, Adam, SGD), by name (its default settings: SGD without momentum keeps no
            state) or as a plan's ``OptimizerConfig`` (its settings), or a callable making
            the optimizer from the parameters.
        loss_fn: The last stage's loss, as given to ``build_layout`` (default: the causal LM's).
        foreach: The optimizer's ``foreach`` (``None``: torch's default for CPU tensors, the
            per-tensor loop; pass ``True`` for a CUDA target's default).
        checkpointing: The plan's activation checkpointing (a ``CheckpointConfig`` or a mode:
            ``full``, ``selective``), put on each rank's modules as the trainer does
            (:func:`~memfit.apply.layout.checkpoint_layout_modules`), with ZeRO-R's
            partitioned checkpoints when ``parallel.partition_activations``; ``None``: none.

    Returns:
        A :class:`LayoutPrediction`: ``peak_bytes`` per rank in rank order.

    Raises:
        LayoutError: for a layout that cannot work (:func:`~memfit.distributed.layout.
            check_layout`), or a model it cannot build at another depth.
        RuntimeError: inside a real process group (predict from a single process).
    """
    src, batch_size, seq_len = _source(model_or_workload, batch_size, seq_len)
    if isinstance(checkpointing, str):
        checkpointing = CheckpointConfig(mode=checkpointing)
    if checkpointing is not None and checkpointing.mode == "none":
        checkpointing = None
    if parallel.partition_activations and checkpointing is None:
        raise LayoutError("parallel partition_activations splits the checkpointed block inputs "
                          "and needs checkpointing; pass checkpointing='full'")
    check_layout(src.config, parallel, batch_size=batch_size, world_size=parallel.world_size,
                 num_blocks=src.num_blocks, seq_len=seq_len)
    m = layout_microbatches(parallel)
    mb = batch_size // (parallel.data * m)
    if parallel.schedule in PIPEDREAM_SCHEDULES:
        if checkpointing is not None:
            raise LayoutError(f"predict_layout does not model checkpointing under the "
                              f"{parallel.schedule} schedule yet; predict it without")
        return _predict_pipedream(src, parallel, mb, seq_len, loss_fn, optimizer, foreach)
    orders = _schedule_orders(pipeline_config(parallel)) if parallel.pipeline > 1 else None
    roles: dict[int, RoleCosts] = {}
    flights: dict[int, int] = {}
    peaks: dict[int, int] = {}
    for r in range(parallel.pipeline):
        costs, real = _role_costs(src, parallel, r, None if _exact(parallel, src, r) else 1,
                                  mb, seq_len, loss_fn, optimizer, foreach, checkpointing)
        if not _exact(parallel, src, r):
            two, _ = _role_costs(src, parallel, r, 2, mb, seq_len, loss_fn, optimizer, foreach,
                                 checkpointing)
            costs = _extrapolate(costs, two, real)
        roles[r] = costs
        hold = SEND_HOLD.get(parallel.schedule) if parallel.pipeline > 1 else None
        peaks[r], flights[r] = _replay(costs, _actions(parallel, orders, r), hold)
    per_rank = [peaks[layout_coords(g, parallel)["pp"]] for g in range(parallel.world_size)]
    return LayoutPrediction(parallel, per_rank, roles, flights, mb)


def _predict_pipedream(src: _Source, parallel: ParallelConfig, mb: int, seq_len: int,
                       loss_fn: LossFn | None, optimizer: Any,
                       foreach: bool | None) -> LayoutPrediction:
    """The PipeDream schedules: each rank's whole warm step run on fake tensors
    (:func:`~memfit.estimate.pipedream.pipedream_rank_peak`); a stage of more than
    :data:`EXACT_BLOCKS` blocks run at one and two and its peak extrapolated linearly."""
    from ..distributed.pipeline_plan import microbatches_in_flight

    peaks: dict[int, int] = {}
    cats: dict[int, dict[str, int]] = {}
    cfg = pipeline_config(parallel)
    for r in range(parallel.pipeline):
        def run(depth: int | None, r: int = r) -> tuple[int, dict[str, int]]:
            shallow, total, _ = _shallow(parallel, src.num_blocks, (r,), depth)
            return pipedream_rank_peak(
                lambda: src.build(total), shallow, r, mb, seq_len,
                lambda ps: _make_optimizer(optimizer, ps, foreach), loss_fn)

        if _exact(parallel, src, r):
            peaks[r], cats[r] = run(None)
            continue
        (one, c1), (two, c2) = run(1), run(2)
        extra = len(cfg.stage_blocks(src.num_blocks, r)) - 1
        peaks[r] = one + (two - one) * extra
        cats[r] = {k: c1[k] + (c2[k] - c1[k]) * extra for k in c1}
    flights = {r: microbatches_in_flight(parallel.schedule, parallel.pipeline,
                                         cfg.num_microbatches, r)
               for r in range(parallel.pipeline)}
    per_rank = [peaks[layout_coords(g, parallel)["pp"]] for g in range(parallel.world_size)]
    return LayoutPrediction(parallel, per_rank, {}, flights, mb, cats)


def _exact(parallel: ParallelConfig, src: _Source, pipe_rank: int) -> bool:
    if parallel.pipeline == 1:
        return src.num_blocks <= EXACT_BLOCKS
    cfg = pipeline_config(parallel)
    return all(len(cfg.stage_blocks(src.num_blocks, s)) <= EXACT_BLOCKS
               for s in cfg.stage_indices(pipe_rank))
