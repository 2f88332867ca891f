"""LARS (You, Gitman & Ginsburg, 2017): SGD with momentum and layer-wise trust ratios."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._base import MemfitOptimizer, compute_dtype, dense_grad, work_copy, write_back
from .sharding import local_tensor, norms

__all__ = ["Lars"]


class Lars(MemfitOptimizer):
    """Layer-wise Adaptive Rate Scaling on top of SGD with momentum.

    For each parameter tensor the gradient (plus weight decay) is scaled by the local learning
    rate of the paper::

        trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)
        d     = trust * (g + weight_decay * w)
        buf   = momentum * buf + (1 - dampening) * d      (buf = d on the first step)
        w    <- w - lr * (d + momentum * buf if nesterov else buf)

    ``trust`` falls back to 1 when ``||w||`` or ``||g||`` is zero (decided with ``torch.where``,
    no host sync, so it runs under ``FakeTensorMode``).

    With ``exclude_1d`` (default) parameters with at most one dimension -- biases and
    normalisation scales -- skip both the trust ratio and weight decay and take plain SGD
    momentum steps, as is customary (their norms say little about a sensible step and decaying
    them hurts).  ``exclude_1d`` is a group option, so it can be set per parameter group.

    Parameters sharded by FSDP2 (DTensors) are stepped shard by shard with the momentum buffer
    kept as a plain local tensor (so ``state_dict()`` is per rank); the norms of the trust
    ratio are of the whole parameter, reduced across shards in one ``all_reduce``.

    Args:
        params: Parameters or parameter groups.
        lr: Global learning rate.
        momentum: Momentum factor.
        weight_decay: L2 penalty coefficient (added to the gradient before scaling).
        eta: Trust coefficient.
        eps: Term added to the trust ratio's denominator.
        dampening: Dampening for momentum.
        nesterov: Use Nesterov momentum.
        exclude_1d: Exempt tensors with ``ndim <= 1`` from adaptation and weight decay.

    Example:
        >>> model = torch.nn.Linear(32, 32)
        >>> opt = Lars(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        *,
        eta: float = 1e-3,
        eps: float = 1e-8,
        dampening: float = 0.0,
        nesterov: bool = False,
        exclude_1d: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if eta <= 0.0:
            raise ValueError(f"Invalid trust coefficient eta: {eta}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "eta": eta,
            "eps": eps,
            "dampening": dampening,
            "nesterov": nesterov,
            "exclude_1d": exclude_1d,
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
            momentum = group["momentum"]
            weight_decay = group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = local_tensor(dense_grad(param, type(self).__name__))
                local = local_tensor(param)
                state = self.state[param]
                work = work_copy(local)
                grad = grad.to(work.dtype)
                if not (group["exclude_1d"] and param.ndim <= 1):
                    weight_norm, grad_norm = norms(param, work, grad)
                    trust = torch.where(
                        (weight_norm > 0) & (grad_norm > 0),
                        group["eta"]
                        * weight_norm
                        / (grad_norm + weight_decay * weight_norm + group["eps"]),
                        torch.ones_like(weight_norm),
                    )
                    grad = grad.add(work, alpha=weight_decay) if weight_decay != 0.0 else grad
                    grad = grad * trust
                if momentum != 0.0:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = grad.detach().to(compute_dtype(local), copy=True)
                        state["momentum_buffer"] = buf
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1.0 - group["dampening"])
                    grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
                work.add_(grad, alpha=-group["lr"])
                write_back(local, work)
        return loss
