"""Fused loss: a Hugging Face causal LM computes its loss without ever making full logits.

The logits of a language model (tokens x vocabulary, fp32 in the loss) and their gradient are
often the largest tensors of a training step. :func:`apply_fused_loss` makes a model's
``forward(..., labels=...)`` compute its loss straight from the last hidden state with
:func:`memfit.ops.chunked_cross_entropy`, so that neither the logits nor their gradient exist
(see that function for the chunking and its cost: one more head matmul in backward).

How the model is changed (all instance-level, all undone by :meth:`FusedLossHandle.remove`):

* the output head (``model.get_output_embeddings()``, an ``nn.Linear``) gets an instance
  ``forward``: during a training forward that was given ``labels``, it keeps the hidden states
  aside and returns an empty ``(..., 0)`` tensor instead of logits; otherwise it is the
  ordinary head;
* ``model.loss_function`` (Hugging Face's per-instance setter) becomes a function that takes
  those hidden states and computes Hugging Face's causal-LM loss from them: the labels shifted
  by one (``labels[..., 1:]`` against positions ``..., :-1``), the mean over non-ignored tokens,
  or the sum over ``num_items_in_batch`` when the trainer passes it, ``shift_labels`` when
  given;
* a forward pre-hook and an always-called forward hook on the model tell the head whether the
  current call has labels, and drop any hidden states left over from a call that raised.

So ``model(**batch).loss`` is the stock loss (within rounding) and ``.logits`` is an empty
tensor whenever the loss was fused; in eval mode, under ``torch.no_grad()`` and without
labels the model computes logits as before (generation and evaluation metrics are untouched).
Gemma-style final-logit soft-capping (``config.final_logit_softcapping``) is applied inside
the fused loss. Models that transform their logits in other ways before the loss (a logit
scale, a vocabulary slice) are refused with a sentence.

For a model of your own, compute the loss with :func:`memfit.ops.fused_linear_loss` instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.cross_entropy import chunked_cross_entropy
from ..techniques import ApplyContext, Technique

__all__ = ["FusedLossConfig", "FusedLossHandle", "apply_fused_loss"]

#: Config attributes (of the model's text config) through which Hugging Face models change
#: their logits between the head and the loss, other than soft-capping: the fused loss would
#: silently skip them, so such models are refused.
_UNSUPPORTED_LOGIT_TRANSFORMS = (
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "logits_soft_cap",
    "unpadded_vocab_size",
)


@dataclass(frozen=True)
class FusedLossConfig:
    """How the fused loss runs.

    Attributes:
        chunk_size: Tokens per chunk of :func:`~memfit.ops.chunked_cross_entropy`; ``None``
            picks :func:`~memfit.ops.auto_chunk_size` (a chunk's fp32 logits about the size of
            the fp32 hidden states, at least 16 MiB).
        training_only: Fuse only forwards in training mode with gradients enabled (the default),
            so evaluation with labels still returns logits for metrics. ``False`` fuses every
            forward given labels.
    """

    chunk_size: int | None = None
    training_only: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool)
            or not isinstance(self.chunk_size, int)
            or self.chunk_size < 1
        ):
            raise ValueError(
                f"chunk_size must be a positive integer or None, got {self.chunk_size!r}."
            )
        if not isinstance(self.training_only, bool):
            raise ValueError(f"training_only must be true or false, got {self.training_only!r}.")


class _State:
    """What the model's hooks, its head and its loss function share during one forward."""

    def __init__(self, config: FusedLossConfig, labels_index: int | None) -> None:
        self.config = config
        self.labels_index = labels_index  # position of ``labels`` in forward's signature
        self.fuse = False  # the current forward has labels (and trains, if training_only)
        self.hidden: torch.Tensor | None = None  # kept by the head, taken by the loss

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs.get("labels")
        if labels is None and self.labels_index is not None and len(args) > self.labels_index:
            labels = args[self.labels_index]
        training = module.training and torch.is_grad_enabled()
        self.fuse = labels is not None and (training or not self.config.training_only)
        self.hidden = None

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        # Always called, also when forward raised: nothing outlives the call.
        self.fuse = False
        self.hidden = None


class _FusedHead:
    """The head's instance ``forward``: keeps the hidden states instead of making logits.

    A class, not a closure, so that ``copy.deepcopy`` of the model rebinds it to the copy.
    """

    def __init__(self, head: nn.Linear, state: _State, previous: Any) -> None:
        self.head = head
        self.state = state
        self.previous = previous  # the head's own instance forward, if it had one

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.state.fuse and not args and not kwargs:
            self.state.hidden = hidden
            # Empty logits: any pointwise post-processing in the model costs nothing.
            return hidden.new_empty((*hidden.shape[:-1], 0))
        if self.previous is not None:
            return self.previous(hidden, *args, **kwargs)
        return type(self.head).forward(self.head, hidden, *args, **kwargs)


