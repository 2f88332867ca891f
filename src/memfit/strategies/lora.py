"""LoRA and QLoRA: train low-rank adapters beside a frozen (optionally 4-bit) base.

LoRA (Hu et al., 2021) freezes every weight of the model and adds, beside each targeted linear
layer ``W`` (``out x in``), two small matrices ``A`` (``r x in``) and ``B`` (``out x r``) whose
product, scaled by ``alpha / r``, is added to the layer's output. ``B`` starts at zero, so the
model's output at the start equals the base model's. Only ``A`` and ``B`` train: the base has no
gradient and no optimizer state, so under AdamW a base weight costs its 4 bytes (2 in half
precision) instead of 16, and the adapters cost ``r x (in + out)`` parameters per layer times
(weight + gradient + optimizer state) bytes. Backward still runs through every layer (the
activations' gradients) but computes no weight gradient of the base: about a third of the
backward's matmuls less.

The adapters are ``peft``'s (a maintained library, the optional extra ``memfit[peft]``): its
``LoraModel`` injects them into the model in place, so the model object that
:func:`memfit.apply_plan` was given stays the one trained, and its
:meth:`LoraHandle.remove` unloads them (the base layers go back, the adapters are dropped,
nothing is merged). DoRA (``use_dora``) is peft's too.

QLoRA (Dettmers et al., 2023; ``quantize_base="nf4"``) also stores each targeted layer's frozen
weight as 4-bit NormalFloat, 64 weights per block, with the blocks' scales quantised again to
8 bits (double quantisation, 256 scales per block of scales): 0.5 bytes per weight plus about
1/64 byte of scales, where bf16 takes 2. Each forward and backward dequantises one layer's
weight at a time (a temporary of the layer's size in the compute dtype). The implementation is
torchao's ``NF4Tensor``, not bitsandbytes': it is a tensor subclass made of ordinary tensors
whose operations are plain ATen ops, so it quantises, trains and dequantises on CPU (CI has no
GPU), and it runs unchanged under ``FakeTensorMode``, so a dry run of a QLoRA model is exact to
the byte like any other (bitsandbytes' ``Params4bit`` calls its own kernels, which fake tensors
cannot run). On CUDA the same code runs on the GPU, as plain ATen ops (the dequantisation is
:func:`memfit.strategies.nf4.dequantize`, a chunk at a time); bitsandbytes' fused 4-bit CUDA
kernels are not used yet, so a GPU step dequantises at memory bandwidth rather than in the
matmul's kernel (the same bytes: one layer's weight in the compute dtype at a time).

Under a mixed-precision plan (``bf16-mixed``, ``fp16-mixed``), the frozen base is stored in the
half dtype: it never updates, so the fp32 master weights mixed precision keeps for the updates
would only cost memory (2 bytes per base weight less); its matmuls run in the half dtype under
autocast anyway. The adapters stay fp32 (they train). Under ``bf16-pure`` the precision
technique casts everything, adapters included; under ``fp32`` nothing is cast.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..techniques import ApplyContext, Technique
from . import nf4 as _nf4

__all__ = [
    "ADAPTER_NAME",
    "LoraConfig",
    "LoraHandle",
    "adapter_state",
    "apply_lora",
    "find_lora",
    "linear_names",
    "load_adapter_state",
    "resolve_targets",
    "save_adapter",
]

#: The adapter's name inside peft (peft's own default, so ``PeftModel.from_pretrained`` of a
#: saved adapter finds it under the name it expects).
ADAPTER_NAME = "default"
_QUANTIZE = ("nf4",)
_SHOWN = 12  # linear layers listed in an error message
#: Words that mark a module as part of attention, for ``target_modules="attention"``.
_ATTENTION_WORDS = ("attn", "attention")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a frozen base (see :mod:`memfit.strategies.lora`).

    Attributes:
        rank: The adapters' rank ``r``. Memory: ``r x (in + out)`` adapter parameters per
            targeted layer, each with its gradient and optimizer state (16 bytes under fp32
            AdamW); time: two thin matmuls per targeted layer, small beside the layer's own.
        alpha: Scale of the adapters' output (``alpha / rank``). No memory or time cost.
        dropout: Dropout on the adapters' input (0: none). Memory: one mask (a bool per input
            element) per targeted layer kept for backward while it is above 0; no extra time
            worth counting.
        target_modules: Which linear layers get adapters: ``"all-linear"`` (every linear
            layer but the output head), ``"attention"`` (the linear layers inside attention
            modules: q, k, v and o), or names: a layer's own name (``q_proj``), a qualified
            name, or an ``fnmatch`` pattern over qualified names. More layers: more adapter
            parameters and, under QLoRA, more of the base in 4 bits.
        use_dora: Weight-decomposed adapters (DoRA, peft's): one magnitude vector per layer
            more, and each forward computes the adapted weight's column norms (a temporary of
            the layer's weight size: more time and memory than LoRA).
        quantize_base: ``"nf4"`` stores each targeted layer's frozen weight in 4-bit NF4 with
            double-quantised scales (QLoRA): 0.5 bytes per weight plus about 1/64 byte of
            scales, instead of 2 (bf16) or 4 (fp32); each forward and backward dequantises one
            layer at a time. ``None``: the base stays in its dtype.
        quantize_embeddings: With ``quantize_base``, store the frozen input embedding table
            in NF4 too (0.5 bytes per weight plus scales instead of 2 in bf16: 0.7 GiB less
            for a 128k x 4096 table); a lookup dequantises only the rows it reads. Not part of
            the QLoRA paper (which keeps the embeddings in bf16): it rounds the inputs of the
            first layer to 4 bits. A table tied to the output head is left alone.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    use_dora: bool = False
    quantize_base: str | None = None
    quantize_embeddings: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora rank must be a whole number >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        t = self.target_modules
        if not (isinstance(t, str) and t) and not (
            isinstance(t, tuple) and t and all(isinstance(n, str) and n for n in t)
        ):
            raise ValueError(
                "lora target_modules must be 'all-linear', 'attention' or a list of module "
                f"names, got {t!r}"
            )
        if not isinstance(self.use_dora, bool):
            raise ValueError(f"lora use_dora must be true or false, got {self.use_dora!r}")
        if self.quantize_base is not None and self.quantize_base not in _QUANTIZE:
            raise ValueError(
                f"lora quantize_base {self.quantize_base!r} is not known; use 'nf4' (QLoRA) or "
                "null (the base stays in its dtype)"
            )
        if not isinstance(self.quantize_embeddings, bool) or (
            self.quantize_embeddings and not self.quantize_base
        ):
            raise ValueError(
                "lora quantize_embeddings must be true or false, and true only with "
                f"quantize_base 'nf4', got {self.quantize_embeddings!r}"
            )
        if self.quantize_base and self.use_dora:
            raise ValueError(
                "lora use_dora cannot be combined with quantize_base 'nf4': DoRA reads the "
                "base weight's norms, which peft cannot take of a 4-bit weight; set one of them off"
            )

    def targets(self) -> tuple[str, ...]:
        """``target_modules`` as a tuple of specs."""
        t = self.target_modules
        return (t,) if isinstance(t, str) else t

    def summary(self) -> str:
        """How a plan's one-line summary names this config."""
        name = "QLoRA (nf4)" if self.quantize_base else "LoRA"
        targets = ",".join(self.targets())
        return (
            f"{name} r{self.rank} on {targets}"
            + (" (DoRA)" if self.use_dora else "")
            + (", 4-bit embeddings" if self.quantize_embeddings else "")
        )


