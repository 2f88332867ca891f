"""1-bit Adam (Tang et al., 2021): Adam during a warm-up, then frozen variance and momentum.

The optimizer half of 1-bit Adam. Its communication half, the DDP hook that all-reduces the
momentum as one sign bit per element with error feedback, is
:mod:`memfit.distributed.onebit`; this class needs nothing of it and runs on one process too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ._base import MemfitOptimizer, compute_dtype, dense_grad, work_copy, write_back

__all__ = ["OneBitAdam"]


class OneBitAdam(MemfitOptimizer):
    """Adam for ``warmup_steps`` steps, then Adam with its variance frozen (1-bit Adam).

    The two stages of Tang et al. (2021), "1-bit Adam: Communication Efficient Large-Scale
    Training with Adam's Convergence Speed":

    * **Warm-up** (steps ``1 .. warmup_steps``): exactly Adam, with AdamW's decoupled weight
      decay: ``weight_decay=0`` steps as ``torch.optim.Adam``, ``weight_decay>0`` as
      ``torch.optim.AdamW`` (bias-corrected moments, ``eps`` outside the square root).
    * **Compression stage** (every later step): the second moment ``v`` is no longer updated;
      the momentum ``m = beta1 * m + (1 - beta1) * g`` still is, and the step is
      ``w <- w - lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**warmup_steps)) + eps)``:
      Adam's preconditioner frozen as it was after the last warm-up step (bias correction
      included, so the step size does not jump at the switch; the paper's algorithm has no
      bias correction because its warm-ups are long enough for it not to matter).

    The frozen variance is what makes compressing the communication possible: the update is
    then linear in the momentum, so an all-reduce of a compressed momentum with error feedback
    gives, summed over steps, the same update as the exact one. The compression itself is the
    DDP communication hook :func:`memfit.distributed.onebit.register_onebit_adam`, which makes
    ``param.grad`` the average gradient implied by the compressed momentum; this class only
    sees gradients. On one process (no hook, or a group of one) nothing is compressed and this
    is plain Adam-then-frozen-variance.

    The momentum's bias correction uses the step count ``t``, which after a warm-up of a few
    hundred steps is 1 to float precision.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Term added to the denominator.
        weight_decay: Decoupled weight decay (AdamW's): ``w <- w * (1 - lr * weight_decay)``.
        warmup_steps: Adam steps before the variance is frozen (at least 1: the frozen variance
            must have seen gradients). The paper warms up for 15-25% of training.

    Example:
        >>> model = torch.nn.Linear(32, 32)
        >>> opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=100)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        warmup_steps: int = 100,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be an integer >= 1 (the frozen variance must have seen "
                f"gradients), got {warmup_steps!r}"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "warmup_steps": int(warmup_steps),
        }
        super().__init__(params, defaults)

    def compressible_momentum(self, param: Tensor) -> tuple[float, Tensor] | None:
        """What a communication hook needs to compress ``param``'s next step, if it may.

        The hook compresses a parameter's momentum only when this optimizer's next step of it
        is in the compression stage (its warm-up is over).

        Args:
            param: A parameter, typically one of a DDP gradient bucket's.

        Returns:
            ``(beta1, exp_avg)``, the parameter's momentum coefficient and its current
            momentum (the optimizer's own buffer: read it, do not write it), when ``param`` is
            stepped by this optimizer and its next step is past the warm-up; otherwise
            ``None`` (the gradient must then be all-reduced exactly).
        """
        group = self._group_of(param)
        if group is None:
            return None
        state = self.state.get(param)
        if not state or state["step"] < group["warmup_steps"]:
            return None
        return group["betas"][0], state["exp_avg"]

    def _group_of(self, param: Tensor) -> dict[str, Any] | None:
        # Cached for the hook's per-bucket lookups, rebuilt when the groups are not the same
        # dicts any more (add_param_group, load_state_dict) or a parameter is missing.
        key = tuple(id(g) for g in self.param_groups)
        cached: tuple[tuple[int, ...], dict[Tensor, dict[str, Any]]] | None = getattr(
            self, "_groups_by_param", None
        )
        if cached is None or cached[0] != key or param not in cached[1]:
            cached = (key, {p: g for g in self.param_groups for p in g["params"]})
            self._groups_by_param = cached
        return cached[1].get(param)

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
            warmup = group["warmup_steps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = dense_grad(param, type(self).__name__)
                state = self.state[param]
                if not state:
                    dtype = compute_dtype(param)
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
                work = work_copy(param)
                grad = grad.to(work.dtype)
                state["step"] += 1
                step = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

                exp_avg.lerp_(grad, 1.0 - beta1)
                if step <= warmup:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                # After the warm-up v stays as it was at step `warmup`, and so does its bias
                # correction: the preconditioner is frozen whole.
                bc1 = 1.0 - beta1**step
                bc2_sqrt = math.sqrt(1.0 - beta2 ** min(step, warmup))
                denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(group["eps"])
                if group["weight_decay"] != 0.0:
                    work.mul_(1.0 - group["lr"] * group["weight_decay"])
                work.addcdiv_(exp_avg, denom, value=-group["lr"] / bc1)
                write_back(param, work)
        return loss