class _FusedLoss:
    """The model's ``loss_function``: Hugging Face's causal-LM loss from the kept hidden states."""

    def __init__(
        self, head: nn.Linear, state: _State, original: Any, softcap: float | None
    ) -> None:
        self.head = head
        self.state = state
        self.original = original
        self.softcap = softcap

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        hidden, self.state.hidden = self.state.hidden, None
        if hidden is None:  # this call's head made real logits
            return self.original(
                logits,
                labels,
                vocab_size=vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if shift_labels is None:
            # Next-token targets; pad-then-slice keeps the hidden states uncopied.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = chunked_cross_entropy(
            hidden,
            self.head.weight,
            shift_labels,
            bias=self.head.bias,
            chunk_size=self.state.config.chunk_size,
            ignore_index=ignore_index,
            softcap=self.softcap,
            reduction=reduction,
        )
        if num_items_in_batch is not None:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


class FusedLossHandle:
    """The fused loss applied to one model; :meth:`remove` gives the model its logits back.

    Attributes:
        head_name: Qualified name of the output head whose logits are no longer made.
        softcap: The final-logit soft-cap applied inside the loss, if the model has one.
        config: The :class:`FusedLossConfig` in force.
    """

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module,
        head_name: str,
        state: _State,
        softcap: float | None,
        restore: dict[str, Any],
        hooks: list[Any],
    ) -> None:
        self.head_name = head_name
        self.softcap = softcap
        self.config = state.config
        self._model = model
        self._head = head
        self._state = state
        self._restore = restore
        self._hooks = hooks
        self._removed = False

    def remove(self) -> None:
        """Restore the head's ``forward``, the model's ``loss_function`` and its hooks."""
        if self._removed:
            return
        self._removed = True
        for hook in self._hooks:
            hook.remove()
        _restore_attr(self._head, "forward", self._restore["forward"])
        _restore_attr(self._model, "_loss_function", self._restore["_loss_function"])
        self._state.hidden = None


_MISSING = object()


def _restore_attr(obj: nn.Module, name: str, value: Any) -> None:
    if value is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = value