def _peft() -> Any:
    from ..extras import import_extra

    return import_extra("peft", "LoRA (a plan's lora, --allow lora or qlora)")


# ---------------------------------------------------------------------------- targets
def _linear_types() -> tuple[type, ...]:
    """``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's linear layers, weight ``in x out``),
    the layers peft puts LoRA adapters on."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


def _is_conv1d(module: nn.Module) -> bool:
    return not isinstance(module, nn.Linear) and isinstance(module, _linear_types())


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s linear layers (``nn.Linear``, GPT-2's ``Conv1D``), in
    model order."""
    kinds = _linear_types()
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


def _head_names(model: nn.Module) -> set[str]:
    """The output head's module names (``all-linear`` leaves it alone, as peft does): the
    module of ``get_output_embeddings()``, or one named ``lm_head``."""
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError):
            head = None
    return {
        name
        for name, m in model.named_modules()
        if (head is not None and m is head) or name.rpartition(".")[2] == "lm_head"
    }


def resolve_targets(model: nn.Module, config: LoraConfig) -> list[str]:
    """The qualified names of the linear layers ``config`` puts adapters on.

    Raises:
        ValueError: when a spec matches no linear layer, naming the model's linear layers.
    """
    linears = linear_names(model)
    head = _head_names(model)
    chosen: set[str] = set()
    for spec in config.targets():
        if spec == "all-linear":
            found = {n for n in linears if n not in head}
        elif spec == "attention":
            found = {
                n
                for n in linears
                if any(w in part.lower() for part in n.split(".")[:-1] for w in _ATTENTION_WORDS)
            }
        else:
            found = {
                n
                for n in linears
                if n == spec
                or n.rpartition(".")[2] == spec
                or fnmatch.fnmatchcase(n, spec)
            }
        if not found:
            raise ValueError(_nothing_matched(spec, model, linears))
        chosen |= found
    return [n for n in linears if n in chosen]


