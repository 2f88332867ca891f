"""Pipeline parallelism: a model's blocks cut into stages, one process per stage (or several).

memfit builds each rank's stage itself, without tracing, so any Hugging Face causal LM of the
GPT-2 or Llama layout (Llama, Mistral, Qwen2 share it) and any ``nn.Sequential`` stack works:

* stage 0 holds the embeddings and the first blocks, the last stage the final norm, the
  language-model head and (through the schedule's ``loss_fn``) the loss; the hidden states are
  what passes between stages. Every stage of a Llama-style model computes the rotary position
  embeddings itself from the position ids (they hold no parameters), and every stage builds the
  causal mask the model's own attention expects.
* A stage's parameters keep the model's own names (``transformer.h.2.attn.c_attn.weight``), so
  its state dict is a slice of the model's. A weight tied across stages (GPT-2's ``wte`` and
  ``lm_head``) is copied onto the later stage and the copies' gradients are summed after each
  step, so the copies stay equal.

The schedules are torch.distributed.pipelining's
(:data:`~memfit.distributed.config.PIPELINE_SCHEDULES` maps the names to them); every one
runs on CPU with gloo. The asynchronous PipeDream schedules, which torch lacks, are memfit's
own (:mod:`memfit.distributed.pipedream`). The settings, their checks and their theory (micro-batches
in flight per schedule, balanced cuts) are in :mod:`memfit.distributed.pipeline_plan`,
re-exported here; the predictions without launching in :mod:`memfit.estimate.pipeline`.

Limits: training over whole sequences with causal attention (no padding mask travels between
stages: mark padding with label ``-100``; no KV cache); with dropout, each rank draws its own
masks, so results match the unsplit model in distribution, not bit for bit. A stage is an
ordinary module, so memfit's checkpointing (its blocks are ``StageModule.block_names``) and
autocast apply to it; with data parallelism, each pipeline runs on its own process ``group``
(one dimension of a device mesh) and the stages' gradients are reduced across the replicas.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import PIPEDREAM_SCHEDULES, PIPELINE_SCHEDULES
from .pipeline_plan import (
    BlockCost,
    PipelineConfig,
    PipelineError,
    _whole,
    check_pipeline,
    choose_cuts,
    even_cuts,
    microbatches_in_flight,
    predict_stage_activations,
)

__all__ = [
    "PIPELINE_SCHEDULES",
    "BlockCost",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "StageModule",
    "build_pipeline",
    "build_stage",
    "causal_lm_loss",
    "check_pipeline",
    "choose_cuts",
    "even_cuts",
    "microbatches_in_flight",
    "model_blocks",
    "predict_stage_activations",
    "run_pipeline_step",
    "stage_of_parameter",
]

# ---------------------------------------------------------------------------- stages
@dataclass(frozen=True)
class _Layout:
    """Where a model keeps its parts (dotted paths) and how its stages run."""

    family: str  # "gpt2", "llama" or "sequential"
    blocks: str  # the blocks' container ("" for a Sequential: the model itself)
    first: tuple[str, ...] = ()  # modules only the first stage holds, in order of use
    last: tuple[str, ...] = ()  # modules only the last stage holds
    every: tuple[str, ...] = ()  # parameter-free modules every stage holds (rotary)


_GPT2 = _Layout("gpt2", "transformer.h", ("transformer.wte", "transformer.wpe", "transformer.drop"),
                ("transformer.ln_f", "lm_head"))
_LLAMA = _Layout("llama", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"),
                 ("model.rotary_emb",))


def _layout(model: nn.Module) -> _Layout:
    if isinstance(model, nn.Sequential):
        return _Layout("sequential", "")
    for layout in (_GPT2, _LLAMA):
        paths = (layout.blocks, *layout.first, *layout.last, *layout.every)
        if all(_get(model, path) is not None for path in paths):
            return layout
    raise PipelineError(
        f"memfit cannot cut {type(model).__name__} into pipeline stages: it splits Hugging Face "
        "causal LMs of the GPT-2 layout (transformer.h, wte, wpe, ln_f, lm_head) or the Llama "
        "layout (model.layers, embed_tokens, norm, rotary_emb, lm_head) and nn.Sequential "
        "stacks; write the model as an nn.Sequential of its layers"
    )


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units memfit cuts ``model`` between, with their qualified names: the decoder
    layers of a causal LM, the children of an ``nn.Sequential``.

    Raises:
        PipelineError: for a model memfit cannot split.
    """
    layout = _layout(model)
    container = _get(model, layout.blocks)
    prefix = f"{layout.blocks}." if layout.blocks else ""
    return [(prefix + name, child) for name, child in container.named_children()]


