"""Adafactor (Shazeer & Stern, 2018): Adam-like steps with a factored second moment."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..device import is_fake
from ._base import MemfitOptimizer, compute_dtype, dense_grad, work_copy, write_back
from ._dry import next_step, run_update
from .rounding import stochastic_round_to_bf16
from .sharding import all_reduce_sum_, is_sharded, local_tensor, norms

__all__ = ["Adafactor"]


class Adafactor(MemfitOptimizer):
    """Adafactor, hyper-parameter compatible with ``transformers.optimization.Adafactor``.

    For parameters with two or more dimensions the second-moment estimate is *factored*: only
    running averages of the squared gradient's row means (over the last dimension) and column
    means (over the second-to-last) are kept, O(n + m) state for an n x m matrix, and the full
    estimate is their normalised outer product.  Vectors keep an ordinary running average.
    Without ``beta1`` there is no first moment at all, so the state is a tiny fraction of
    Adam's 8 bytes per parameter.

    The rest of the recipe of the paper is included:

    * relative step size ``min(1e-2, 1/sqrt(t))`` (or ``min(1e-6 t, 1/sqrt(t))`` with
      ``warmup_init``) when ``relative_step`` is on, otherwise the given ``lr``;
    * ``scale_parameter`` multiplies the step by ``max(eps[1], RMS(param))``, making it relative
      to the parameter's own scale;
    * update clipping: the update is divided by ``max(1, RMS(update) / clip_threshold)``;
    * increasing second-moment decay ``beta2_t = 1 - t ** decay_rate``;
    * ``eps[0]`` is added to the squared gradient (regulariser of the second moment).

    As in the transformers implementation, ``weight_decay`` is decoupled and scaled by the
    step size, and ``beta1`` applies momentum to the already scaled and clipped update.
    bf16/fp16 parameters are updated in fp32 (state is fp32) and rounded once per step.  No
    step-time host synchronisation: the step size is kept as a tensor where it depends on the
    parameter's RMS, so the optimizer also runs under ``FakeTensorMode``.

    Parameters sharded by FSDP2 (DTensors) are stepped shard by shard, state kept as plain
    local tensors (so ``state_dict()`` is per rank), and the result is the unsharded one: the
    statistics that run across a split dimension (with ``Shard(0)`` of a matrix, the column
    means and the mean of the row statistics) and the parameter and update RMS are sums over
    the whole tensor, reduced across shards with ``all_reduce``.

    Args:
        params: Parameters or parameter groups.
        lr: The step size, fixed (torch's ``torch.optim.Adafactor`` takes ``lr`` directly
            too). ``None`` (the default) uses the paper's relative step size instead.
        eps: ``(eps1, eps2)``: regulariser added to squared gradients, and the lower bound of
            the parameter scale.
        clip_threshold: Threshold ``d`` of the update clipping.
        decay_rate: Exponent of the ``beta2`` schedule ``1 - t ** decay_rate``.
        beta1: Momentum coefficient, or ``None`` for no first moment.
        weight_decay: Decoupled weight decay coefficient.
        scale_parameter: Scale the step by the parameter RMS (as torch's Adafactor always
            does, ``lr`` given or not).
        relative_step: Use the time-dependent relative step size instead of ``lr``. ``None``:
            on exactly when no ``lr`` is given.
        warmup_init: Linear warm-up of the relative step size (needs ``relative_step``).
        chunk_size: Matrices with more elements are stepped in row chunks of about this many
            elements (three passes: statistics, update RMS, update), so the step's fp32
            temporaries stay about ``16 * chunk_size`` bytes instead of several full copies of
            the largest matrix (an embedding table). Same result up to summation order.
        stochastic_rounding: Round updated bf16 weights stochastically (unbiased) instead of
            to nearest, so updates smaller than half a bf16 ulp are not lost.

    Example:
        >>> model = torch.nn.Linear(16, 16)
        >>> opt = Adafactor(model.parameters())  # relative step, no momentum
        >>> opt = Adafactor(model.parameters(), lr=1e-3, beta1=0.9)  # fixed lr, momentum
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool | None = None,
        warmup_init: bool = False,
        *,
        chunk_size: int = 1 << 20,
        stochastic_rounding: bool = False,
    ) -> None:
        # A given lr is a fixed step size (torch's convention); the relative step size and the
        # parameter scaling are the defaults only without one (the old transformers signature
        # refused lr unless relative_step=False was spelled out as well).
        if relative_step is None:
            relative_step = lr is None
        if lr is not None and relative_step:
            raise ValueError(
                "Adafactor got both lr and relative_step=True; drop lr to use the relative step "
                "size, or drop relative_step to use lr as the step size"
            )
        if lr is None and not relative_step:
            raise ValueError("`relative_step=False` needs an explicit `lr`")
        if warmup_init and not relative_step:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        if beta1 is not None and not 0.0 <= beta1 < 1.0:
            raise ValueError(f"Invalid beta1: {beta1}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {
            "lr": lr,
            "eps": eps,
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "beta1": beta1,
            "weight_decay": weight_decay,
            "scale_parameter": scale_parameter,
            "relative_step": relative_step,
            "warmup_init": warmup_init,
        }
        super().__init__(params, defaults)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 element, got {chunk_size}")
        self.chunk_size = chunk_size
        self.stochastic_rounding = stochastic_rounding
        self._generators: dict[torch.device, torch.Generator] = {}

    #: bf16/fp16 weights are updated here in fp32 chunks (precision strategies need no shadow).
    handles_low_precision = True

    @staticmethod
    def _rms(tensor: Tensor, like: Tensor) -> Tensor:
        """RMS of the whole tensor shaped like ``like`` whose local shard is ``tensor``."""
        (norm,) = norms(like, tensor)
        return norm / math.sqrt(like.numel())

    @staticmethod
    def _relative_step_size(group: dict[str, Any], step: int) -> float:
        if not group["relative_step"]:
            return float(group["lr"])
        min_step = 1e-6 * step if group["warmup_init"] else 1e-2
        return min(min_step, 1.0 / math.sqrt(step))

    @staticmethod
    def _get_lr(param_group: dict[str, Any], param_state: dict[str, Any]) -> Tensor | float:
        """Step size of the last step (what ``transformers.AdafactorSchedule`` reads)."""
        rel = Adafactor._relative_step_size(param_group, max(param_state["step"], 1))
        if param_group["scale_parameter"]:
            return torch.as_tensor(param_state["RMS"]).clamp(min=param_group["eps"][1]) * rel
        return rel

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        dtype = compute_dtype(param)
        shape = param.shape
        state["step"] = 0
        # Parameter RMS of the latest step, kept for transformers.AdafactorSchedule.
        state["RMS"] = torch.zeros((), dtype=torch.float32, device=param.device)
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
        if len(shape) >= 2:
            state["exp_avg_sq_row"] = torch.zeros(shape[:-1], dtype=dtype, device=param.device)
            state["exp_avg_sq_col"] = torch.zeros(
                shape[:-2] + shape[-1:], dtype=dtype, device=param.device
            )
        else:
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)

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
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = local_tensor(dense_grad(param, type(self).__name__))
                local = local_tensor(param)
                state = self.state[param]
                if not state:
                    self._init_state(local, state, group)
                run_update(
                    self,
                    group,
                    (tuple(param.shape), self.chunk_size, self.stochastic_rounding),
                    (local, grad),
                    state,
                    self._update,
                    (param, grad, local, state, group),
                    on_replay=next_step,
                )
        return loss

    def _update(
        self,
        param: Tensor,
        grad: Tensor,
        local: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> None:
        """One parameter's update (its state exists)."""
        eps1, eps2 = group["eps"]
        beta1 = group["beta1"]
        # The whole parameter's size: every rank of a sharded one takes the same path
        # (and so runs the same collectives).
        if param.dim() == 2 and param.numel() > self.chunk_size:
            self._chunked_factored_step(param, grad, state, group)
            return
        work = work_copy(local)
        grad = grad.to(work.dtype)

        state["step"] += 1
        step = state["step"]
        rms = self._rms(work, param)
        state["RMS"].copy_(rms)
        # A tensor when it depends on the parameter RMS: using it in place avoids a
        # host sync (and works under fake tensors) where float(rms) would not.
        lr: Tensor | float = self._relative_step_size(group, step)
        if group["scale_parameter"]:
            lr = rms.clamp(min=eps2) * lr

        beta2t = 1.0 - math.pow(step, group["decay_rate"])
        sq_grad = grad.square()
        if "exp_avg_sq_row" in state:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            # eps1 is added to the (small) means rather than to every squared gradient:
            # the same value up to rounding, one full pass fewer.
            row_mean = _mean(sq_grad, -1, param, -1).add_(eps1)
            col_mean = _mean(sq_grad, -2, param, -2).add_(eps1)
            del sq_grad
            row.mul_(beta2t).add_(row_mean, alpha=1.0 - beta2t)
            col.mul_(beta2t).add_(col_mean, alpha=1.0 - beta2t)
            update = _factored_rsqrt(row, col, param).mul_(grad)
        else:
            exp_avg_sq = state["exp_avg_sq"]
            exp_avg_sq.mul_(beta2t).add_(sq_grad.add_(eps1), alpha=1.0 - beta2t)
            del sq_grad
            update = exp_avg_sq.rsqrt().mul_(grad)

        # Clipping and the step size folded into one scalar: one pass over the update.
        scale = lr / (self._rms(update, param) / group["clip_threshold"]).clamp_(min=1.0)
        if beta1 is not None:
            exp_avg = state["exp_avg"]
            exp_avg.mul_(beta1).add_(update.mul_(scale), alpha=1.0 - beta1)
            update, scale = exp_avg, None
        self._step_into(local, work, update, scale, group, lr)

    def _step_into(
        self,
        target: Tensor,
        work: Tensor,
        update: Tensor,
        scale: Tensor | float | None,
        group: dict[str, Any],
        lr: Tensor | float,
    ) -> None:
        """Weight decay and the step (``update`` times ``scale``; ``None``: already scaled)
        on ``work``, written into ``target``: the last part of every update."""
        if group["weight_decay"] != 0.0:
            work.mul_(1.0 - group["weight_decay"] * lr)
        if scale is None:
            work.sub_(update)
        else:
            work.addcmul_(update, scale, value=-1.0)
        self._write(target, work)

    def _write(self, param: Tensor, work: Tensor) -> None:
        """Write fp32 ``work`` into ``param``: rounded stochastically to bf16 when asked."""
        if work is param:
            return
        if self.stochastic_rounding and param.dtype == torch.bfloat16:
            gen = self._generators.get(param.device)
            if gen is None and not is_fake(param):
                gen = torch.Generator(device=param.device)
                gen.manual_seed(torch.initial_seed() + 0xADAF)
                self._generators[param.device] = gen
            param.copy_(stochastic_round_to_bf16(work, gen))
        else:
            write_back(param, work)

    def _chunked_factored_step(
        self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """The factored step of a large matrix, in row chunks: no full-size fp32 temporary.

        Pass 1 accumulates the squared gradient's row means and column sums, pass 2 the
        update's sum of squares (for update clipping) and the parameter's (for its RMS), pass 3
        applies the update chunk by chunk. Rows are independent given the new statistics, so
        this is the unchunked step reorganised, not an approximation.

        ``param`` may be a sharded DTensor (``grad`` is then its local gradient): the passes
        run over the local shard, and the sums that span a split dimension are reduced after
        the loops (never inside them: ranks may hold different numbers of chunks).
        """
        eps1, eps2 = group["eps"]
        beta1 = group["beta1"]
        local = local_tensor(param)
        n, m = local.shape
        rows = max(1, self.chunk_size // m)
        chunks = [(r, min(r + rows, n)) for r in range(0, n, rows)]
        if is_fake(local) and len(chunks) > 2:
            # Fake tensors have no values, and every full chunk allocates the same temporaries
            # and frees them before the next (its results go in place): the first chunk and
            # the last (maybe shorter) one show each pass's memory exactly, at a fraction of a
            # dry run's dispatch cost (the planner's full-depth runs step every matrix).
            chunks = [chunks[0], chunks[-1]]
        dtype = compute_dtype(local)
        state["step"] += 1
        step = state["step"]
        beta2t = 1.0 - math.pow(step, group["decay_rate"])
        # Columns split across ranks: local row sums, reduced and averaged after the loop.
        cols_split = is_sharded(param, [-1])

        row_mean = torch.empty(n, dtype=dtype, device=local.device)
        col_sum = torch.zeros(m, dtype=dtype, device=local.device)
        param_sq = torch.zeros((), dtype=dtype, device=local.device)
        for lo, hi in chunks:
            sq = grad[lo:hi].to(dtype).square()
            row_mean[lo:hi] = sq.sum(dim=-1) if cols_split else sq.mean(dim=-1)
            col_sum += sq.sum(dim=0)
            param_sq += local[lo:hi].to(dtype).square().sum()
            del sq
        if cols_split:
            all_reduce_sum_(row_mean, param, [-1]).div_(param.shape[-1])
        all_reduce_sum_(col_sum, param, [-2])
        all_reduce_sum_(param_sq, param)
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        row.mul_(beta2t).add_(row_mean.add_(eps1), alpha=1.0 - beta2t)
        col.mul_(beta2t).add_(col_sum.div_(param.shape[-2]).add_(eps1), alpha=1.0 - beta2t)
        del row_mean, col_sum
        row_factor = (row / _mean(row, -1, param, -2)).rsqrt_().unsqueeze(-1)
        col_factor = col.rsqrt().unsqueeze(0)

        rms = (param_sq / param.numel()).sqrt()
        state["RMS"].copy_(rms)
        lr: Tensor | float = self._relative_step_size(group, step)
        if group["scale_parameter"]:
            lr = rms.clamp(min=eps2) * lr
        update_sq = torch.zeros((), dtype=dtype, device=local.device)
        for lo, hi in chunks:
            # Out of place: for fp32 gradients .to() is the gradient itself.
            update = grad[lo:hi].to(dtype) * row_factor[lo:hi] * col_factor
            update_sq += update.square().sum()
            del update
        all_reduce_sum_(update_sq, param)
        update_rms = (update_sq / param.numel()).sqrt()
        scale = lr / (update_rms / group["clip_threshold"]).clamp_(min=1.0)
        for lo, hi in chunks:
            update = grad[lo:hi].to(dtype) * row_factor[lo:hi] * col_factor
            step_scale: Tensor | float | None = scale
            if beta1 is not None:
                exp_avg = state["exp_avg"][lo:hi]
                exp_avg.mul_(beta1).add_(update.mul_(scale), alpha=1.0 - beta1)
                update, step_scale = exp_avg, None
            part = local[lo:hi]
            work = work_copy(part)
            self._step_into(part, work, update, step_scale, group, lr)
            del update, work


def _mean(x: Tensor, dim: int, like: Tensor, like_dim: int) -> Tensor:
    """``x.mean(dim)``, where ``x``'s ``dim`` runs along dimension ``like_dim`` of ``like``.

    ``x`` is computed from the local shard of ``like``; if ``like`` is split along
    ``like_dim`` the local sums are reduced across shards and divided by the full length.
    """
    if not is_sharded(like, [like_dim]):
        return x.mean(dim=dim)
    return all_reduce_sum_(x.sum(dim=dim), like, [like_dim]).div_(like.shape[like_dim])


def _factored_rsqrt(row: Tensor, col: Tensor, like: Tensor) -> Tensor:
    """``1/sqrt(V)`` for the rank-1 estimate ``V = row col^T / mean(row)`` (paper, Alg. 4).

    Normalising the row factor by its mean (rather than dividing the product by the total sum)
    keeps both factors O(1), which avoids overflow/underflow for large matrices.  ``row`` and
    ``col`` are the local statistics of the (possibly sharded) parameter ``like``; the mean of
    ``row`` runs along ``like``'s second-to-last dimension.
    """
    row_factor = (row / _mean(row, -1, like, -2).unsqueeze(-1)).rsqrt_().unsqueeze(-1)
    col_factor = col.unsqueeze(-2).rsqrt()
    return row_factor * col_factor