def _nothing_matched(spec: str, model: nn.Module, linears: list[str]) -> str:
    own = list(dict.fromkeys(n.rpartition(".")[2] for n in linears))
    shown = ", ".join(own[:_SHOWN]) + (f", ... ({len(own)} names in all)" if len(own) > _SHOWN else "")
    if not linears:
        return (
            f"lora target_modules {spec!r}: {type(model).__name__} has no linear layer "
            "(nn.Linear or Conv1D) to put adapters on"
        )
    return (
        f"lora target_modules {spec!r} matches no linear layer of {type(model).__name__}; its "
        f"linear layers are named {shown} (e.g. {linears[0]}); use 'all-linear', 'attention', "
        "or some of those names"
    )


# ---------------------------------------------------------------------------- apply
class LoraHandle:
    """What :func:`apply_lora` did to a model, and how to undo it.

    Attributes:
        targets: The qualified names of the layers that got adapters.
        config: The config applied.
        tuner: peft's ``LoraModel`` that injected the adapters (it wraps the model; the model
            itself is the one trained).
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoraConfig,
        targets: list[str],
        tuner: Any,
        requires_grad: list[tuple[nn.Parameter, bool]],
        dtypes: dict[str, torch.dtype],
    ) -> None:
        self.model, self.config, self.targets, self.tuner = model, config, targets, tuner
        self._requires_grad = requires_grad  # every base parameter's flag before
        self._dtypes = dtypes  # qualified name -> dtype before, for those cast
        # layer name -> (its nn.Linear or Conv1D, emptied while the 4-bit layer stands in, its
        # weight's dtype and requires_grad before)
        self.quantized: dict[str, tuple[nn.Module, torch.dtype, bool]] = {}
        # the input embedding's (name, module, dtype, requires_grad) while a 4-bit one stands in
        self.embedding: tuple[str, nn.Module, torch.dtype, bool] | None = None
        self.removed = False

    def adapter_parameters(self) -> list[nn.Parameter]:
        """The adapters' parameters (what trains)."""
        return [p for n, p in self.model.named_parameters() if "lora_" in n]

    def remove(self) -> None:
        """Unload the adapters (dropped, not merged) and give the base back its weights'
        dtypes and ``requires_grad``. A quantised weight comes back dequantised (its 4-bit
        rounding stays: the original values were not kept, as keeping them would cost what
        quantising saved). Idempotent."""
        if self.removed:
            return
        self.removed = True
        for name, (linear, dtype, flag) in self.quantized.items():
            adapted = self.model.get_submodule(name)
            weight = _nf4.dequantize(adapted.base_layer.weight, dtype)
            if _is_conv1d(linear):
                weight = weight.t().contiguous()
            linear.weight = nn.Parameter(weight, requires_grad=flag)
            adapted.base_layer = linear
        self.quantized = {}
        if self.embedding is not None:
            name, embedding, dtype, flag = self.embedding
            weight = _nf4.dequantize(self.model.get_submodule(name).weight, dtype)
            embedding.weight = nn.Parameter(weight, requires_grad=flag)
            _set_submodule(self.model, name, embedding)
            self.embedding = None
        self.tuner.unload()  # the base layers back in place of peft's LoRA layers
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config
        params = dict(self.model.named_parameters())
        for name, dtype in self._dtypes.items():
            p = params.get(name)
            if p is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for p, flag in self._requires_grad:
            p.requires_grad_(flag)

    def __repr__(self) -> str:
        return f"LoraHandle({len(self.targets)} layers, {self.config.summary()})"


