"""Tensor parallelism (Megatron-style) on PyTorch's DTensor: :func:`apply_tensor_parallel`.

Each block's attention is split by heads (query, key and value projections column-parallel,
the output projection row-parallel) and its MLP by columns then rows, so one block costs one
all-reduce in forward and one in backward per half. The token embedding is vocabulary-parallel
(each rank holds ``vocab / degree`` rows; the partial lookups are summed) and a causal LM's head
is column-parallel with its logits left sharded over the vocabulary, so the cross-entropy is
computed by :func:`torch.distributed.tensor.parallel.loss_parallel` and full-vocabulary logits
never exist on one rank.

With ``sequence_parallel`` the norms, dropouts and residual stream between the blocks' halves
hold ``sequence / degree`` tokens per rank (the all-reduce becomes a reduce-scatter plus an
all-gather, the same traffic): their activations are divided by the degree.

The sharding is torch's (``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``/``Output``); memfit supplies the plans for HF Llama,
GPT-2 and BERT (:func:`tp_plan_for`), checks divisibility before launch
(:func:`check_tensor_parallel`), fixes what HF forwards read about per-rank head counts, and
provides the parallel causal-LM loss (:meth:`TensorParallel.causal_lm_loss`). The one style of
its own, ``VocabParallelEmbedding``, is torch's ``RowwiseParallel`` for embeddings with the
lookup done on the local rows, so that the embedding's gradient is born shard-sized.

For 2-D parallelism pass the tensor-parallel sub-mesh of a 2-D mesh (``mesh["tp"]``) and shard
the result with FSDP2 over the other dimension afterwards; for 3-D, apply it to each pipeline
stage's module (the built-in plans' entries for modules a stage lacks are dropped).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TensorParallel",
    "TensorParallelConfig",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "shifted_cross_entropy",
    "supported_models",
    "tp_plan_for",
]


@dataclass(frozen=True)
class TensorParallelConfig:
    """How a model is split across the ranks of a tensor-parallel group.

    Attributes:
        degree: Ranks the weights are split across (the tensor-parallel mesh's size). The
            blocks' parameters, gradients and optimizer state, the embedding and head, and the
            attention and MLP activations are divided by it; costs two all-reduces of the
            ``batch x sequence x hidden`` activations per block in forward and two in backward,
            which wants a fast link (one node).
        sequence_parallel: Also split the norms, dropouts and residual stream along the
            sequence (Megatron's sequence parallelism). Divides their activations (about
            ``2 x hidden x tokens`` elements per block, plus dropout masks) by ``degree``; the
            same communication volume as without it (each all-reduce becomes a reduce-scatter
            and an all-gather). A sequence length ``degree`` does not divide is sharded unevenly
            (DTensor's ``torch.chunk`` rule).
        loss_parallel: Keep a causal LM's logits sharded over the vocabulary and compute the
            cross-entropy on the shards (:func:`~torch.distributed.tensor.parallel.loss_parallel`):
            each rank holds ``tokens x vocab / degree`` logits (and their softmax) instead of
            ``tokens x vocab``, for three small all-reduces of ``tokens`` values. When false the
            logits are gathered whole on every rank (the HF model's own loss then works).
    """

    degree: int
    sequence_parallel: bool = False
    loss_parallel: bool = True

    def problems(self) -> list[str]:
        """What is wrong with these settings, one sentence each (empty when valid)."""
        out = []
        if not isinstance(self.degree, int) or isinstance(self.degree, bool) or self.degree < 1:
            out.append(f"tensor-parallel degree must be a whole number >= 1, got {self.degree!r}")
        for name in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"tensor-parallel {name} must be true or false, got {getattr(self, name)!r}")
        return out


# --------------------------------------------------------------------------- model families
#: Model classes with a built-in plan, by family.
_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
    "BertForSequenceClassification": "bert",
}

#: The attention modules of each family and the attributes of theirs that count heads (or
#: head-sized widths) and must hold the per-rank value once the heads are split. transformers
#: 5 forwards reshape with ``-1`` and read none of them except GPT-2's ``split_size`` (the fused
#: q/k/v width); 4.x forwards reshape with ``num_heads`` and friends.
_LOCAL_ATTRS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"model.layers.*.self_attn": ("num_heads", "num_key_value_heads", "hidden_size")},
    "gpt2": {"transformer.h.*.attn": ("num_heads", "split_size")},
    "bert": {"bert.encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")},
}


def supported_models() -> tuple[str, ...]:
    """The model classes :func:`tp_plan_for` has a plan for."""
    return tuple(_FAMILIES)


def _family(model: nn.Module) -> str | None:
    from .pipeline import StageModule

    if isinstance(model, StageModule):
        # A pipeline stage keeps its model's module names, so the model's plan fits it.
        return model.family if model.family in _LOCAL_ATTRS else None
    for cls in type(model).__mro__:
        fam = _FAMILIES.get(cls.__name__)
        if fam is not None:
            return fam
    return None


def tp_plan_for(
    model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True
) -> dict[str, Any]:
    """The tensor-parallel plan for an HF Llama, GPT-2 or BERT model.

    The plan maps module names (``fnmatch`` patterns) to torch ``ParallelStyle`` objects, as
    ``parallelize_module`` takes it. Apply it with :func:`apply_tensor_parallel`, which also does
    what the plan alone cannot (GPT-2's conversion, head counts, tied weights).

    * ``LlamaForCausalLM``: ``q/k/v_proj`` and ``gate/up_proj`` column-parallel, ``o_proj`` and
      ``down_proj`` row-parallel, ``embed_tokens`` vocabulary-parallel (``VocabParallelEmbedding``,
      a ``RowwiseParallel`` on the embedding with replicated ids: each rank looks up its rows,
      the partial results are summed; see its docstring for why not torch's own), ``lm_head``
      column-parallel with logits sharded on the vocabulary (``Shard(-1)``) for the parallel
      loss.
    * ``GPT2LMHeadModel``: the same roles for ``c_attn`` (fused q/k/v), ``attn.c_proj``,
      ``mlp.c_fc``, ``mlp.c_proj``, ``wte`` and the tied ``lm_head``. GPT-2's ``Conv1D``
      layers store their weight transposed (``in x out``) and torch's styles take only
      ``nn.Linear``/``nn.Embedding``, so :func:`apply_tensor_parallel` first converts them to
      ``nn.Linear`` and reorders the fused q/k/v rows so that each rank's contiguous block holds
      its own heads' queries, keys and values (a plain column split would give rank 0 all the
      queries and half the keys).
    * ``BertForSequenceClassification``: ``attention.self.query/key/value`` column-parallel,
      ``attention.output.dense`` row-parallel, ``intermediate.dense`` column-parallel,
      ``output.dense`` row-parallel, ``word_embeddings`` vocabulary-parallel; the pooler and
      classifier stay replicated (small).

    Args:
        model: The model (its class, or a base class, is one of :func:`supported_models`).
        sequence_parallel: Plan sequence parallelism for the norms, dropouts and residuals.
        loss_parallel: Leave a causal LM's logits vocabulary-sharded (a DTensor) for
            :meth:`TensorParallel.causal_lm_loss`; false gathers them whole.

    Raises:
        ValueError: For a model without a built-in plan (give ``plan=`` to
            :func:`apply_tensor_parallel` instead).
    """
    fam = _family(model)
    if fam is None:
        raise ValueError(
            f"memfit has no tensor-parallel plan for {type(model).__name__} (it has plans for "
            f"{', '.join(_FAMILIES)}); pass plan={{module pattern: ParallelStyle}} to "
            "apply_tensor_parallel for another model."
        )
    return _PLANS[fam](sequence_parallel, loss_parallel)


def _head(sp: bool, lp: bool) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    # loss_parallel: logits stay a DTensor sharded on the vocabulary; otherwise gathered whole.
    return ColwiseParallel(
        input_layouts=Shard(1) if sp else Replicate(),
        output_layouts=Shard(-1) if lp else Replicate(),
        use_local_output=not lp,
    )


def _vocab_embedding(sp: bool) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    # Under sequence parallelism the output stays a DTensor: the model reads the sequence length
    # from it (position ids, the causal mask), which must be the global one.
    return _vocab_parallel_style()(
        output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp
    )


def _vocab_parallel_forward(self: nn.Embedding, ids: torch.Tensor) -> Any:
    """An embedding lookup on this rank's rows only: ids outside them give zeros, and the
    ranks' partial results sum to the whole lookup (returned as a ``Partial`` DTensor)."""
    from torch.distributed.tensor import DTensor, Partial

    if isinstance(ids, DTensor):
        ids = ids.full_tensor()
    weight = self.weight
    mesh = weight.device_mesh
    local = weight.to_local()  # its gradient comes back as this rank's shard (Shard(0))
    vocab = weight.shape[0]
    # DTensor shards like torch.chunk: ceil(vocab / ranks) rows each, the last ones fewer.
    start = min(vocab, mesh.get_local_rank() * -(-vocab // mesh.size()))
    outside = (ids < start) | (ids >= start + local.shape[0])
    pad = self.padding_idx
    if pad is not None and not start <= pad < start + local.shape[0]:
        pad = None
    elif pad is not None:
        pad -= start
    out = F.embedding((ids - start).masked_fill(outside, 0), local, pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


@functools.cache
def _vocab_parallel_style() -> type:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    class VocabParallelEmbedding(RowwiseParallel):
        """``RowwiseParallel`` for an ``nn.Embedding`` (vocabulary rows split), with the lookup
        done on each rank's local rows.

        torch's ``RowwiseParallel`` embedding is right in forward, but DTensor has no masked
        strategy for the embedding's backward: each rank computes the gradient of the *whole*
        ``vocab x hidden`` table and then keeps its rows, a transient as large as the unsplit
        model's embedding gradient. Here the lookup runs on the local shard (ids outside it
        masked), so the gradient is born shard-sized; the partial outputs are summed (or
        reduce-scattered over the sequence) by DTensor as ``RowwiseParallel`` does.

        Keyword Args:
            output_layouts: ``Replicate()`` (all-reduce) or ``Shard(1)`` (reduce-scatter over
                the sequence, for sequence parallelism).
            use_local_output: Return the local tensor rather than the DTensor.
        """

        def __init__(self, *, output_layouts: Any = None, use_local_output: bool = True) -> None:
            super().__init__(input_layouts=Replicate(), output_layouts=output_layouts,
                             use_local_output=use_local_output)

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            from functools import partial
            from types import MethodType

            from torch.distributed.tensor import distribute_module

            if not isinstance(module, nn.Embedding):
                raise NotImplementedError("VocabParallelEmbedding splits an nn.Embedding only.")
            if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
                raise ValueError(
                    "a vocabulary-parallel embedding cannot renormalise (max_norm), scale "
                    "gradients by frequency or be sparse."
                )
            distribute_module(
                module, device_mesh, self._partition_embedding_fn, None,
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )
            module.forward = MethodType(_vocab_parallel_forward, module)  # type: ignore[method-assign]
            return module

    return VocabParallelEmbedding


def __getattr__(name: str) -> Any:
    # The style subclasses torch's RowwiseParallel, imported only when asked for (importing
    # torch.distributed.tensor.parallel at memfit's import costs time every process pays).
    if name == "VocabParallelEmbedding":
        return _vocab_parallel_style()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _row(sp: bool) -> Any:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    # Under sequence parallelism the partial sums are reduce-scattered over the sequence and
    # stay a DTensor, so that the residual additions that follow are DTensor + DTensor.
    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()


def _gather_input(kwarg: str | None = None) -> Any:
    """All-gather a sequence-sharded input before a block half (sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if kwarg is not None:
        return PrepareModuleInput(
            input_kwarg_layouts={kwarg: Shard(1)},
            desired_input_kwarg_layouts={kwarg: Replicate()},
            use_local_output=True,
        )
    return PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )


def _shard_output() -> Any:
    """Turn a replicated plain output into a sequence-sharded DTensor (no communication)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    return PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
    )


def _llama_plan(sp: bool, lp: bool) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    layer = "model.layers.*"
    plan: dict[str, Any] = {"model.embed_tokens": _vocab_embedding(sp)}
    if sp:
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.self_attn": _gather_input("hidden_states"),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.mlp": _gather_input(),
            "model.norm": SequenceParallel(),
        })
    for name in ("q_proj", "k_proj", "v_proj"):
        plan[f"{layer}.self_attn.{name}"] = ColwiseParallel()
    plan[f"{layer}.self_attn.o_proj"] = _row(sp)
    plan[f"{layer}.mlp.gate_proj"] = ColwiseParallel()
    plan[f"{layer}.mlp.up_proj"] = ColwiseParallel()
    plan[f"{layer}.mlp.down_proj"] = _row(sp)
    plan["lm_head"] = _head(sp, lp)
    return plan


def _gpt2_plan(sp: bool, lp: bool) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    layer = "transformer.h.*"
    plan: dict[str, Any] = {"transformer.wte": _vocab_embedding(sp)}
    if sp:
        plan.update({
            # Position embeddings are small and replicated; their output is sliced to this
            # rank's tokens to add to the sequence-sharded token embeddings.
            "transformer.wpe": _shard_output(),
            f"{layer}.ln_1": SequenceParallel(),
            f"{layer}.attn": _gather_input(),
            f"{layer}.ln_2": SequenceParallel(),
            f"{layer}.mlp": _gather_input(),
            "transformer.ln_f": SequenceParallel(),
        })
    plan[f"{layer}.attn.c_attn"] = ColwiseParallel()
    plan[f"{layer}.attn.c_proj"] = _row(sp)
    plan[f"{layer}.mlp.c_fc"] = ColwiseParallel()
    plan[f"{layer}.mlp.c_proj"] = _row(sp)
    plan["lm_head"] = _head(sp, lp)
    return plan


def _bert_plan(sp: bool, lp: bool) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    layer = "bert.encoder.layer.*"
    plan: dict[str, Any] = {
        # The word embeddings are summed with position and token-type embeddings inside
        # BertEmbeddings, so the vocabulary-parallel lookup returns a replicated plain tensor;
        # under sequence parallelism the embeddings module's output is sliced afterwards.
        "bert.embeddings.word_embeddings": _vocab_embedding(False),
    }
    if sp:
        plan.update({
            "bert.embeddings": _shard_output(),
            f"{layer}.attention.self": _gather_input(),
            f"{layer}.attention.output.LayerNorm": SequenceParallel(),
            f"{layer}.intermediate": _gather_input(),
            f"{layer}.output.LayerNorm": SequenceParallel(),
            "bert.pooler": _gather_input(),
        })
    for name in ("query", "key", "value"):
        plan[f"{layer}.attention.self.{name}"] = ColwiseParallel()
    plan[f"{layer}.attention.output.dense"] = _row(sp)
    plan[f"{layer}.intermediate.dense"] = ColwiseParallel()
    plan[f"{layer}.output.dense"] = _row(sp)
    return plan


_PLANS: dict[str, Callable[[bool, bool], dict[str, Any]]] = {
    "llama": _llama_plan,
    "gpt2": _gpt2_plan,
    "bert": _bert_plan,
}


# --------------------------------------------------------------------------- checks
def _config_of(model_or_config: Any) -> Any:
    # A pipeline stage carries its model's HF config as ``hf_config``.
    for name in ("config", "hf_config"):
        cfg = getattr(model_or_config, name, None)
        if cfg is not None:
            return cfg
    return model_or_config


def _split_sizes(cfg: Any) -> dict[str, int]:
    """The sizes a tensor-parallel split must divide, by what they are called in an error."""
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    mlp = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
    if mlp is None and hidden is not None and getattr(cfg, "model_type", None) == "gpt2":
        mlp = 4 * hidden  # GPT-2's default inner width
    sizes = {"attention heads": heads, "key-value heads": kv, "MLP width": mlp}
    return {k: int(v) for k, v in sizes.items() if isinstance(v, int) and v > 0}


def check_tensor_parallel(model_or_config: Any, degree: int) -> None:
    """Refuse, before launch, a degree the model's shapes cannot be split by.

    The attention heads and key-value heads are split whole across the ranks and the MLP width
    by columns: each must be a multiple of ``degree``. The vocabulary need not be (GPT-2's
    50257 is odd): DTensor shards it unevenly, ``ceil(vocab / degree)`` rows per rank and fewer
    on the last, and the embedding and the parallel loss handle that; it must only have at least
    ``degree`` rows.

    Args:
        model_or_config: The model, or its HF config (``num_attention_heads``,
            ``num_key_value_heads``, ``intermediate_size`` or ``n_inner``, ``vocab_size``).
        degree: The tensor-parallel degree.

    Raises:
        ValueError: One sentence naming what the degree does not divide and the degrees that
            would work.
    """
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"tensor-parallel degree must be a whole number >= 1, got {degree!r}.")
    cfg = _config_of(model_or_config)
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and 0 < vocab < degree:
        raise ValueError(
            f"tensor-parallel degree {degree} is more than the {vocab} vocabulary rows to split; "
            f"use a degree of at most {vocab}."
        )
    sizes = _split_sizes(cfg)
    bad = {k: v for k, v in sizes.items() if v % degree}
    if not bad:
        return
    limit = min(sizes.values())
    works = [d for d in range(1, limit + 1) if all(v % d == 0 for v in sizes.values())]
    what = " and ".join(f"the {v} {k}" for k, v in bad.items())
    every = ", ".join(f"{v} {k}" for k, v in sizes.items())
    raise ValueError(
        f"tensor-parallel degree {degree} does not divide {what}; degrees that divide all of "
        f"{every} are {', '.join(map(str, works))}."
    )


# --------------------------------------------------------------------------- GPT-2 conversion
def _conv1d_to_linear(conv: nn.Module, perm: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` computing what HF's ``Conv1D`` did (its ``in x out`` weight transposed),
    with the output features reordered by ``perm`` when given."""
    w = conv.weight.detach().t()
    b = conv.bias.detach()
    if perm is not None:
        w, b = w[perm], b[perm]
    lin = nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    lin.weight.requires_grad_(conv.weight.requires_grad)
    lin.bias.requires_grad_(conv.bias.requires_grad)
    return lin


def _qkv_order(width: int, degree: int) -> torch.Tensor:
    """Row order for a fused ``[q; k; v]`` projection so that rank ``r``'s contiguous block of
    ``3 x width / degree`` rows is ``[q_r; k_r; v_r]`` (its own heads)."""
    per = width // degree
    idx = [torch.arange(part * width + r * per, part * width + (r + 1) * per)
           for r in range(degree) for part in range(3)]
    return torch.cat(idx)


def _convert_gpt2(model: nn.Module, degree: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Replace GPT-2's ``Conv1D`` layers in the blocks by ``nn.Linear``; return, per converted
    parameter name, how to turn a full tensor back into the original layout."""
    restore: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    width = _config_of(model).hidden_size
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ != "Conv1D":
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        fused = child == "c_attn"
        perm = _qkv_order(width, degree) if fused else None
        setattr(parent, child, _conv1d_to_linear(mod, perm))
        inv = torch.argsort(perm) if perm is not None else None
        restore[f"{name}.weight"] = (lambda t, inv=inv: (t[inv] if inv is not None else t).t())
        restore[f"{name}.bias"] = (lambda t, inv=inv: t[inv] if inv is not None else t)
    return restore


# --------------------------------------------------------------------------- apply
@dataclass
class TensorParallel:
    """A model split by :func:`apply_tensor_parallel`, and what training it needs.

    Attributes:
        model: The model, changed in place: split parameters are DTensors on ``mesh``.
        mesh: The one-dimensional tensor-parallel device mesh.
        config: The settings applied.
        plan: The ``parallelize_module`` plan applied.
    """

    model: nn.Module
    mesh: Any
    config: TensorParallelConfig
    plan: dict[str, Any]
    _restore: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context the loss, and its backward, must run in: ``loss_parallel()`` when the
        logits are vocabulary-sharded (its backward ops are only registered inside it)."""
        if self.config.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def causal_lm_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """Next-token cross-entropy, the HF causal LM's loss (mean over tokens not ignored).

        Shifts the labels rather than the logits (no copy of the logits), and on
        vocabulary-sharded logits computes the softmax on the shards under ``loss_parallel``:
        no rank holds ``tokens x vocab`` values. Call :meth:`backward` on the result (or call
        ``backward()`` inside :meth:`loss_context`).

        Args:
            logits: ``batch x sequence x vocab``, as the model returned them.
            labels: ``batch x sequence`` token ids (usually the input ids).
            ignore_index: Label value that does not count.
        """
        with self.loss_context():
            return shifted_cross_entropy(logits, labels, ignore_index)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` inside :meth:`loss_context`."""
        with self.loss_context():
            loss.backward()

    def _full(self, named: Iterator[tuple[str, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in named:
            if t is None:
                continue
            full = t.full_tensor() if _is_dtensor(t) else t
            fix = self._restore.get(name)
            out[name] = (fix(full) if fix is not None else full).detach()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, under the original model's names and layouts (GPT-2's
        ``Conv1D`` weights transposed back, the fused q/k/v rows in their original order).
        A collective: every rank of the mesh must call it."""
        return self._full(self.model.named_parameters())

    def full_grads(
        self, named: Iterable[tuple[str, torch.Tensor | None]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter's gradient whole, as :meth:`full_state_dict` lays out parameters
        (parameters without a gradient are left out). A collective, like it.

        Args:
            named: ``(name, gradient)`` pairs to gather instead of the parameters' ``.grad``
                (where another module holds them: DDP's local shards, see
                :class:`~memfit.distributed.replicas.LocalShards`).
        """
        if named is None:
            named = ((n, p.grad) for n, p in self.model.named_parameters())
        return self._full(iter(named))


def shifted_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The causal LM's next-token cross-entropy (mean over tokens not ignored), shifting the
    labels rather than the logits, so that vocabulary-sharded logits are never copied whole.

    On sharded logits it must run, and its backward too, inside
    :func:`~torch.distributed.tensor.parallel.loss_parallel` (:meth:`TensorParallel.
    loss_context`); :meth:`TensorParallel.causal_lm_loss` opens it, a pipeline's last stage
    runs under it for the whole schedule (:mod:`memfit.distributed.layout`).
    """
    target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
    # In fp32 as HF's loss (a no-op for fp32 logits; a shard's copy when sharded).
    return F.cross_entropy(logits.flatten(0, 1).float(), target, ignore_index=ignore_index)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _divide_attrs(model: nn.Module, attrs: dict[str, tuple[str, ...]], degree: int) -> None:
    for name, mod in model.named_modules():
        for pattern, names in attrs.items():
            if not fnmatch.fnmatch(name, pattern):
                continue
            for attr in names:
                v = getattr(mod, attr, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    if v % degree:
                        raise ValueError(
                            f"{name}.{attr} = {v} is not divisible by the tensor-parallel "
                            f"degree {degree}."
                        )
                    setattr(mod, attr, v // degree)


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs (alias, owner) of parameter names that share one tensor."""
    seen: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = seen.setdefault(id(p), name)
        if owner != name:
            pairs.append((name, owner))
    return pairs


def apply_tensor_parallel(
    model: nn.Module,
    config: TensorParallelConfig | int,
    mesh: Any = None,
    *,
    plan: dict[str, Any] | None = None,
    local_attrs: dict[str, tuple[str, ...]] | None = None,
) -> TensorParallel:
    """Split ``model`` across a tensor-parallel group, in place.

    Every rank of the group calls this with the same model (same weights; rank 0's are
    broadcast anyway). Create the optimizer afterwards: split parameters are new DTensor
    parameters. For 2-D parallelism pass ``mesh["tp"]`` of a 2-D mesh and call FSDP2's
    ``fully_shard`` with ``mesh["dp"]`` afterwards (blocks first, then the model).

    For a causal LM, call the model without ``labels`` and take the loss from
    :meth:`TensorParallel.causal_lm_loss` (the HF model's own loss would not run under
    ``loss_parallel`` and would gather the logits), then :meth:`TensorParallel.backward`.

    Seed every rank of the group alike (``torch.manual_seed``): dropout on activations that
    are replicated (or split by heads) draws from each rank's own generator, and replicated
    activations stay equal across ranks only if those draws agree. Under sequence parallelism
    the dropouts between block halves act on DTensors and draw through DTensor's RNG tracker.

    Args:
        model: An HF ``LlamaForCausalLM``, ``GPT2LMHeadModel`` or ``BertForSequenceClassification``
            (built-in plans), or any model with ``plan`` given.
        config: The settings, or just the degree.
        mesh: A one-dimensional ``DeviceMesh`` of ``config.degree`` ranks (a sub-mesh of a
            larger mesh is fine). ``None`` makes one over the whole default process group on the
            model's device type.
        plan: For another model: ``{module name pattern: ParallelStyle}`` as
            ``parallelize_module`` takes it (see :func:`tp_plan_for` for the built-in ones).
        local_attrs: For another model: ``{attention module pattern: attribute names}`` whose
            integer values (head counts, head-sized widths) its forward reads and that must
            become per-rank values (divided by the degree).

    Returns:
        A :class:`TensorParallel` with the causal-LM loss and full-tensor gathering.

    Raises:
        ValueError: When the degree does not divide the heads, MLP width or vocabulary (one
            sentence naming the degrees that would), when the mesh does not have ``degree``
            ranks, or for a model without a plan.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(config, int):
        config = TensorParallelConfig(config)
    problems = config.problems()
    if problems:
        raise ValueError(" ".join(problems))
    fam = _family(model)
    if plan is None:
        plan = tp_plan_for(model, sequence_parallel=config.sequence_parallel,
                           loss_parallel=config.loss_parallel)
        # A pipeline stage holds some of the blocks and perhaps no embedding or head: keep the
        # entries that name a module it has (a plan given by hand is taken as it is, and torch
        # warns about an entry that matches nothing).
        names = [n for n, _ in model.named_modules()]
        plan = {k: v for k, v in plan.items() if fnmatch.filter(names, k)}
        local_attrs = _LOCAL_ATTRS[fam] if fam else {}
    if fam is not None:
        check_tensor_parallel(model, config.degree)
    if mesh is None:
        mesh = _default_mesh(model, config.degree)
    if mesh.ndim != 1 or mesh.size() != config.degree:
        raise ValueError(
            f"the tensor-parallel mesh must be one-dimensional with {config.degree} ranks (the "
            f"degree), got shape {tuple(mesh.shape)}; pass mesh['tp'] of a larger mesh."
        )
    restore = _convert_gpt2(model, config.degree) if fam == "gpt2" else {}
    tied = _tied(model)
    parallelize_module(model, mesh, plan)
    # Each module's parameters were replaced separately, which unties shared ones (GPT-2's
    # lm_head and wte): tie them again, to the owner's new parameter when both are split the
    # same way (vocabulary rows both: Shard(0)).
    for alias, owner in tied:
        owner_p = model.get_parameter(owner)
        mod_name, _, pname = alias.rpartition(".")
        alias_p = model.get_parameter(alias)
        if _is_dtensor(owner_p) != _is_dtensor(alias_p) or (
            _is_dtensor(owner_p) and owner_p.placements != alias_p.placements
        ):
            raise ValueError(
                f"{alias} and {owner} share one tensor but the plan splits them differently; "
                "split both the same way (or untie them first)."
            )
        setattr(model.get_submodule(mod_name), pname, owner_p)
    _divide_attrs(model, local_attrs or {}, config.degree)
    if config.sequence_parallel and hasattr(model, "sequence_mesh"):
        # A pipeline stage passes its local sequence shard between stages (StageModule).
        model.sequence_mesh = mesh
    return TensorParallel(model, mesh, config, plan, restore)


def _default_mesh(model: nn.Module, degree: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"tensor parallelism over {degree} ranks needs a process group: launch with "
            f"`torchrun --nproc-per-node {degree}` (or pass a DeviceMesh)."
        )
    if dist.get_world_size() != degree:
        raise ValueError(
            f"the world has {dist.get_world_size()} processes but the tensor-parallel degree is "
            f"{degree}; pass mesh=init_device_mesh(..., (data, {degree}))['tp'] for a larger world."
        )
    device = next((p.device.type for p in model.parameters()), "cpu")
    return init_device_mesh(device, (degree,))