def apply_fused_loss(model: nn.Module, config: FusedLossConfig | None = None) -> FusedLossHandle:
    """Make a Hugging Face causal LM compute its loss without full logits.

    Works for any Hugging Face model whose output head is an ``nn.Linear`` feeding the
    causal-LM loss (GPT-2, Llama, Mistral, Qwen, Gemma with its soft-cap, ...).

    Args:
        model: The model, changed in place (instance attributes and hooks only).
        config: The options; default :class:`FusedLossConfig()`.

    Returns:
        The :class:`FusedLossHandle`; its ``remove()`` restores the model.

    Raises:
        ValueError: For a model that is not a Hugging Face causal LM with a linear head, one
            that changes its logits before the loss in a way the fused loss cannot follow, or
            one that already has the fused loss.
    """
    config = config or FusedLossConfig()
    kind = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear) or "loss_function" not in dir(type(model)):
        raise ValueError(
            f"the fused loss applies to Hugging Face causal LMs whose output head is an "
            f"nn.Linear (GPT-2, Llama, Mistral, Qwen, Gemma, ...) and {kind} is not one; turn "
            "fused_loss off and compute the loss with "
            "memfit.ops.fused_linear_loss(hidden, head, labels)."
        )
    existing = model.__dict__.get("_loss_function")
    if isinstance(existing, _FusedLoss):
        raise ValueError(f"{kind} already has memfit's fused loss.")
    loss_type = getattr(model, "loss_type", None)
    name = getattr(existing, "__name__", None) if existing is not None else None
    if (existing is not None and name != "ForCausalLMLoss") or (
        existing is None and loss_type not in (None, "ForCausalLM")
    ):
        raise ValueError(
            f"{kind}'s loss is not Hugging Face's causal-LM loss (loss_type={loss_type!r}); "
            "the fused loss would change what it computes."
        )
    text_config = _text_config(model)
    for attr in _UNSUPPORTED_LOGIT_TRANSFORMS:
        if getattr(text_config, attr, None) is not None or attr in model.__dict__:
            raise ValueError(
                f"{kind} changes its logits before the loss ({attr}), which the fused loss "
                "does not reproduce; compute the loss with memfit.ops.fused_linear_loss."
            )
    softcap = getattr(text_config, "final_logit_softcapping", None)
    head_name = next(n for n, m in model.named_modules() if m is head)

    state = _State(config, _labels_position(model))
    restore = {
        "forward": head.__dict__.get("forward", _MISSING),
        "_loss_function": model.__dict__.get("_loss_function", _MISSING),
    }
    original_loss = existing if existing is not None else model.loss_function
    head.forward = _FusedHead(head, state, head.__dict__.get("forward"))
    model.loss_function = _FusedLoss(head, state, original_loss, softcap)
    hooks = [
        model.register_forward_pre_hook(state.pre_forward, with_kwargs=True),
        model.register_forward_hook(state.post_forward, always_call=True),
    ]
    return FusedLossHandle(model, head, head_name, state, softcap, restore, hooks)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _labels_position(model: nn.Module) -> int | None:
    """Index of ``labels`` among forward's positional parameters (None if keyword-only)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "labels":
            positional = (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if p.kind in positional else None
    return None


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> FusedLossHandle:
    # Before precision and checkpointing: it patches only the head's and the model's instance
    # attributes, which neither touches, and a model it cannot take is refused before anything
    # else changed.
    handle = apply_fused_loss(model, ctx.plan.fused_loss)
    ctx.info["fused_loss"] = handle.head_name
    return handle


def parse_fused_loss(value: Any) -> FusedLossConfig | None:
    """The canonical ``fused_loss`` of a plan: ``None`` when off, else a
    :class:`FusedLossConfig` (``true`` is the default config).

    Raises:
        ValueError: one sentence, for a value that is none of these.
    """
    if value is None or value is False:
        return None
    if value is True:
        return FusedLossConfig()
    if isinstance(value, FusedLossConfig):
        return value
    if isinstance(value, Mapping):
        names = {f.name for f in fields(FusedLossConfig)}
        if not [k for k in value if k not in names]:
            try:
                return FusedLossConfig(**dict(value))
            except ValueError as e:
                raise ValueError(f"fused_loss {e}".rstrip(".")) from None
    raise ValueError(
        f"fused_loss must be true, false, null or a mapping with chunk_size (a positive "
        f"integer or null) and training_only (true or false), got {value!r}"
    )


_APPLIES: dict[tuple[str, int, int], bool] = {}


def fused_loss_applies(workload: Any) -> bool:
    """Whether the fused loss applies to ``workload``'s model (a Hugging Face causal LM with
    a linear head, see :func:`apply_fused_loss`): the model is built once per workload name,
    depth and sequence length and the loss applied and taken off again. The planner asks it
    under a dry run's fake tensors, where the build allocates nothing."""
    key = (workload.name, workload.depth or 0, workload.seq_len)
    if key not in _APPLIES:
        try:
            apply_fused_loss(workload.build_model()).remove()
            _APPLIES[key] = True
        except ValueError:
            _APPLIES[key] = False
    return _APPLIES[key]


def _candidates(plan: Any, workload: Any) -> list[FusedLossConfig]:
    """The planner's choice besides the plan's own: the default config, where it applies."""
    if plan.fused_loss is None and fused_loss_applies(workload):
        return [FusedLossConfig()]
    return []


def _summary(config: FusedLossConfig) -> str:
    chunk = config.chunk_size
    return "fused loss" + (f" (chunks of {chunk} tokens)" if chunk else "")


#: The head's loss in chunks. Swappable: it changes the head's forward and the model's loss
#: function, never the parameters.
TECHNIQUE = Technique(
    name="fused_loss",
    plan_field="fused_loss",
    order=30,
    apply=_apply_technique,
    info_key="fused_loss",
    engines=frozenset({"single", "data", "hf", "lightning"}),
    swappable=True,
    forbid={"fused-loss": "the output head's loss computed in chunks (no full logits)"},
    summary=_summary,
    parse=parse_fused_loss,
    candidates=_candidates,
    # The fused loss keeps one chunk of logits, the plain loss all of them.
    memory_rank=lambda config: 1.0,
    # chunked_cross_entropy keeps no logits for backward and recomputes them there, one
    # vocabulary block at a time: one more forward matmul of the head, 4 passes of tokens x
    # hidden x vocabulary instead of 3 (memfit/ops/cross_entropy.py's docstring; issue 12).
    recompute_flops=lambda plan, profile: profile.head_fwd_flops_per_sample,
)