def apply_lora(
    model: nn.Module, config: LoraConfig, *, base_dtype: torch.dtype | None = None
) -> LoraHandle:
    """Put ``config``'s adapters on ``model`` in place and freeze everything else.

    Args:
        model: The model; changed in place (:meth:`LoraHandle.remove` undoes it).
        config: The adapters.
        base_dtype: Store the frozen base in this dtype (the half dtype of a mixed-precision
            plan; ``None``: leave it). The adapters keep the dtype the model had.

    Returns:
        The :class:`LoraHandle`.

    Raises:
        ValueError: when ``target_modules`` matches no linear layer.
        ImportError: when peft (or, for QLoRA, torchao) is not installed, naming the extra.
    """
    peft = _peft()
    if config.quantize_base:
        _nf4.nf4_module()  # say which extra is missing before changing anything
    targets = resolve_targets(model, config)
    before = [(p, p.requires_grad) for p in model.parameters()]
    base_names = [n for n, _ in model.named_parameters()]
    dtypes: dict[str, torch.dtype] = {}
    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        use_dora=config.use_dora,
        bias="none",
        # GPT-2's Conv1D stores its weight transposed (in x out); peft must know.
        fan_in_fan_out=any(_is_conv1d(model.get_submodule(t)) for t in targets),
    )
    # LoraModel injects into ``model`` itself (its ``model`` attribute is ours) and freezes
    # everything but the adapters.
    tuner = peft.tuners.lora.LoraModel(model, peft_config, ADAPTER_NAME)
    params = dict(model.named_parameters())
    for name in base_names:
        # peft renames a targeted layer's weight to ``<layer>.base_layer.weight``.
        key = name if name in params else _based(name, targets)
        p = params[key]
        p.grad = None  # frozen means no gradient (a stale one would hold its memory)
        if base_dtype is not None and p.is_floating_point() and p.dtype != base_dtype:
            dtypes[name] = p.dtype  # by its name without peft's (as after removal)
            p.data = p.data.to(base_dtype)
    handle = LoraHandle(model, config, targets, tuner, before, dtypes)
    if config.quantize_base:
        _quantize_layers(handle, dtypes)
    return handle


def _quantize_layers(handle: LoraHandle, dtypes: dict[str, torch.dtype]) -> None:
    """Put a 4-bit :class:`~memfit.strategies.nf4.NF4Linear` in place of each adapted
    layer's base, layer by layer (one layer's quantisation temporaries at a time)."""
    for name in handle.targets:
        adapted = handle.model.get_submodule(name)
        linear = adapted.base_layer
        w = linear.weight
        if w.numel() % _nf4.BLOCK:
            continue  # cannot be cut into blocks: stays in its dtype (and is counted so)
        flag = next(f for p, f in handle._requires_grad if p is w)
        # A Conv1D computes x @ w (w is in x out): the 4-bit layer's x @ W.T with W = w.T.
        q = _nf4.quantize(w.t() if _is_conv1d(linear) else w)
        adapted.base_layer = _nf4.NF4Linear(q, linear.bias)
        # The layer object is kept to be put back on removal; its weight is dropped now, so
        # only the 4-bit one holds memory.
        linear.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        handle.quantized[name] = (linear, dtypes.get(f"{name}.weight", w.dtype), flag)
        del w
    if handle.config.quantize_embeddings:
        _quantize_embedding(handle, dtypes)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _quantize_embedding(handle: LoraHandle, dtypes: dict[str, torch.dtype]) -> None:
    """Put a 4-bit :class:`~memfit.strategies.nf4.NF4Embedding` in place of the input
    embedding (a plain ``nn.Embedding`` whose width is whole NF4 blocks and whose table is not
    the output head's)."""
    model = handle.model
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if type(embedding) is not nn.Embedding or embedding.embedding_dim % _nf4.BLOCK:
        return
    heads = [model.get_submodule(n) for n in _head_names(model)]
    if any(getattr(h, "weight", None) is embedding.weight for h in heads):
        return  # tied to the output head, which stays as it is
    name = next(n for n, m in model.named_modules() if m is embedding)
    w = embedding.weight
    flag = next(f for p, f in handle._requires_grad if p is w)
    q = _nf4.quantize(w)
    _set_submodule(model, name, _nf4.NF4Embedding(q, embedding.padding_idx))
    embedding.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
    handle.embedding = (name, embedding, dtypes.get(f"{name}.weight", w.dtype), flag)
    del w


def _based(name: str, targets: list[str]) -> str:
    layer, _, leaf = name.rpartition(".")
    if layer in targets:
        return f"{layer}.base_layer.{leaf}"
    raise KeyError(name)


