"""Workloads: a model, how to make a batch, and how to get a loss from the model's output.

A ``--model`` SPEC names a workload in one of these ways:

* a built-in preset (``bert-base``, ``bert-large``, ``gpt2``, ``gpt2-medium``, ``llama-1b``, ``llama-8b``,
  and small ones for tests), built from a config with random weights: nothing is downloaded;
* a path to a Hugging Face ``config.json``: the model is built from it with random weights;
* a Hugging Face model folder (``config.json`` plus safetensors weights, as ``save_pretrained``
  writes it), or a hub id (``owner/name``) where the hub is reachable: dry runs build it from
  the config alone (no weight file is opened); a real training run loads the saved weights
  (:meth:`Workload.build` with ``pretrained=True``, :mod:`memfit.weights`);
* ``package.module:function``, where ``function(batch_size, seq_len)`` returns
  ``(model, batch)``.

Models are built lazily, inside whatever mode is active, so the same workload builds real
tensors for a real run and fake ones for a dry run (initialisers that read the values they
sample are skipped on fake tensors: see :func:`_sampling_skipped_on_fake_tensors`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .weights import WeightsError, hub_folder, is_hub_id, load_pretrained, model_class, reason

__all__ = [
    "PRESETS",
    "Batch",
    "Workload",
    "WorkloadError",
    "batch_size_of",
    "call_model",
    "load_workload",
    "loss_from_output",
    "split_batch",
]

#: A batch: keyword arguments for the model, or a tensor, or a tuple of positional arguments.
Batch = Any


class WorkloadError(ValueError):
    """A workload SPEC or its model/batch/loss is not usable; the message says why."""


# ---------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class _Preset:
    family: str  # a key of _FAMILIES: "bert" (sequence classification), else a causal LM
    config: dict[str, Any]
    about: str


#: Preset family -> (transformers config class, model class).
_FAMILIES: dict[str, tuple[str, str]] = {
    "bert": ("BertConfig", "BertForSequenceClassification"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


PRESETS: dict[str, _Preset] = {
    "bert-base": _Preset(
        "bert",
        dict(
            vocab_size=30522,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            num_labels=2,
        ),
        "BERT-base sequence classifier, 2 labels (110M parameters)",
    ),
    "bert-large": _Preset(
        "bert",
        dict(
            vocab_size=21128,
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            num_labels=2,
        ),
        "chinese-macbert-large dimensions, sequence classifier, 2 labels (325M parameters)",
    ),
    "gpt2": _Preset(
        "gpt2",
        dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
        "GPT-2 small causal LM (124M parameters)",
    ),
    "gpt2-medium": _Preset(
        "gpt2",
        dict(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16),
        "GPT-2 medium causal LM (355M parameters)",
    ),
    "llama-1b": _Preset(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        "Llama-architecture causal LM (1.24B parameters, Llama-3.2-1B dimensions)",
    ),
    "llama-8b": _Preset(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        "Llama-architecture causal LM (8.03B parameters, Llama-3.1-8B dimensions)",
    ),
    # The three most fine-tuned open models' published config.json (Meta, Alibaba, Mistral AI),
    # the fields that shape memory; their weights load with --model DIR.
    "llama-3.1-8b": _Preset(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_word_embeddings=False,
        ),
        "Llama 3.1 8B's config (8.03B parameters)",
    ),
    "qwen2.5-7b": _Preset(
        "qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        "Qwen2.5 7B's config (7.62B parameters)",
    ),
    "mistral-7b": _Preset(
        "mistral",
        dict(
            vocab_size=32768,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        "Mistral 7B v0.3's config (7.25B parameters)",
    ),
    "llama-70b": _Preset(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        "Llama-architecture causal LM (70.6B parameters, Llama-3.1-70B dimensions)",
    ),
    "llama-3.1-405b": _Preset("llama", dict(  # the dimensions of Meta's config.json
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False),
        "Llama 3.1 405B's dimensions (405.9B parameters, 126 blocks)"),
    "mixtral-8x7b": _Preset(
        "mixtral",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
        ),
        "Mixtral-8x7B mixture of experts, 8 experts, top-2 (46.7B parameters, 12.9B active)",
    ),
    "qwen3-30b-a3b": _Preset(
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
        "Qwen3-30B-A3B mixture of experts, 128 experts, top-8 (30.5B parameters, 3.3B active)",
    ),
    "bert-tiny": _Preset(
        "bert",
        dict(
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=256,
            num_labels=2,
        ),
        "2-layer BERT classifier for tests (0.2M parameters)",
    ),
    "gpt2-tiny": _Preset(
        "gpt2",
        dict(
            vocab_size=1000,
            n_positions=256,
            n_embd=64,
            n_layer=2,
            n_head=2,
            bos_token_id=999,
            eos_token_id=999,
        ),
        "2-layer GPT-2 for tests (0.2M parameters)",
    ),
    "llama-tiny": _Preset(
        "llama",
        dict(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "2-layer Llama for tests (0.2M parameters)",
    ),
}


def _hf_model_from_config(config: Any, family: str | None = None) -> nn.Module:
    """Build a transformers model with random weights from ``config``.

    Under fake tensors (a dry run) weight initialisation is skipped: the values do not exist,
    and some initialisers (truncated normal) make data-dependent checks that fake tensors
    cannot answer.
    """
    from torch._guards import active_fake_mode

    if active_fake_mode() is not None:
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # older transformers
            from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
        with no_init_weights():
            model = _hf_model_from_config_impl(config, family)
        # Tying happens in the weight initialisation that was skipped: do it now, so the dry
        # run has the real run's parameters.
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
        return model
    return _hf_model_from_config_impl(config, family)


def _hf_model_from_config_impl(config: Any, family: str | None) -> nn.Module:
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    if family is not None:
        return getattr(transformers, _FAMILIES[family][1])(config)
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls(config)
    errors = []
    for auto in (
        "AutoModelForCausalLM",
        "AutoModelForMaskedLM",
        "AutoModelForSequenceClassification",
    ):
        try:
            return getattr(transformers, auto).from_config(config)
        except (ValueError, KeyError) as e:
            errors.append(str(e))
    raise WorkloadError(
        f"cannot build a model from config of type {config.model_type!r}: transformers has no "
        "causal-LM, masked-LM or sequence-classification model for it"
    )


def _hf_batch(model: nn.Module, batch_size: int, seq_len: int, device: Any = None) -> dict:
    """A random batch of token ids (or images) and labels fitting ``model``'s config and task."""
    config = model.config
    name = type(model).__name__
    image_size = getattr(config, "image_size", None)
    if image_size is not None and getattr(config, "num_channels", None) is not None:
        # Vision models (ViT, ...): images instead of tokens; seq_len is not used.
        size = image_size if isinstance(image_size, int) else int(image_size[0])
        pixels = torch.randn(batch_size, int(config.num_channels), size, size, device=device)
        vision: dict[str, torch.Tensor] = {"pixel_values": pixels}
        if name.endswith("ForImageClassification"):
            labels = torch.randint(0, int(getattr(config, "num_labels", 2)), (batch_size,))
            vision["labels"] = labels.to(device) if device is not None else labels
        return vision
    vocab = int(getattr(config, "vocab_size", 1000))
    ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    # No attention mask: an all-ones mask says nothing, and transformers inspects mask values
    # to pick its attention path, which fake tensors cannot show (a dry run would then build a
    # dense mask that the real run skips).
    batch: dict[str, torch.Tensor] = {"input_ids": ids}
    if name.endswith("ForSequenceClassification"):
        num_labels = int(getattr(config, "num_labels", 2))
        batch["labels"] = torch.randint(0, num_labels, (batch_size,), device=device)
    else:
        # Causal and masked LMs: predict the input tokens (HF shifts causal labels itself).
        batch["labels"] = ids.clone()
    return batch


