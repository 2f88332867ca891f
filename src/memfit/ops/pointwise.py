"""Fused pointwise chains that keep fewer tensors for backward than their eager composition.

Eager autograd saves what each operator needs: a chain of pointwise operators saves an
intermediate per link, each the size of the activation. These functions are single autograd
nodes that save only their inputs (or a smaller substitute) and recompute the rest in
backward, which costs a few elementwise passes and no matmul. ``torch.compile`` fuses such
chains too (and its min-cut partitioner recomputes them); these are for runs that do not
compile (dry runs, eager debugging, models compile cannot take).

* :func:`gated_activation`: ``act(gate) * up`` (SwiGLU, GeGLU) saves ``gate`` and ``up``,
  not ``act(gate)``: one activation-sized tensor less per gated MLP.
* :func:`rms_norm`: saves the input and the per-row reciprocal RMS (one float per row), not
  the fp32 copy, its square, the normalised rows and the cast: from 3-5 activation-sized
  tensors to one.
* :func:`bias_dropout_add`: ``residual + dropout(x + bias)`` saves the dropout mask as bool
  (one byte per element) instead of eager's mask in the activation's dtype, and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

__all__ = ["ACTIVATIONS", "bias_dropout_add", "gated_activation", "rms_norm"]


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    c = math.sqrt(2 / math.pi)
    inner = c * (x + 0.044715 * x.pow(3))
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return cdf + x * pdf


#: Activation name -> (function, its derivative), by the names transformers' ``ACT2FN`` uses.
ACTIVATIONS: dict[str, tuple[Any, Any]] = {
    "silu": (F.silu, _silu_grad),
    "swish": (F.silu, _silu_grad),
    "gelu": (F.gelu, _gelu_grad),
    "gelu_pytorch_tanh": (lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_grad),
    "gelu_new": (lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_grad),
}


class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        fn, _ = ACTIVATIONS[act]
        ctx.save_for_backward(gate, up)
        ctx.act = act  # type: ignore[attr-defined]
        return fn(gate) * up

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        gate, up = ctx.saved_tensors  # type: ignore[attr-defined]
        fn, derivative = ACTIVATIONS[ctx.act]  # type: ignore[attr-defined]
        # In the gate's precision (fp32 math for low-precision inputs, as eager's kernels do).
        g32 = gate.float()
        grad_up = (grad.float() * fn(g32)).to(up.dtype) if ctx.needs_input_grad[1] else None  # type: ignore[attr-defined]
        grad_gate = (grad.float() * up.float() * derivative(g32)).to(gate.dtype)
        return grad_gate, grad_up, None


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` as one autograd node that saves only ``gate`` and ``up``.

    Args:
        gate: The gate projection's output.
        up: The up projection's output (same shape and dtype).
        act: One of :data:`ACTIVATIONS` (``silu`` for SwiGLU, ``gelu_pytorch_tanh`` for GeGLU).

    Raises:
        ValueError: for an unknown activation.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not fused; use one of {', '.join(ACTIVATIONS)}")
    return _GatedActivation.apply(gate, up, act)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        offset: float,
        cast_before_weight: bool,
    ) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = x32 * rstd
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.cast = offset, cast_before_weight  # type: ignore[attr-defined]
        if weight is None:
            return normed.to(x.dtype)
        scale = weight + offset if offset else weight
        if cast_before_weight:  # Llama: the weight multiplies the normalised rows in x's dtype
            return scale * normed.to(x.dtype)
        return (normed * scale.float()).to(x.dtype)  # Gemma: in fp32, then cast

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
        x32 = x.float()
        normed = x32 * rstd
        g = grad.float()
        grad_weight = None
        if weight is not None:
            scale = (weight + ctx.offset if ctx.offset else weight).float()  # type: ignore[attr-defined]
            if ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
                rows = normed.to(x.dtype).float() if ctx.cast else normed  # type: ignore[attr-defined]
                grad_weight = (g * rows).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            g = g * scale
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed)).
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> torch.Tensor:
    """RMSNorm over the last dimension, saving only ``x`` and one float per row for backward.

    Args:
        x: The input.
        weight: The scale (``None``: none).
        eps: Added to the mean square.
        offset: Added to the weight (Gemma scales by ``1 + weight``).
        cast_before_weight: Cast the normalised rows to ``x``'s dtype before the weight
            multiplies them (Llama) rather than after (Gemma).
    """
    return _RMSNorm.apply(x, weight, eps, offset, cast_before_weight)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        p: float,
    ) -> torch.Tensor:
        h = x + bias if bias is not None else x
        keep = torch.empty(h.shape, dtype=torch.bool, device=h.device).bernoulli_(1 - p)
        ctx.save_for_backward(keep)
        ctx.scale = 1 / (1 - p)  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return residual + h * keep * ctx.scale  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        (keep,) = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_h = grad * keep * ctx.scale  # type: ignore[attr-defined]
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
            grad_bias = grad_h.reshape(-1, grad_h.shape[-1]).sum(0)
        return grad_h, grad_bias, grad, None


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
) -> torch.Tensor:
    """``residual + dropout(x + bias, p)``, saving the dropout mask as bool and nothing else.

    Without training or with ``p == 0`` it is the plain sum (nothing saved).

    Raises:
        ValueError: for ``p`` outside ``[0, 1)``.
    """
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability must be at least 0 and below 1, got {p!r}")
    if not training or p == 0:
        h = x + bias if bias is not None else x
        return residual + h
    return _BiasDropoutAdd.apply(x, bias, residual, p)