def _stage_units(model: nn.Module, layout: _Layout, config: PipelineConfig,
                 stage: int) -> list[tuple[str, nn.Module]]:
    """The (path, module) units stage ``stage`` holds, in order of use."""
    blocks = model_blocks(model)
    units: list[tuple[str, nn.Module]] = []
    if stage == 0:
        units += [(path, _get(model, path)) for path in layout.first]
    units += [(path, _get(model, path)) for path in layout.every]
    units += [blocks[i] for i in config.stage_blocks(len(blocks), stage)]
    if stage == config.num_stages - 1:
        units += [(path, _get(model, path)) for path in layout.last]
    return units


class StageModule(nn.Module):
    """One pipeline stage: the model's own modules for its blocks, under their own names.

    Attributes:
        stage_index: This stage's index.
        num_stages: Stages in the pipeline.
        family: ``gpt2``, ``llama`` or ``sequential`` (how the forward runs).
        block_names: Qualified names of the blocks it holds, in order.
        tied: Parameter names on this stage whose weight other stages hold too (GPT-2's tied
            embedding and head), each with the model's name of the weight; their gradients
            are summed across stages after each step (:func:`run_pipeline_step`).
    """

    def __init__(self, stage_index: int, num_stages: int, family: str,
                 hf_config: Any = None) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.family = family
        self.block_names: list[str] = []
        self.tied: dict[str, str] = {}
        # The Hugging Face config: the attention implementation, which decides the mask.
        self.hf_config = hf_config

    @property
    def is_first(self) -> bool:
        """Whether this stage takes the model's input."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage gives the model's output."""
        return self.stage_index == self.num_stages - 1

    def blocks(self) -> list[nn.Module]:
        """The blocks this stage runs, in order (checkpointing wraps these)."""
        return [_get(self, name) for name in self.block_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Input ids (first stage) or hidden states in; hidden states or logits (last) out."""
        if self.family == "sequential":
            for block in self.blocks():
                x = block(x)
            return x
        if self.is_first:
            x = self._embed(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = _causal_mask(self.hf_config, x, position_ids)
        kwargs: dict[str, Any] = {"attention_mask": mask, "use_cache": False}
        if self.family == "llama":
            kwargs["position_ids"] = position_ids
            kwargs["position_embeddings"] = self.model.rotary_emb(x, position_ids)
        for block in self.blocks():
            out = block(x, **kwargs)
            x = out[0] if isinstance(out, tuple) else out  # tuples before transformers 4.5x
        if self.is_last:
            norm = self.transformer.ln_f if self.family == "gpt2" else self.model.norm
            x = self.lm_head(norm(x))
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.family == "gpt2":
            t = self.transformer
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            return t.drop(t.wte(ids) + t.wpe(position_ids))
        return self.model.embed_tokens(ids)


def _causal_mask(hf_config: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The causal mask the model's attention implementation expects (``None`` where it applies
    causality itself, as SDPA does), built the way the model's own forward builds it."""
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError:  # older transformers: an additive 4-D mask works for every attention
        t = hidden.shape[1]
        full = torch.full((t, t), torch.finfo(hidden.dtype).min, device=hidden.device)
        return torch.triu(full, diagonal=1)[None, None].to(hidden.dtype)
    return create_causal_mask(config=hf_config, inputs_embeds=hidden, attention_mask=None,
                              past_key_values=None, position_ids=position_ids)


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    parent = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = parent._modules.get(part)
        if child is None:
            # Containers in between keep the model's own names; blocks' lists become Sequential
            # (memfit's block finder recognises them; nothing calls them whole).
            child = nn.Sequential() if part in ("h", "layers") else nn.Module()
            parent.add_module(part, child)
        parent = child
    parent.add_module(parts[-1], module)


def _holders(model: nn.Module, layout: _Layout,
             config: PipelineConfig) -> tuple[dict[int, list[int]], dict[int, str]]:
    """For each parameter (by id): the stages holding it, in order; and the model's names."""
    held: dict[int, list[int]] = {}
    for s in range(config.num_stages):
        ids = {id(p) for _, unit in _stage_units(model, layout, config, s)
               for p in unit.parameters()}
        for i in ids:
            held.setdefault(i, []).append(s)
    names = {id(p): n for n, p in model.named_parameters()}
    return held, names


def build_stage(model: nn.Module, config: PipelineConfig, stage_index: int) -> StageModule:
    """This stage's part of ``model``, holding the model's own modules (not copies).

    Stage 0 holds the embeddings and its blocks; the last stage its blocks, the final norm and
    the head (its output is the logits; the loss is the schedule's ``loss_fn``); a Llama-style
    stage holds the rotary embedding too. A weight an earlier stage holds as well (tied) is
    copied here, and named in :attr:`StageModule.tied`. Drop ``model`` afterwards: the stage
    references only its own modules, so the rest is freed.

    Args:
        model: A Hugging Face causal LM (GPT-2 or Llama layout) or an ``nn.Sequential``.
        config: The pipeline settings (its ``cuts``, or an even split).
        stage_index: Which stage, ``0 <= stage_index < config.num_stages``.

    Raises:
        PipelineError: for a model memfit cannot split or settings that cannot work.
    """
    layout = _layout(model)
    check_pipeline(len(model_blocks(model)), config)
    if not _whole(stage_index) or not 0 <= stage_index < config.num_stages:
        raise PipelineError(f"stage_index must be between 0 and {config.num_stages - 1}, got "
                            f"{stage_index!r}")
    held, names = _holders(model, layout, config)
    stage = StageModule(stage_index, config.num_stages, layout.family,
                        getattr(model, "config", None))
    block_paths = {name for name, _ in model_blocks(model)}
    for path, unit in _stage_units(model, layout, config, stage_index):
        originals = list(unit.parameters())
        borrowed = {id(p) for p in originals if held[id(p)][0] < stage_index}
        if borrowed:
            # Copy only the tied weights: every other tensor stays the model's own.
            memo = {id(t): t for t in [*originals, *unit.buffers()] if id(t) not in borrowed}
            unit = copy.deepcopy(unit, memo)
        for (name, _), orig in zip(unit.named_parameters(), originals, strict=True):
            if len(held[id(orig)]) > 1:
                stage.tied[f"{path}.{name}"] = names[id(orig)]
        _attach(stage, path, unit)
        if path in block_paths:
            stage.block_names.append(path)
    return stage


# ---------------------------------------------------------------------------- running
def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: token ``t`` predicts label ``t + 1``, mean over the
    labels that are not ``-100``, computed in fp32."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                       shift_labels.reshape(-1), ignore_index=-100)


@dataclass
class Pipeline:
    """A rank's share of a pipeline: its stage modules and the schedule that runs them.

    Attributes:
        config: The settings.
        rank: This process's rank in the pipeline group.
        stages: The stage modules this rank holds (one, or ``stages_per_rank``); their
            parameters are what this rank's optimizer steps.
        schedule: The torch.distributed.pipelining schedule.
        group: The pipeline's process group (``None``: the default group).
        ties: Tied weights held by more than one rank's stage: (local parameters, the group
            of the ranks holding it, or ``None`` when this rank holds every copy).
    """

    config: PipelineConfig
    rank: int
    stages: list[StageModule]
    schedule: Any
    group: Any = None
    ties: list[tuple[list[nn.Parameter], Any]] = field(default_factory=list)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (for its optimizer)."""
        seen: dict[int, nn.Parameter] = {}
        for stage in self.stages:
            for p in stage.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    @property
    def has_first(self) -> bool:
        """Whether this rank holds the first stage (it is given the inputs)."""
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        """Whether this rank holds the last stage (it is given the targets)."""
        return any(s.is_last for s in self.stages)


def build_pipeline(model: nn.Module, config: PipelineConfig, *,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   group: Any = None, device: torch.device | str | None = None,
                   prepare: Callable[[StageModule], Any] | None = None) -> Pipeline:
    """Build this rank's stages of ``model`` and the schedule that runs them.

    Every rank of ``group`` calls this with the same model (same seed or weights) and config.

    Args:
        model: A Hugging Face causal LM (GPT-2 or Llama layout) or an ``nn.Sequential``.
        config: The pipeline settings; ``config.degree`` must equal the group's size.
        loss_fn: ``loss_fn(output, target)`` on the last stage, a mean over the micro-batch
            (gradients are divided by the micro-batch count). Default for causal LMs:
            :func:`causal_lm_loss`; an ``nn.Sequential`` must name its own.
        group: The pipeline's process group (default: the whole world).
        device: Where the stages run (default: the model's device).
        prepare: Called on each stage module before torch's ``PipelineStage`` wraps it, to
            change it in place (tensor parallelism, FSDP2 sharding: what
            :mod:`memfit.distributed.layout` applies per stage); a module it returns (DDP
            around the stage) is what the ``PipelineStage`` runs instead of the stage.

    Raises:
        PipelineError: for a model memfit cannot split, settings that cannot work or a group
            of the wrong size.
    """
    from torch.distributed import pipelining

    layout = _layout(model)
    check_pipeline(len(model_blocks(model)), config)
    world = dist.get_world_size(group)
    if world != config.degree:
        raise PipelineError(f"the pipeline degree is {config.degree} but its process group has "
                            f"{world} ranks; start {config.degree} processes per pipeline")
    if loss_fn is None:
        if layout.family == "sequential":
            raise PipelineError("an nn.Sequential pipeline needs a loss_fn(output, target) "
                                "for its last stage")
        loss_fn = causal_lm_loss
    rank = dist.get_rank(group)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device(device)
    indices = config.stage_indices(rank)
    stages = [build_stage(model, config, s) for s in indices]
    runs: list[nn.Module] = list(stages)
    if prepare is not None:
        for i, stage in enumerate(stages):
            wrapper = prepare(stage)
            if isinstance(wrapper, nn.Module):
                runs[i] = wrapper
    ties = _tie_groups(model, layout, config, stages, rank, group)
    if config.schedule in PIPEDREAM_SCHEDULES:
        return Pipeline(config, rank, stages, _pipedream(config, runs[0], rank, loss_fn, group,
                                                         model, layout), group, ties)
    torch_stages = [pipelining.PipelineStage(m, s, config.num_stages, device, group=group)
                    for m, s in zip(runs, indices, strict=True)]
    cls = getattr(pipelining, PIPELINE_SCHEDULES[config.schedule])
    single = config.schedule in ("gpipe", "1f1b")
    schedule = cls(torch_stages[0] if single else torch_stages, config.num_microbatches,
                   loss_fn=loss_fn)
    return Pipeline(config, rank, stages, schedule, group, ties)


def _pipedream(config: PipelineConfig, stage: nn.Module, rank: int,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: Any,
               model: nn.Module, layout: _Layout) -> Any:
    """memfit's PipeDream schedule for this rank's stage (torch has no asynchronous one)."""
    from .pipedream import PipeDreamSchedule

    held, _ = _holders(model, layout, config)
    if any(len(stages) > 1 for stages in held.values()):
        raise PipelineError(
            f"the {config.schedule} schedule updates each stage's weights on its own, so a "
            "weight tied across stages (GPT-2's embedding and head) would drift apart; untie "
            "it (tie_word_embeddings=False) or use a synchronous schedule such as 1f1b")
    return PipeDreamSchedule(stage, config.degree, rank, config.num_microbatches,
                             config.schedule, loss_fn, group, config.vertical_sync)


def stage_of_parameter(model: nn.Module, config: PipelineConfig) -> Callable[[str], int]:
    """The stage holding each of ``model``'s parameters under ``config`` (its first holder),
    by the model's names (:func:`memfit.distributed.pipedream.pipedream_reference`)."""
    held, names = _holders(model, _layout(model), config)
    where = {names[i]: stages[0] for i, stages in held.items()}
    return where.__getitem__


def _tie_groups(model: nn.Module, layout: _Layout, config: PipelineConfig,
                stages: list[StageModule], rank: int, group: Any) -> list[tuple[list[Any], Any]]:
    """For each tied weight: this rank's copies, and a group of the ranks holding one."""
    out = []
    held, names = _holders(model, layout, config)
    ties = {names[i]: stages for i, stages in held.items() if len(stages) > 1}
    everyone = set(range(config.degree))
    for name, holders in sorted(ties.items()):
        ranks = sorted({config.rank_of_stage(s) for s in holders})
        local = [p for st in stages for n, p in st.named_parameters()
                 if st.tied.get(n) == name]
        sub = None
        if set(ranks) == everyone:
            sub = group if group is not None else dist.group.WORLD
        elif len(ranks) > 1:
            global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                            for r in ranks]
            # Only the ranks holding a copy take part (local synchronisation).
            sub = dist.new_group(global_ranks, use_local_synchronization=True) \
                if rank in ranks else None
        if local:
            out.append((local, sub))
    return out


def run_pipeline_step(pipeline: Pipeline, inputs: torch.Tensor | None = None,
                      targets: torch.Tensor | None = None) -> torch.Tensor:
    """Run one training step's forwards and backwards through the pipeline.

    The batch is split into ``microbatches`` equal micro-batches along its first dimension;
    the last stage's ``loss_fn`` gives each micro-batch's loss and the gradients are their
    mean's (each stage divides its gradients by the micro-batch count), so they equal the
    unsplit model's on the whole batch when the loss is a mean over equal micro-batches.
    Gradients accumulate into ``.grad``: zero them before each step. Tied weights' gradients
    are summed across their copies afterwards. Step the optimizer over
    :meth:`Pipeline.parameters` after this.

    Args:
        pipeline: This rank's :class:`Pipeline`.
        inputs: The batch (input ids for a causal LM), on the rank holding the first stage;
            ignored elsewhere.
        targets: The targets (labels), on the rank holding the last stage; ignored elsewhere.

    Returns:
        The step's loss (mean over micro-batches), on every rank (sent from the last stage).

    Raises:
        PipelineError: when the batch does not split into the micro-batches.
    """
    m = pipeline.config.num_microbatches
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {"return_outputs": False}
    for name, t, needed in (("inputs", inputs, pipeline.has_first),
                            ("targets", targets, pipeline.has_last)):
        if not needed:
            continue
        if t is None:
            raise PipelineError(f"the rank holding the {'first' if name == 'inputs' else 'last'}"
                                f" stage must be given the {name}")
        if t.shape[0] % m or t.shape[0] < m:
            raise PipelineError(f"a batch of {t.shape[0]} does not split into {m} equal "
                                f"micro-batches; use a batch that is a multiple of {m} or "
                                f"microbatches dividing {t.shape[0]}")
    losses: list[torch.Tensor] = []
    if pipeline.has_first:
        args = (inputs,)
    if pipeline.has_last:
        kwargs.update(target=targets, losses=losses)
    pipeline.schedule.step(*args, **kwargs)
    _sum_tied_grads(pipeline)
    device = next((p.device for p in pipeline.parameters()), torch.device("cpu"))
    loss = (torch.stack([_plain(x).float() for x in losses]).mean() if losses
            else torch.zeros((), device=device))
    last_rank = pipeline.config.rank_of_stage(pipeline.config.num_stages - 1)
    src = dist.get_global_rank(pipeline.group, last_rank) if pipeline.group is not None \
        else last_rank
    dist.broadcast(loss, src=src, group=pipeline.group)
    return loss


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor: a DTensor (a loss under tensor parallelism, replicated) whole."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (sharing its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sum_tied_grads(pipeline: Pipeline) -> None:
    for params, group in pipeline.ties:
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.stack(grads).sum(0) if grads else torch.zeros_like(params[0])
        if group is not None:
            # Under tensor parallelism each copy's shard is reduced with the same shard's.
            dist.all_reduce(_local(total), group=group)
        for p in params:
            if p.grad is not None:
                # In place: a gradient that is a view of DDP's bucket must stay one.
                p.grad.copy_(total)
            else:
                p.grad = total.clone() if len(params) > 1 else total
