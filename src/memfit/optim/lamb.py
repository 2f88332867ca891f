"""LAMB (You et al., 2020): Adam with a layer-wise trust ratio, for very large batches."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._base import MemfitOptimizer, compute_dtype, dense_grad, work_copy, write_back
from .sharding import local_tensor, norms

__all__ = ["Lamb"]


class Lamb(MemfitOptimizer):
    """Layer-wise Adaptive Moments for Batch training.

    Each parameter tensor ("layer") takes the Adam direction
    ``r = m_hat / (sqrt(v_hat) + eps)`` plus weight decay, ``u = r + weight_decay * w``, and
    rescales it by the trust ratio ``phi(||w||) / ||u||`` so that the step length is relative
    to the layer's own norm::

        w <- w - lr * phi(||w||) / ||u|| * u

    ``phi`` clamps the weight norm to at most ``clamp_value`` (the paper's scaling function).
    The ratio falls back to 1 when either norm is zero (fresh zero-initialised layers), decided
    with ``torch.where`` rather than a Python branch, so the step never syncs with the device
    and runs under ``FakeTensorMode``.

    Parameters sharded by FSDP2 (DTensors) are stepped shard by shard with state kept as plain
    local tensors (so ``state_dict()`` is per rank); the two norms of the trust ratio are of
    the whole parameter, reduced across shards in one ``all_reduce``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Term added to the denominator.
        weight_decay: Weight decay added to the direction before the trust ratio (part of
            the update the ratio normalises, as in the paper).
        bias_correction: Bias-correct the moments as Adam does; ``False`` matches
            ``torch_optimizer.Lamb`` with its default ``debias=False``.
        clamp_value: Upper bound of ``phi(||w||)``; ``None`` disables the clamp.

    Example:
        >>> model = torch.nn.Linear(32, 32)
        >>> opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        clamp_value: float | None = 10.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if clamp_value is not None and clamp_value <= 0.0:
            raise ValueError(f"clamp_value must be positive or None, got {clamp_value}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "clamp_value": clamp_value,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimisation step.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = self._run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = local_tensor(dense_grad(param, type(self).__name__))
                local = local_tensor(param)
                state = self.state[param]
                if not state:
                    dtype = compute_dtype(local)
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(local, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(local, dtype=dtype)
                work = work_copy(local)
                grad = grad.to(work.dtype)
                state["step"] += 1
                step = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if group["bias_correction"]:
                    # m_hat / (sqrt(v_hat) + eps) with m_hat = m / bc1, v_hat = v / bc2.
                    bc1 = 1.0 - beta1**step
                    bc2_sqrt = math.sqrt(1.0 - beta2**step)
                    denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(group["eps"])
                    update = (exp_avg / bc1).div_(denom)
                else:
                    update = exp_avg / exp_avg_sq.sqrt().add_(group["eps"])
                if group["weight_decay"] != 0.0:
                    update.add_(work, alpha=group["weight_decay"])

                weight_norm, update_norm = norms(param, work, update)
                if group["clamp_value"] is not None:
                    weight_norm = weight_norm.clamp(max=group["clamp_value"])
                trust_ratio = torch.where(
                    (weight_norm > 0) & (update_norm > 0),
                    weight_norm / update_norm,
                    torch.ones_like(weight_norm),
                )
                # Kept for monitoring (a 0-d tensor: reading it is the caller's choice to sync).
                state["trust_ratio"] = trust_ratio
                work.sub_(update.mul_(trust_ratio), alpha=group["lr"])
                write_back(local, work)
        return loss
