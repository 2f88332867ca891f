"""How a plan spreads training over processes: :class:`ParallelConfig`.

The field names are the plan JSON's (``parallel: {data: 8, zero_stage: 2}``). Data parallelism
and its ZeRO stages are built on torch.distributed (:mod:`memfit.distributed.data`):

* stage 0: ``DistributedDataParallel`` (bucketed all-reduce of gradients, each gradient a view
  into its bucket);
* stage 1: DDP plus ``ZeroRedundancyOptimizer`` (each rank holds the optimizer state of its
  share of the parameters and broadcasts their update);
* stage 2: FSDP2 (``fully_shard``) with ``reshard_after_forward=False``: parameters, gradients
  and state sharded at rest; a block's parameters, once gathered for its forward, stay whole
  until its backward (the ZeRO-2-like mode, no second all-gather);
* stage 3: FSDP2 with ``reshard_after_forward=True`` (ZeRO-3): parameters gathered block by
  block in forward and again in backward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["CONTEXT_MODES", "PIPEDREAM_SCHEDULES", "PIPELINE_SCHEDULES", "ZERO_STAGES",
           "ParallelConfig"]

MiB = 1 << 20

#: The ZeRO stages a plan may name.
ZERO_STAGES = (0, 1, 2, 3)

#: Pipeline schedules a plan may name, and the torch.distributed.pipelining class each runs on.
PIPELINE_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleZBVZeroBubble",
    # Asynchronous: torch has none; memfit's own (memfit.distributed.pipedream).
    "pipedream": "PipeDreamSchedule",
    "pipedream-2bw": "PipeDreamSchedule",
}

#: The asynchronous schedules (weights updated inside the step, without a flush).
PIPEDREAM_SCHEDULES = ("pipedream", "pipedream-2bw")

#: How a context-parallel group shares attention (:mod:`memfit.distributed.context`).
CONTEXT_MODES = ("ring", "all-to-all")


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallelism and ZeRO sharding.

    Attributes:
        data: Data-parallel degree (processes, one per device). Each process trains on
            ``batch / data`` samples of every batch; memory per process drops by the share of
            activations, and by the sharded model states of the ZeRO stage. Costs one
            all-reduce (or reduce-scatter + all-gather) of the gradients per step.
        zero_stage: 0 (DDP: every rank holds all parameters, gradients and optimizer state),
            1 (optimizer state sharded: saves ``(1 - 1/data)`` of it), 2 (gradients too, and
            FSDP2 keeps parameters whole only between a block's forward and backward), 3
            (parameters too: a few blocks' parameters whole at a time; two all-gathers of the
            parameters per step instead of one). See the module docstring for the engines.
        bucket_bytes: Gradient bucket size for DDP's all-reduce (stages 0 and 1). Larger
            buckets mean fewer, better-overlapped collectives and no more memory: DDP's buckets
            hold the gradients themselves.
        reshard_after_forward: Stage 3 only: free a block's gathered parameters after its
            forward (``True``, ZeRO-3; gathers again for backward) or keep them until its
            backward (``False``: the memory of every block's parameters at the forward's end,
            one all-gather fewer). Stage 2 always keeps them.
        backend: The process group backend, ``None`` for gloo on CPU and NCCL on CUDA.
        tensor: Tensor-parallel degree (Megatron-style: attention split by heads, the MLP by
            columns then rows, the vocabulary across ranks): parameters, gradients, states and
            most activations divided by it; two all-reduces per layer in forward and backward
            (within a node). The world is ``data x tensor x pipeline x context`` processes.
        pipeline: Pipeline-parallel degree: the blocks cut into this many stages, one per
            process; each holds its stage's states and its in-flight micro-batches' activations;
            idle for the bubble, about ``(pipeline - 1) / (microbatches + pipeline - 1)`` of a
            step.
        schedule: The pipeline schedule: ``gpipe`` (all forwards, then all backwards: every
            micro-batch's activations at once), ``1f1b`` (at most ``pipeline`` micro-batches
            in flight), ``interleaved-1f1b`` (several stages per process, a smaller bubble),
            ``zero-bubble`` (backward split into input and weight gradients to fill the bubble);
            and the asynchronous PipeDream schedules (:mod:`memfit.distributed.pipedream`,
            1F1B order, the optimizer stepped inside the schedule, pipeline and data
            replicas only):
            ``pipedream`` (weight stashing: an update after every micro-batch's backward,
            each micro-batch's backward on the weights its forward used; costs one stashed
            copy of the stage's parameters per version in flight, up to ``min(pipeline -
            r, microbatches)`` on rank ``r``, and an optimizer step per micro-batch) and
            ``pipedream-2bw`` (double-buffered: one update per step with the gradient of
            the previous version, ``W(t+1) = W(t) - lr grad(W(t-1))``; one stashed copy).
        microbatches: Micro-batches per step through the pipeline (``None``: ``2 x
            pipeline``); more shrinks the bubble and each micro-batch's activations.
        sequence: Megatron's sequence parallelism, with ``tensor > 1``: the norms, dropouts
            and residual stream between the blocks' attention and MLP hold ``sequence /
            tensor`` tokens per rank, which divides their activations (about ``2 x hidden``
            elements per token per block, plus dropout masks) by the tensor degree, and the
            last norm's output too. The same communication volume (each all-reduce becomes a
            reduce-scatter plus an all-gather); torch's ``SequenceParallel`` style does it.
            Under a pipeline the stages pass their local ``sequence / tensor`` tokens, so the
            inter-stage buffers shrink by the tensor degree too (the sequence length must be
            a multiple of it).
        cuts: Where the pipeline cuts the blocks: the first block of each stage after the
            first, ``stages - 1`` strictly increasing block indices (``stages`` is ``pipeline``,
            or ``2 x pipeline`` for ``interleaved-1f1b`` and ``zero-bubble``); ``(15, 31)``
            gives three stages blocks 0-14, 15-30 and 31 onwards. ``()``: an even split, the
            remainder one block each to the middle stages, so any block count works. Costs
            nothing at run time; it moves memory and time between stages: a stage's
            parameters, gradients, optimizer state and in-flight activations grow with its
            blocks, and the slowest stage sets the step. ``memfit plan`` picks cuts that
            equalise the stages' predicted peaks as far as the step time allows (the last
            stage's head and loss, or 1F1B's deeper in-flight queue on the first stages,
            otherwise make one rank the largest).
        context: Context-parallel degree: every sample's sequence cut into this many
            contiguous chunks, one per rank (:mod:`memfit.distributed.context`). Each rank's
            activations, and its logits, hold ``seq_len / context`` tokens, so a sample too
            long for one device trains; the parameters are replicated over the context ranks
            (ZeRO 2/3 shards them over ``data x context``), and their gradients are averaged
            over ``data x context`` like data parallelism's. Under a pipeline every stage
            runs the rank's chunk and the stages pass ``seq_len / context`` tokens. Costs
            the attention's
            communication: ``context - 1`` hops of every block's keys and values per forward
            (ring), twice that in backward (keys, values and their gradients), or four
            all-to-alls of the block's queries, keys, values and output (all-to-all).
        context_mode: ``ring`` (ring attention: the keys and values travel round the ranks,
            each rank merging its queries' partial softmaxes; holds two chunks' keys and values
            in flight beyond the plain attention) or ``all-to-all`` (Ulysses: queries, keys
            and values re-split from sequence chunks to head groups around attention, which
            then sees the whole sequence for ``heads / context`` heads; needs the heads per
            tensor rank divisible by ``context``; transient copies of the block's q, k, v and
            output).
        expert: Expert-parallel degree, for mixture-of-experts models: each MoE layer's
            experts are split over ``expert`` ranks carved out of the data-parallel ranks (as
            DeepSpeed-MoE and torchtitan do), so the expert parameters, gradients and optimizer
            state per rank are divided by ``expert`` (the router, attention and embeddings stay
            replicated). Each MoE layer costs two all-to-alls of the routed tokens (dispatch and
            combine) in forward and two in backward, within the expert group; the rank whose
            experts the router favours receives more tokens than its balanced share, which
            ``memfit profile --expert-load c`` and the per-rank prediction price.
        partition_activations: ZeRO-R's partitioned activation checkpoints (DeepSpeed's
            ``partition_activations``), with ``tensor > 1`` and the plan's checkpointing
            (``full`` or ``selective``): each checkpointed block input, the same on every
            tensor rank, is kept as ``1/tensor`` per rank (:mod:`memfit.distributed.partition`),
            which divides the checkpointed inputs per rank by the tensor degree; one block's
            input is whole again only while backward recomputes it. Costs one all-gather of
            each block's input per backward (``(tensor - 1) / tensor`` of its bytes received
            per rank). The gradients do not change. Not with ``sequence`` (its block inputs are
            split over the tensor group already).
        partition_offload: With ``partition_activations``: the slices wait in host memory
            (DeepSpeed's ``cpu_checkpointing``; page-locked on CUDA), so the checkpointed
            inputs leave the device altogether and take ``1/tensor`` of their bytes in host
            memory per rank. Costs a copy of each slice down in forward and up in backward.
        vertical_sync: PipeDream schedules only: every stage runs a micro-batch on the
            weight version stage 0 used for it (the version it entered the pipeline with),
            not its own newest. No time cost; memory: a later stage keeps its older versions
            until their micro-batches' backwards, up to the versions in flight on stage 0
            (``pipedream-2bw`` uses one version everywhere already: no change).
    """

    data: int = 1
    zero_stage: int = 0
    bucket_bytes: int = 25 * MiB
    reshard_after_forward: bool = True
    backend: str | None = None
    tensor: int = 1
    pipeline: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None
    sequence: bool = False
    cuts: tuple[int, ...] = ()
    context: int = 1
    context_mode: str = "ring"
    expert: int = 1
    partition_activations: bool = False
    partition_offload: bool = False
    vertical_sync: bool = False

    def problems(self) -> list[str]:
        """What is wrong with these settings, one sentence each (empty when valid)."""
        out = []
        if not isinstance(self.data, int) or isinstance(self.data, bool) or self.data < 1:
            out.append(f"parallel data must be a whole number >= 1, got {self.data!r}")
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            out.append(f"parallel zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            out.append(
                f"parallel bucket_bytes must be a whole number of bytes >= 1, got "
                f"{self.bucket_bytes!r}"
            )
        if not isinstance(self.reshard_after_forward, bool):
            out.append(
                "parallel reshard_after_forward must be true or false, got "
                f"{self.reshard_after_forward!r}"
            )
        for name in ("tensor", "pipeline", "context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"parallel {name} must be a whole number >= 1, got {v!r}")
        if self.schedule not in PIPELINE_SCHEDULES:
            out.append(
                f"parallel schedule {self.schedule!r} is not known; use one of "
                f"{', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.microbatches is not None and (
            not isinstance(self.microbatches, int) or self.microbatches < 1
        ):
            out.append(f"parallel microbatches must be a whole number >= 1 or null, got {self.microbatches!r}")
        if self.context_mode not in CONTEXT_MODES:
            out.append(
                f"parallel context_mode {self.context_mode!r} is not known; use one of "
                f"{', '.join(CONTEXT_MODES)}"
            )
        if not isinstance(self.sequence, bool):
            out.append(f"parallel sequence must be true or false, got {self.sequence!r}")
        elif self.sequence and self.tensor == 1:
            out.append(
                "parallel sequence splits the tensor-parallel group's norms along the sequence "
                "and needs tensor > 1; set tensor to 2 or more, or sequence false"
            )
        if self.backend not in (None, "gloo", "nccl"):
            out.append(f"parallel backend must be 'gloo', 'nccl' or null, got {self.backend!r}")
        out.extend(self._cut_problems())
        out.extend(self._expert_problems())
        out.extend(self._partition_problems())
        out.extend(self._pipedream_problems())
        return out

    def _partition_problems(self) -> list[str]:
        """ZeRO-R's partitioned checkpoints' settings (their need of checkpointing is the
        plan's check: :meth:`memfit.plan.Plan.validate`)."""
        for name in ("partition_activations", "partition_offload"):
            if not isinstance(getattr(self, name), bool):
                return [f"parallel {name} must be true or false, got {getattr(self, name)!r}"]
        if self.partition_offload and not self.partition_activations:
            return ["parallel partition_offload moves the partitioned activation checkpoints to "
                    "the host and needs partition_activations true; set it, or "
                    "partition_offload false"]
        if self.partition_activations and self.tensor == 1:
            return ["parallel partition_activations splits each checkpointed block input over "
                    "the tensor-parallel group and needs tensor > 1; set tensor to 2 or more, or "
                    "partition_activations false"]
        if self.partition_activations and self.sequence:
            return ["parallel partition_activations has nothing to split with sequence true (the "
                    "block inputs are split over the tensor-parallel group already); set one of "
                    "them false"]
        return []

    def _pipedream_problems(self) -> list[str]:
        """The asynchronous schedules' limits in memfit, and ``vertical_sync``'s form."""
        if not isinstance(self.vertical_sync, bool):
            return [f"parallel vertical_sync must be true or false, got {self.vertical_sync!r}"]
        if self.schedule not in PIPEDREAM_SCHEDULES:
            if self.vertical_sync:
                return [f"parallel vertical_sync applies to the pipedream schedules only "
                        f"(weight versions), not {self.schedule}; set vertical_sync false or "
                        f"schedule pipedream"]
            return []
        if self.pipeline == 1 or (self.tensor, self.context, self.expert) != (1, 1, 1):
            return [f"the {self.schedule} schedule runs a pipeline (pipeline >= 2, one stage "
                    f"per rank), with data replicas at most, in memfit (tensor, context and "
                    f"expert 1); use such a layout or a synchronous schedule such as 1f1b"]
        if self.data > 1 and self.zero_stage != 0:
            return [f"the {self.schedule} schedule all-reduces each update's gradients over "
                    f"the data replicas (ZeRO 0), it does not shard them; use zero_stage 0"]
        return []

    def _expert_problems(self) -> list[str]:
        """The expert degree's form (its fit to a model's experts is checked where the model
        is known: :func:`memfit.distributed.expert.apply_expert_parallel`)."""
        e = self.expert
        if not isinstance(e, int) or isinstance(e, bool) or e < 1:
            return [f"parallel expert must be a whole number >= 1, got {e!r}"]
        if e > 1 and isinstance(self.data, int) and self.data % e:
            return [f"parallel expert {e} must divide data {self.data} (the expert ranks are "
                    "carved out of the data-parallel ranks); use an expert degree that "
                    f"divides {self.data}"]
        return []

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: ``pipeline``, twice that for the schedules that place two
        stages on each rank (``interleaved-1f1b``, ``zero-bubble``)."""
        two = self.schedule in ("interleaved-1f1b", "zero-bubble")  # pipedream: one
        return self.pipeline * (2 if two and self.pipeline > 1 else 1)

    def _cut_problems(self) -> list[str]:
        """The cuts' form (their fit to a model's blocks is checked where the model is known:
        :func:`memfit.distributed.layout.check_layout`)."""
        cuts = self.cuts
        if not isinstance(cuts, tuple) or not cuts:
            return [] if cuts == () else [
                f"parallel cuts must be a tuple of block indices (a list in JSON) or empty, got "
                f"{cuts!r}"]
        if not isinstance(self.pipeline, int) or self.pipeline < 2:
            return [f"parallel cuts {list(cuts)} need a pipeline; leave cuts empty with "
                    f"pipeline {self.pipeline!r}"]
        n = self.num_stages - 1
        whole = all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
        if len(cuts) != n or not whole or cuts[0] < 1 or any(
                a >= b for a, b in itertools.pairwise(cuts)):
            what = "one block index" if n == 1 else f"{n} strictly increasing block indices"
            return [f"parallel cuts {list(cuts)} must be {what} >= 1 (the first block of each "
                    f"of the {self.schedule} pipeline's stages after the first), or empty for "
                    "an even split"]
        return []

    @property
    def world_size(self) -> int:
        """Processes the plan runs on: ``data x tensor x pipeline x context``."""
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def splits_model(self) -> bool:
        """Whether the plan trains through a layout (:func:`~memfit.distributed.layout.
        build_layout`): tensor, pipeline or context parallelism above 1."""
        return self.tensor > 1 or self.pipeline > 1 or self.context > 1

    @property
    def replicas(self) -> int:
        """Ranks that hold the same parameters and average their gradients: ``data x
        context`` (a context rank trains on its chunk of every sample, a data rank on its
        samples)."""
        return self.data * self.context

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: its pipeline ``stage``, data-parallel ``replica``,
        context-parallel ``chunk`` and tensor-parallel ``shard``. Tensor parallelism is
        innermost (its ranks consecutive, so within a node), context next (its ring or
        all-to-all per block wants the node's links too): ``rank = ((stage x data + replica)
        x context + chunk) x tensor + shard``."""
        t, c = self.tensor, self.context
        return {
            "stage": rank // (t * c * self.data),
            "replica": rank // (t * c) % self.data,
            "chunk": rank // t % c,
            "shard": rank % t,
        }

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the model (stages 2 and 3)."""
        return self.zero_stage >= 2

    @property
    def engine(self) -> str:
        """The torch.distributed engine this stage runs on, in words."""
        return {
            0: "DDP",
            1: "DDP + ZeroRedundancyOptimizer",
            2: "FSDP2 (reshard_after_forward=False)",
            3: f"FSDP2 (reshard_after_forward={self.reshard_after_forward})",
        }.get(self.zero_stage, "?")
