"""Freezing: parameters that do not train need no gradient and no optimizer state.

A frozen parameter gets ``requires_grad_(False)``: autograd computes no gradient for it (and no
gradient of anything only it needs), and an optimizer built afterwards from the parameters that
require gradients (as :func:`memfit.apply.compose.apply_plan` does) holds no state for it.
Freezing ``body`` in an Adam fine-tune removes about 12 bytes per frozen parameter: 4 of gradient
and 8 of optimizer state; the weights themselves (4 bytes) stay.

:func:`apply_freezing` returns a :class:`FreezeHandle`; its :meth:`~FreezeHandle.remove` gives
every parameter it froze its ``requires_grad`` back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
from torch import nn

from ..blocks import find_blocks
from ..techniques import ApplyContext, Technique

__all__ = ["HEAD_NAMES", "FreezeHandle", "apply_freezing", "resolve_freeze"]

#: Names (fnmatch patterns over a module's own name) of task heads in Hugging Face models:
#: classifiers (``classifier``, DistilBERT's ``pre_classifier``), ``score`` (sequence
#: classification on decoder models), ``lm_head``, ``qa_outputs``, BERT's pretraining/MLM
#: head ``cls``, and the generic ``head`` (timm and most custom models).
HEAD_NAMES: tuple[str, ...] = (
    "classifier*",
    "pre_classifier",
    "score*",
    "lm_head*",
    "qa_outputs",
    "cls",
    "head",
)

_SHOWN = 6  # parameter names listed in an error message


def apply_freezing(model: nn.Module, specs: Sequence[str]) -> FreezeHandle:
    """Freeze the parameters that ``specs`` select.

    Each spec is one of:

    * ``embeddings``: the parameters of every ``nn.Embedding`` module, plus every parameter
      whose name contains ``embed`` (position and token-type embeddings, BERT's embedding
      LayerNorm). A language-model head tied to the token embedding (GPT-2, tied Llama) is the
      same tensor, so it is frozen too.
    * ``body``: everything except the task head, so that only the head trains (the classic
      "freeze the model body, train the classifier"). The head is the shallowest module(s)
      named like :data:`HEAD_NAMES` (``classifier``, ``score``, ``lm_head``, ``qa_outputs``,
      ...); BERT's pooler is part of the body. A parameter the head shares with the body
      (a tied ``lm_head``/token embedding) belongs to the head and stays trainable: there is
      only one tensor, and freezing it would freeze the head. For a model without a head of a
      recognised name, the last child module that has parameters is the head.
    * ``blocks:K``: the first ``K`` repeated blocks (transformer layers) found by
      :func:`~memfit.blocks.find_blocks`.
    * anything else: an ``fnmatch`` pattern over parameter names (``bert.encoder.layer.[0-5].*``,
      ``*.bias``). A pattern that names a module (``bert.embeddings``) freezes all its
      parameters. Names tied parameters go by any of their names (``lm_head.weight`` selects
      GPT-2's tied token embedding).

    Args:
        model: The model; changed in place (``requires_grad_(False)`` and ``.grad`` dropped).
        specs: The specs, applied together (the union is frozen).

    Returns:
        The :class:`FreezeHandle`: ``names`` lists (as :meth:`nn.Module.named_parameters`
        gives them) the parameters the specs select, in model order, including any that were
        frozen already; ``remove()`` unfreezes what this call froze.

    Raises:
        ValueError: when a spec selects nothing, with the parameter names that exist.
    """
    names = resolve_freeze(model, specs)
    params = dict(model.named_parameters())
    handle = FreezeHandle(names, [(params[n], params[n].requires_grad) for n in names])
    for name in names:
        p = params[name]
        p.requires_grad_(False)
        # A stale gradient would keep its memory and could be stepped by an optimizer built
        # before freezing; frozen means no gradient.
        p.grad = None
    return handle


class FreezeHandle:
    """What :func:`apply_freezing` froze, and how to undo it.

    Attributes:
        names: The selected parameters' names, in model order (frozen before or by this call).
    """

    def __init__(self, names: list[str], previous: list[tuple[torch.Tensor, bool]]) -> None:
        self.names = names
        self._previous = previous  # (parameter, requires_grad before freezing)

    def remove(self) -> None:
        """Give each selected parameter the ``requires_grad`` it had before freezing.

        A gradient dropped at freezing is not brought back (the parameter had to lose it to be
        frozen; an unfrozen parameter gets a new one at its next backward). Idempotent.
        """
        previous, self._previous = self._previous, []
        for p, requires_grad in previous:
            p.requires_grad_(requires_grad)

    def __repr__(self) -> str:
        return f"FreezeHandle({len(self.names)} parameters)"




def resolve_freeze(model: nn.Module, specs: Sequence[str]) -> list[str]:
    """The names of the parameters ``specs`` select, without changing the model.

    See :func:`apply_freezing` for the spec language.

    Raises:
        ValueError: when a spec selects nothing or is malformed.
    """
    if isinstance(specs, str):
        specs = [specs]
    canonical = dict(model.named_parameters())  # deduplicated: one name per tensor
    name_of = {id(p): name for name, p in canonical.items()}
    selected: set[int] = set()
    for spec in specs:
        ids = _select(model, spec.strip(), name_of)
        if not ids:
            raise ValueError(_nothing_matched(spec, canonical, model))
        selected |= ids
    return [name for name, p in canonical.items() if id(p) in selected]


def _select(model: nn.Module, spec: str, name_of: dict[int, str]) -> set[int]:
    """Ids of the parameters one spec selects."""
    if spec == "embeddings":
        ids = {
            id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        }
        ids |= {id(p) for name, p in model.named_parameters() if "embed" in name.lower()}
        return ids
    if spec == "body":
        head = _head_parameters(model)
        if not head:
            raise ValueError(
                f"freeze spec 'body' needs a task head to keep training, but "
                f"{type(model).__name__} has no module named like {', '.join(HEAD_NAMES)} and "
                "no child module with parameters; freeze by parameter-name patterns instead"
            )
        return {pid for pid in name_of if pid not in head}
    if spec.startswith("blocks:"):
        k = _parse_k(spec)
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(
                f"freeze spec {spec!r}: the model ({type(model).__name__}) has no repeated "
                "blocks (no ModuleList/Sequential of two or more modules of one class); "
                "freeze by parameter-name patterns instead"
            )
        if k > len(blocks):
            raise ValueError(
                f"freeze spec {spec!r} asks for {k} blocks but the model has {len(blocks)} "
                f"({blocks[0][0]} .. {blocks[-1][0]}); use blocks:{len(blocks)} or fewer"
            )
        return {id(p) for _, block in blocks[:k] for p in block.parameters()}
    # An fnmatch pattern over all names of each parameter (tied ones have several), or a
    # module name selecting everything below it.
    return {
        id(p)
        for name, p in model.named_parameters(remove_duplicate=False)
        if fnmatch.fnmatchcase(name, spec) or fnmatch.fnmatchcase(name, spec + ".*")
    }


def _parse_k(spec: str) -> int:
    text = spec.partition(":")[2]
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 1:
        raise ValueError(
            f"freeze spec {spec!r} is malformed; write blocks:K with K a whole number >= 1 "
            "(the first K repeated blocks)"
        )
    return k


def _head_parameters(model: nn.Module) -> set[int]:
    """Ids of the task head's parameters (see :func:`apply_freezing`, ``body``)."""
    heads: list[tuple[int, nn.Module]] = []
    for qualified, module in model.named_modules():
        if not qualified:
            continue
        own = qualified.rpartition(".")[2]
        if any(fnmatch.fnmatchcase(own, pat) for pat in HEAD_NAMES):
            heads.append((qualified.count("."), module))
    if heads:
        # The shallowest matches are the model's head; deeper ones are parts of it (or, in a
        # wrapper, the wrapped model's head at the same depth).
        depth = min(d for d, _ in heads)
        return {id(p) for d, m in heads if d == depth for p in m.parameters()}
    children = [m for _, m in model.named_children() if any(True for _ in m.parameters())]
    if not children:
        return set()
    return {id(p) for p in children[-1].parameters()}


def _nothing_matched(spec: str, params: dict[str, nn.Parameter], model: nn.Module) -> str:
    names = list(params)
    shown = ", ".join(names[:_SHOWN]) + (
        f", ... ({len(names)} in all)" if len(names) > _SHOWN else ""
    )
    if spec == "body":
        return (
            f"freeze spec 'body' selects nothing: {type(model).__name__} is all head (no "
            f"parameters outside its last module); its parameters are {shown}"
        )
    return (
        f"freeze spec {spec!r} matches no parameter of {type(model).__name__}; use "
        "'embeddings', 'body', 'blocks:K' or an fnmatch pattern over parameter names such as "
        f"{shown}"
    )


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> FreezeHandle:
    handle = apply_freezing(model, ctx.plan.freeze)
    ctx.info["frozen"] = handle.names
    return handle


#: Freezing decides which parameters train, so it applies before everything that looks at
#: the trainable set (precision's optimizer wrappers, the gradient buffer, the optimizer).
TECHNIQUE = Technique(
    name="freeze",
    plan_field="freeze",
    order=10,
    apply=_apply_technique,
    info_key="frozen",
    engines=frozenset({"single", "data", "hf", "lightning"}),
    allow={"freeze": "freeze the embeddings or the model body"},
    summary=lambda freeze: "freeze " + ",".join(freeze),
)