def find_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries memfit's (peft's) LoRA adapters."""
    return isinstance(getattr(model, "peft_config", None), dict) and any(
        "lora_" in n for n, _ in model.named_parameters()
    )


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s adapter weights by name (small: the adapters only), for
    :func:`load_adapter_state` after the plan around them is rebuilt."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy :func:`adapter_state`'s values into ``model``'s adapters of the same names (their
    dtypes may differ: the values are cast)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            if name in params:
                params[name].copy_(value)


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Save ``model``'s adapters in peft's own format: ``adapter_model.safetensors`` and
    ``adapter_config.json`` in ``directory``, loadable by ``PeftModel.from_pretrained(base,
    directory)`` over the same base model.

    Returns:
        The directory.
    """
    peft = _peft()
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER_NAME]
    state = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    # PeftModel's state-dict keys start with its own prefix (it wraps a LoraModel that wraps
    # the model); ours come from the model itself.
    state = {
        f"base_model.model.{k}": v.detach().to("cpu").contiguous() for k, v in state.items()
    }
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    config = dataclasses.replace(config, base_model_name_or_path=name or None)
    config.save_pretrained(str(out))
    return out


# ---------------------------------------------------------------------------- technique
_HALF = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> LoraHandle:
    config: LoraConfig = ctx.plan.lora
    handle = apply_lora(model, config, base_dtype=_HALF.get(ctx.plan.precision.mode))
    ctx.info["lora"] = handle.targets
    return handle


def _refusal(plan: Any, engine: str) -> str | None:
    if engine in ("data", "layout") and plan.lora.quantize_base:
        return (
            "QLoRA's 4-bit base cannot be sharded or broadcast by the data-parallel engines "
            "yet; use one process, or LoRA without quantize_base"
        )
    return None


def _memory_rank(config: LoraConfig | None) -> float:
    """How much a config saves, for the planner's dominance pruning: off saves nothing;
    over a base in its dtype, adapters on attention only keep fewer adapter parameters than
    on every linear layer; a 4-bit base saves more than either, and most when every linear
    layer is in 4 bits (its 1.5 bytes saved per weight outweigh the adapters' few)."""
    if config is None:
        return 0.0
    attention_only = config.targets() == ("attention",)
    if config.quantize_base:
        return 3.0 if attention_only else 4.0 + float(config.quantize_embeddings)
    return 2.0 if attention_only else 1.0


def _parse(value: Any) -> LoraConfig | None:
    """``Plan.lora``'s canonical config: ``None``/``false`` off, ``true`` the defaults, a
    mapping of :class:`LoraConfig`'s fields (lists become tuples)."""
    if value is None or value is False:
        return None
    if value is True:
        return LoraConfig()
    if isinstance(value, LoraConfig):
        return value
    if isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(LoraConfig)}
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ValueError(
                f"LoraConfig has no field {unknown[0]!r}; its fields are {', '.join(sorted(names))}"
            )
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        return LoraConfig(**fields)
    raise ValueError(
        f"lora must be true, false, null or a mapping of its fields (rank, alpha, dropout, "
        f"target_modules, use_dora, quantize_base, quantize_embeddings), got {value!r}"
    )


def _check(plan: Any) -> None:
    """LoRA's rules against the plan's other techniques."""
    lora, off = plan.lora, plan.offload
    if lora is not None and lora.quantize_base and off is not None and off.parameters is not None:
        raise ValueError(
            "parameter offload cannot stream QLoRA's 4-bit base (its blocks are copied as "
            "plain tensors); offload the optimizer or activations only, or set lora "
            "quantize_base null"
        )


#: LoRA decides what trains, so it applies before everything that looks at the trainable set
#: (freezing, precision's optimizer wrappers, the gradient buffer, the optimizer) and before
#: checkpointing wraps the blocks that hold the layers it replaces.
TECHNIQUE = Technique(
    name="lora",
    plan_field="lora",
    order=5,
    is_on=lambda plan: plan.lora is not None,
    apply=_apply_technique,
    info_key="lora",
    engines=frozenset({"single", "data", "hf", "lightning"}),
    refusal=_refusal,
    allow={
        "lora": "train low-rank adapters (LoRA) on a frozen base instead of every weight",
        "qlora": "train low-rank adapters on a 4-bit NF4 base (QLoRA)",
    },
    memory_rank=_memory_rank,
    summary=lambda config: config.summary(),
    parse=_parse,
    check=_check,
)
