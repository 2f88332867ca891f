"""Fused pointwise chains in Hugging Face blocks: :func:`apply_fused_pointwise`.

Replaces, per module instance, the forward of the blocks whose pointwise chains
:mod:`memfit.ops.pointwise` fuses, with the same arithmetic and fewer saved tensors:

* **RMSNorm** (Llama, Mistral, Qwen, Mixtral, Phi-3, ... and Gemma's ``1 + weight`` variant):
  saves the input and one float per row, not the normalised rows (and, in low precision, not
  the fp32 copy either). Costs one more elementwise pass in backward.
* **Gated MLPs** (``down_proj(act(gate_proj(x)) * up_proj(x))``, SwiGLU and GeGLU): saves
  ``gate`` and ``up``, not ``act(gate)``. Costs recomputing the activation in backward.
* **The tanh GELU written out in Python** (transformers' ``NewGELUActivation``, GPT-2's
  ``gelu_new``: seven elementwise operators, four of whose results are kept): one
  ``F.gelu(approximate="tanh")``, which keeps only its input. Same formula; values differ by
  rounding only.

Only modules whose class ``forward`` is transformers' stock code for these blocks (Llama's
RMSNorm and MLP, Gemma's RMSNorm, and their generated copies in other models) are replaced;
a variant with anything more (a clamp, a multiplier, a sub-norm, dropout) is left alone.

transformers' modules are not changed in their class, parameters or hooks: only an instance
``forward`` is set, which :meth:`FusedPointwiseHandle.remove` deletes. A model with none of these
blocks is refused with a sentence (the plan asked for something that would do nothing).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..ops.pointwise import ACTIVATIONS, gated_activation, rms_norm
from ..techniques import ApplyContext, Technique

__all__ = ["FusedPointwiseHandle", "apply_fused_pointwise"]


@dataclass
class FusedPointwiseHandle:
    """The modules :func:`apply_fused_pointwise` changed, and how to undo it.

    Attributes:
        norms: Qualified names of the RMSNorm modules fused.
        mlps: Qualified names of the gated MLPs fused.
        activations: Qualified names of the Python tanh-GELU activations replaced.
    """

    norms: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    activations: list[str] = field(default_factory=list)
    _modules: list[nn.Module] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Give every changed module its class's forward back (idempotent)."""
        modules, self._modules = self._modules, []
        for module in modules:
            module.__dict__.pop("forward", None)


def _source(func: Any) -> str | None:
    """``func``'s code without comments, docstrings or formatting (for comparing copies)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0]
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            fn.body = body[1:]  # the docstring
        fn.name = "forward"
        fn.decorator_list = []
    return ast.dump(tree)


@functools.cache
def _reference(kind: str) -> str | None:
    """The code of the stock transformers forward each fused kind reproduces."""
    import transformers.models.gemma.modeling_gemma as gemma
    import transformers.models.llama.modeling_llama as llama

    return {
        "llama-norm": _source(llama.LlamaRMSNorm.forward),
        "gemma-norm": _source(gemma.GemmaRMSNorm.forward),
        "gemma-norm-inner": _source(gemma.GemmaRMSNorm._norm),
        "gated-mlp": _source(llama.LlamaMLP.forward),
    }[kind]


@functools.cache
def _class_kind(cls: type) -> str | None:
    """Which fused kind ``cls`` is: only classes whose forward is transformers' stock code,
    character for character up to names (the many generated copies of Llama's RMSNorm and
    MLP are), qualify; a variant (a clamp, a multiplier, a sub-norm, dropout) does not."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    code = _source(forward)
    if code is None:
        return None
    if code == _reference("llama-norm"):
        return "llama-norm"
    if code == _reference("gemma-norm") and _source(getattr(cls, "_norm", None)) == _reference(
        "gemma-norm-inner"
    ):
        return "gemma-norm"
    if code == _reference("gated-mlp"):
        return "gated-mlp"
    return None


def _norm_style(module: nn.Module) -> tuple[float, bool] | None:
    """(offset, cast before weight) for an RMSNorm whose forward is Llama's or Gemma's."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    kind = _class_kind(type(module))
    if kind == "llama-norm" and hasattr(module, "variance_epsilon"):
        return 0.0, True  # weight * normed.to(input dtype)
    if kind == "gemma-norm" and hasattr(module, "eps"):
        return 1.0, False  # normed * (1 + weight) in fp32, then cast
    return None


def _norm_forward(offset: float, cast: bool) -> Any:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", None)
        eps = getattr(self, "eps", 1e-6) if eps is None else eps
        return rms_norm(hidden_states, self.weight, eps, offset=offset, cast_before_weight=cast)

    return forward


def _activation(module: nn.Module) -> str | None:
    config = getattr(module, "config", None)
    for key in ("hidden_activation", "hidden_act"):
        act = getattr(config, key, None)
        if isinstance(act, str):
            return act if act in ACTIVATIONS else None
    return None


def _is_gated_mlp(module: nn.Module) -> bool:
    return (
        all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
        and hasattr(module, "act_fn")
        and _class_kind(type(module)) == "gated-mlp"
    )


def _mlp_forward(act: str) -> Any:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), act))

    return forward


def _tanh_gelu(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def apply_fused_pointwise(model: nn.Module, config: Any = None) -> FusedPointwiseHandle:
    """Fuse the RMSNorms and gated MLPs of ``model`` (see the module docstring).

    Args:
        model: A model with transformers-style RMSNorm or gated MLP modules.
        config: Unused; accepted for the ``apply_x(model, config)`` convention.

    Returns:
        The :class:`FusedPointwiseHandle` (``remove()`` restores the modules).

    Raises:
        ValueError: when the model has no module to fuse, naming what is looked for.
    """
    handle = FusedPointwiseHandle()
    for name, module in model.named_modules():
        if "forward" in module.__dict__:
            continue  # already replaced (by us or by another technique): leave it
        style = _norm_style(module)
        if style is not None:
            module.forward = types.MethodType(_norm_forward(*style), module)
            handle.norms.append(name)
            handle._modules.append(module)
            continue
        if type(module).__name__ == "NewGELUActivation":
            module.forward = types.MethodType(_tanh_gelu, module)
            handle.activations.append(name)
            handle._modules.append(module)
            continue
        if _is_gated_mlp(module):
            act = _activation(module)
            if act is not None:
                module.forward = types.MethodType(_mlp_forward(act), module)
                handle.mlps.append(name)
                handle._modules.append(module)
    if not handle._modules:
        raise ValueError(
            f"fused_pointwise found nothing to fuse in {type(model).__name__}: it fuses "
            "transformers' RMSNorm modules, gated MLPs (gate_proj, up_proj, down_proj with "
            f"activation {', '.join(ACTIVATIONS)}) and Python tanh-GELUs (gelu_new); turn it "
            "off for this model"
        )
    return handle


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> FusedPointwiseHandle:
    handle = apply_fused_pointwise(model)
    ctx.info["fused_pointwise"] = handle.norms + handle.mlps + handle.activations
    return handle


def _check(plan: Any) -> None:
    """The switch is a bool (``Technique.check``)."""
    if not isinstance(plan.fused_pointwise, bool):
        raise ValueError(f"fused_pointwise must be true or false, got {plan.fused_pointwise!r}")


#: Fused forwards replace instance ``forward`` attributes only, before precision and
#: checkpointing, which wrap what they find.
TECHNIQUE = Technique(
    name="fused_pointwise",
    plan_field="fused_pointwise",
    order=20,
    apply=_apply_technique,
    info_key="fused_pointwise",
    engines=frozenset({"single", "data", "hf", "lightning"}),
    summary=lambda _: "fused pointwise",
    check=_check,
)
