"""Fused pointwise chains in Hugging Face blocks: :func:`apply_fused_pointwise`.

Replaces, per module instance, the forward of the blocks whose pointwise chains
:mod:`memfit.ops.pointwise` fuses, with the same arithmetic and fewer saved tensors:

* **RMSNorm** (Llama, Mistral, Qwen, Mixtral, Phi-3, ... and Gemma's ``1 + weight`` variant):
  saves the input and one float per row, not the normalised rows (and, in low precision, not
  the fp32 copy either). Costs one more elementwise pass in backward.
* **Gated MLPs** (``down_proj(act(gate_proj(x)) * up_proj(x))``, SwiGLU and GeGLU): saves
  ``gate`` and ``up``, not ``act(gate)``. Costs recomputing the activation in backward.

transformers' modules are not changed in their class, parameters or hooks: only an instance
``forward`` is set, which :meth:`FusedPointwiseHandle.remove` deletes. A model with none of these
blocks is refused with a sentence (the plan asked for something that would do nothing).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..ops.pointwise import ACTIVATIONS, gated_activation, rms_norm

__all__ = ["FusedPointwiseHandle", "apply_fused_pointwise"]


@dataclass
class FusedPointwiseHandle:
    """The modules :func:`apply_fused_pointwise` changed, and how to undo it.

    Attributes:
        norms: Qualified names of the RMSNorm modules fused.
        mlps: Qualified names of the gated MLPs fused.
    """

    norms: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    _modules: list[nn.Module] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Give every changed module its class's forward back (idempotent)."""
        modules, self._modules = self._modules, []
        for module in modules:
            module.__dict__.pop("forward", None)


def _norm_style(module: nn.Module) -> tuple[float, bool] | None:
    """(offset, cast before weight) for an RMSNorm transformers writes one of two ways."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if not name.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if name.startswith("Gemma") and hasattr(module, "eps"):
        return 1.0, False  # output * (1 + weight) in fp32, then cast
    if hasattr(module, "variance_epsilon"):
        return 0.0, True  # weight * normed.to(input dtype)
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
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(module, "act_fn")


def _mlp_forward(act: str) -> Any:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), act))

    return forward


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
        if _is_gated_mlp(module):
            act = _activation(module)
            if act is not None:
                module.forward = types.MethodType(_mlp_forward(act), module)
                handle.mlps.append(name)
                handle._modules.append(module)
    if not handle._modules:
        raise ValueError(
            f"fused_pointwise found nothing to fuse in {type(model).__name__}: it fuses "
            "transformers' RMSNorm modules and gated MLPs (gate_proj, up_proj, down_proj with "
            f"activation {', '.join(ACTIVATIONS)}); turn it off for this model"
        )
    return handle