# ---------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    """A model plus how to make a batch and a loss.

    Attributes:
        name: The SPEC it came from (for reports).
        batch_size: Samples per optimizer step (the effective batch).
        seq_len: Tokens per sample (for token models; passed to custom functions as given).
        build_model: Makes the model, in whatever tensor mode is active (real or fake).
        make_batch: ``make_batch(model, batch_size, seq_len)`` makes one batch.
        loss_fn: Turns the model's output (and the batch) into a scalar loss.
        description: One line for humans.
        depth: Number of repeated blocks (layers), when known.
        with_depth: ``with_depth(n)`` gives the same workload with ``n`` blocks; the planner
            profiles one and two blocks and composes the full depth from them.
        weights: Where the model's saved weights are (a model folder or a hub id), or ``None``
            for random weights.
        load_model: ``load_model(dtype)`` builds the model with its saved weights, each
            tensor loaded straight into ``dtype`` (``None`` without saved weights).
            :meth:`build` calls it for ``pretrained=True``; dry runs never do.
    """

    name: str
    batch_size: int
    seq_len: int
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module, int, int], Batch]
    loss_fn: Callable[[Any, Batch], torch.Tensor] = field(
        default=lambda out, batch: loss_from_output(out)
    )
    description: str = ""
    depth: int | None = None
    with_depth: Callable[[int], Workload] | None = None
    weights: str | None = None
    load_model: Callable[[torch.dtype], nn.Module] | None = None

    @property
    def scalable(self) -> bool:
        """Whether the workload can be rebuilt with fewer repeated blocks (for composition)."""
        return self.depth is not None and self.with_depth is not None

    def build(
        self, *, seed: int = 0, pretrained: bool = False, dtype: torch.dtype = torch.float32
    ) -> tuple[nn.Module, Batch]:
        """Build the model (train mode) and one full batch, seeded for reproducibility.

        Args:
            seed: Seeds the initialisation and the batch.
            pretrained: Load the saved weights, when the workload has them (``load_model``),
                instead of initialising at random. Ignored under fake tensors: a dry run
                never reads weight files (their values change no memory).
            dtype: The floating dtype the saved weights load into (the plan's: bf16 for
                ``bf16-pure``, else fp32); random weights are built in fp32 as always.

        Raises:
            WorkloadError: when the model is not a module, or its saved weights cannot be
                loaded (one sentence naming the file).
        """
        from torch._guards import active_fake_mode

        torch.manual_seed(seed)
        if pretrained and self.load_model is not None and active_fake_mode() is None:
            model = self.load_model(dtype)
        else:
            model = self.build_model()
        if not isinstance(model, nn.Module):
            raise WorkloadError(
                f"workload {self.name!r} built a {type(model).__name__}, not a torch.nn.Module"
            )
        model.train()
        batch = self.make_batch(model, self.batch_size, self.seq_len)
        _check_batch(self.name, batch)
        return model, batch

    def replace(self, **changes: Any) -> Workload:
        """A copy with some fields changed (for example another ``seq_len``)."""
        return dataclasses.replace(self, **changes)


def load_workload(spec: str, batch_size: int = 8, seq_len: int = 128) -> Workload:
    """Turn a ``--model`` SPEC into a :class:`Workload`.

    Args:
        spec: A preset name, a path to a Hugging Face ``config.json``, a model folder
            (``config.json`` and safetensors weights), a hub id, or
            ``package.module:function``.
        batch_size: Samples per step (must be >= 1).
        seq_len: Tokens per sample (must be >= 1).

    Raises:
        WorkloadError: with one sentence saying what was wrong and what is accepted.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise WorkloadError(f"batch size must be a whole number >= 1, got {batch_size!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise WorkloadError(f"sequence length must be a whole number >= 1, got {seq_len!r}")
    if spec in PRESETS:
        return _preset_workload(spec, batch_size, seq_len)
    if spec.endswith(".json") or os.path.isdir(spec) or os.path.exists(spec):
        return _config_workload(spec, batch_size, seq_len)
    if ":" in spec:
        return _function_workload(spec, batch_size, seq_len)
    if is_hub_id(spec):
        # The config alone (a few KB) for now; the weights when a run trains.
        try:
            folder = hub_folder(spec, weights=False)
        except WeightsError as e:
            raise WorkloadError(str(e)) from None
        return _config_workload(str(folder), batch_size, seq_len, source=spec)
    raise WorkloadError(
        f"model {spec!r} names nothing memfit knows; use a preset ({', '.join(PRESETS)}), "
        "a Hugging Face model folder or config.json, a hub id, or package.module:function"
    )


def _preset_workload(
    name: str, batch_size: int, seq_len: int, overrides: Mapping[str, Any] | None = None
) -> Workload:
    preset = PRESETS[name]
    config_kwargs = {**preset.config, **(overrides or {})}
    depth_key = _depth_key(config_kwargs)
    # A preset asked for longer sequences than its position table holds gets a longer table,
    # as a fine-tune that extends the context would (GPT-2 and BERT learn absolute positions;
    # for Llama it is only the configured limit). The extra rows are counted as parameters.
    for key in _POSITION_KEYS.get(preset.family, ()):
        if int(config_kwargs.get(key, _DEFAULT_POSITIONS[key])) < seq_len:
            config_kwargs[key] = seq_len

    def build() -> nn.Module:
        import transformers

        cls = getattr(transformers, _FAMILIES[preset.family][0])
        return _hf_model_from_config(cls(**config_kwargs), preset.family)

    return Workload(
        name,
        batch_size,
        seq_len,
        build,
        _hf_batch,
        description=preset.about,
        depth=int(config_kwargs[depth_key]),
        with_depth=lambda n: _preset_workload(name, batch_size, seq_len, {depth_key: n}),
    )


_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_POSITION_KEYS = {
    "bert": ("max_position_embeddings",),
    "gpt2": ("n_positions",),
    "llama": ("max_position_embeddings",),
    "mixtral": ("max_position_embeddings",),
    "qwen3_moe": ("max_position_embeddings",),
}
# transformers' defaults, for presets that leave the key out.
_DEFAULT_POSITIONS = {"max_position_embeddings": 512, "n_positions": 1024}


def _depth_key(config: Mapping[str, Any]) -> str:
    for key in _DEPTH_KEYS:
        if key in config:
            return key
    raise KeyError("no layer count")


def _check_positions(name: str, config: Mapping[str, Any], seq_len: int) -> None:
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    if limit is not None and seq_len > int(limit):
        raise WorkloadError(
            f"sequence length {seq_len} is longer than {name}'s {limit} positions; "
            f"use --seq-len {limit} or less"
        )


def _config_workload(
    spec: str, batch_size: int, seq_len: int, *, source: str | None = None
) -> Workload:
    """A workload from a ``config.json`` (random weights) or a model folder (its saved
    weights, for a real run; ``source`` is the hub id it was fetched for)."""
    path = Path(spec)
    folder = path if path.is_dir() else None
    if folder is not None:
        path = path / "config.json"
    if not path.is_file():
        raise WorkloadError(
            f"config file {str(path)!r} does not exist; give a model folder or a path to a "
            "config.json"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WorkloadError(f"config file {str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise WorkloadError(
            f"config file {str(path)!r} has no 'model_type'; give a Hugging Face config.json"
        )
    import transformers

    try:
        config = transformers.AutoConfig.for_model(**data)
    except Exception as e:  # ValueError, KeyError, TypeError for fields it cannot take
        raise WorkloadError(
            f"config file {str(path)!r} has model_type {data['model_type']!r}, which this "
            f"transformers version cannot read ({reason(e)})"
        ) from None
    _check_positions(str(path), data, seq_len)
    depth_key = next((k for k in _DEPTH_KEYS if k in config.to_dict()), None)
    weights = None if folder is None else (source or str(folder))

    def at_depth(n: int) -> Workload:
        shallow = copy.deepcopy(config)
        setattr(shallow, depth_key, n)
        # A shallow copy is for dry runs only: it has no saved weights of its own.
        return dataclasses.replace(
            wl, build_model=lambda: _hf_model_from_config(shallow), depth=n, load_model=None
        )

    def load_model(dtype: torch.dtype) -> nn.Module:
        assert weights is not None
        try:
            where = hub_folder(weights, weights=True) if source is not None else Path(weights)
            return load_pretrained(where, model_class(config), config, dtype)
        except WeightsError as e:
            raise WorkloadError(str(e)) from None

    about = f"{data['model_type']} from {path}"
    if weights is not None:
        about = f"{data['model_type']} with the saved weights of {weights}"
    wl = Workload(
        weights or str(path),
        batch_size,
        seq_len,
        lambda: _hf_model_from_config(config),
        _hf_batch,
        description=about,
        depth=None if depth_key is None else int(getattr(config, depth_key)),
        with_depth=None if depth_key is None else at_depth,
        weights=weights,
        load_model=None if weights is None else load_model,
    )
    return wl


def _function_workload(spec: str, batch_size: int, seq_len: int) -> Workload:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise WorkloadError(f"model {spec!r} is not of the form package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # let users name modules in the current folder
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise WorkloadError(
            f"model {spec!r}: module {module_name!r} cannot be imported ({e}); use a preset "
            f"({', '.join(PRESETS)}), a config.json path, or an importable package.module:function"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise WorkloadError(f"model {spec!r}: module {module_name!r} has no function {func_name!r}")

    # The function returns the model and the batch together; keep the batch made along with
    # the model so that both come from the same call (and the same tensor mode).
    made: dict[str, Any] = {}

    def build() -> nn.Module:
        with _sampling_skipped_on_fake_tensors():
            result = func(batch_size, seq_len)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise WorkloadError(
                f"{spec} returned {type(result).__name__}; it must return a (model, batch) tuple "
                "where batch is a dict of keyword arguments or a tensor"
            )
        model, batch = result
        if not isinstance(model, nn.Module):
            raise WorkloadError(
                f"{spec} returned ({type(model).__name__}, ...); the first item must be a "
                "torch.nn.Module"
            )
        _check_batch(spec, batch)
        made["batch"], made["model"] = batch, model
        return model

    def make_batch(model: nn.Module, bs: int, sl: int) -> Batch:
        if made.get("model") is model and (bs, sl) == (batch_size, seq_len):
            return made["batch"]
        full = made["batch"] if made.get("model") is model else func(bs, sl)[1]
        if sl == seq_len and bs <= batch_size_of(full):
            return split_batch(full, bs)[0]
        return func(bs, sl)[1]

    return Workload(spec, batch_size, seq_len, build, make_batch, description=f"{spec}()")


@contextlib.contextmanager
def _sampling_skipped_on_fake_tensors() -> Iterator[None]:
    """Let a function build its model on fake tensors (a dry run) whatever initialisers it uses.

    torch's ``nn.init.trunc_normal_`` redraws samples until all lie within bounds, reading
    their values (``mask.any()``), which fake tensors do not have: a transformers ViT built by
    a user's function stopped the dry run there. torch itself skips it for meta tensors (no
    storage, so "sampling is a no-op"); while a function builds its model on fake tensors, so
    does a dry run for a fake tensor whose values it does not know. Nothing a dry run counts
    changes (shapes, dtypes, devices: the parameters are the real run's), and nothing is
    sampled, so a 70B model builds as fast as before; building on the CPU and converting
    would cost the real memory and time. A fake tensor whose values the dry run knows (a
    constant's shadow, :mod:`memfit.estimate.values`) and every real tensor are sampled as
    usual. Other initialisers read no values and run unchanged (an in-place fill of a fake
    tensor allocates nothing).

    Unlike the config path (transformers' ``no_init_weights``), the model's own
    initialisation still runs: a user's function may be any ``nn.Module``, and what it does
    after construction (tying, buffers computed in ``_init_weights``) is the real run's.
    The helper that torch's public ``trunc_normal_`` calls is replaced for the duration, so
    every caller is covered, however it holds the public function (transformers keeps its
    own reference to it).
    """
    from torch._guards import active_fake_mode

    if active_fake_mode() is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn import init

    from .device import active_values

    name = "_no_grad_trunc_normal_" if hasattr(init, "_no_grad_trunc_normal_") else "trunc_normal_"
    original = getattr(init, name)

    def trunc_normal(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        values = active_values()
        if isinstance(tensor, FakeTensor) and (values is None or tensor not in values.shadows):
            if values is not None:
                values.forget(tensor)  # an alias's known values are stale now
            return tensor
        return original(tensor, *args, **kwargs)

    setattr(init, name, trunc_normal)
    try:
        yield
    finally:
        setattr(init, name, original)


def _check_batch(name: str, batch: Any) -> None:
    if isinstance(batch, torch.Tensor):
        return
    if isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
        return
    if isinstance(batch, (tuple, list)):
        return
    raise WorkloadError(
        f"{name} gave a batch of type {type(batch).__name__}; a batch must be a dict of "
        "keyword arguments, a tensor, or a tuple of positional arguments"
    )


# ---------------------------------------------------------------------------------- helpers
def call_model(model: nn.Module, batch: Batch) -> Any:
    """Call ``model`` on ``batch`` (a dict of keyword arguments, a tensor, or a tuple)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_from_output(output: Any) -> torch.Tensor:
    """The loss in a model's output: its ``.loss`` when it has one, else a scalar output.

    Raises:
        WorkloadError: when the output holds no scalar loss.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss.reshape(())
    what = type(output).__name__
    if isinstance(output, torch.Tensor):
        what = f"a tensor of shape {tuple(output.shape)}"
    raise WorkloadError(
        f"the model's output ({what}) has no loss; return an output with a .loss attribute "
        "(for Hugging Face models, pass labels in the batch) or a scalar loss tensor"
    )


def batch_size_of(batch: Batch) -> int:
    """The leading dimension of the batch's tensors."""
    for t in _tensors(batch):
        if t.dim() > 0:
            return int(t.shape[0])
    return 1


def split_batch(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split a batch along dimension 0 into micro-batches of at most ``micro_batch_size``."""
    n = batch_size_of(batch)
    return [
        _slice(batch, i, min(i + micro_batch_size, n), n) for i in range(0, n, micro_batch_size)
    ]


def _slice(obj: Any, lo: int, hi: int, n: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[lo:hi] if obj.dim() > 0 and obj.shape[0] == n else obj
    if isinstance(obj, Mapping):
        return {k: _slice(v, lo, hi, n) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_slice(v, lo, hi, n) for v in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []
