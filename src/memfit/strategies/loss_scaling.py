"""Dynamic loss scaling for fp16 training, and the gradient helpers every precision shares.

:class:`DynamicLossScaler` is what ``fp16-mixed`` steps through (see its docstring for why it
is not ``torch.amp.GradScaler``); :func:`clip_gradients` and :func:`optimizer_params` are the
clipping and parameter walk of every precision runtime's step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..device import is_fake
from ..techniques import Technique

__all__ = ["DynamicLossScaler", "clip_gradients", "optimizer_params"]


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training, usable on its own.

    Multiply the loss by :attr:`scale` before backward so small gradients do not flush to
    zero in fp16; before the step, divide the gradients by it and check them: any inf/NaN means
    the scale was too high, so the step is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` consecutive good steps the scale is
    multiplied by ``growth_factor``.

    Why not ``torch.amp.GradScaler``: in torch 2.13, ``GradScaler("cpu")`` trains real CPU
    runs, and its ``scale``, ``unscale_`` and ``update`` run on fake tensors, but its ``step``
    decides whether to step by reading the overflow flags' values (``found_inf.item()`` in
    ``_maybe_opt_step``), which under ``FakeTensorMode`` raises
    ``DataDependentOutputException`` (``aten._local_scalar_dense``): no plan with fp16 could
    be dry-run. Here a dry run steps as if the gradients were finite (the memory path that
    matters). Both facts are tested (``tests/strategies/test_precision.py``), so the test
    says when GradScaler can take over. This scaler uses GradScaler's fused kernel
    (``_amp_foreach_non_finite_check_and_unscale_``) and its growth and backoff rules, and
    gives the same scales and parameters on the CPU (tested); it adds clipping between
    unscaling and the step (GradScaler leaves that to the caller) and a floor on the scale.
    What it lacks: the scale is a Python float (GradScaler keeps it on the device; both read
    the overflow flag on the host once per step); one optimizer per :meth:`step` (GradScaler
    tracks several per iteration); no use of fused optimizers that unscale inside their own
    step (``_step_supports_amp_scaling``); fp16 gradients (fp16 weights) are not refused.

    Example::

        scaler = DynamicLossScaler()
        scaler.scale_loss(loss).backward()
        stepped = scaler.step(optimizer, max_grad_norm=1.0)

    Args:
        init_scale: The first scale.
        growth_factor: Scale multiplier after ``growth_interval`` good steps (> 1).
        backoff_factor: Scale multiplier after an overflow (in (0, 1)).
        growth_interval: Consecutive good steps before growing.
        min_scale: The scale never goes below this.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-24,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(
                f"growth_interval must be a whole number >= 1, got {growth_interval!r}"
            )
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call ``.backward()`` on the result)."""
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients of ``params`` by the scale in place.

        Returns:
            Whether any gradient holds an inf or NaN.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        inv = 1.0 / self.scale
        found = False
        for group in _by_device_dtype(grads):
            flag = torch.zeros((), dtype=torch.float32, device=group[0].device)
            try:
                # The fused op GradScaler uses: one kernel unscales and checks every tensor.
                torch._amp_foreach_non_finite_check_and_unscale_(
                    group, flag, torch.full((), inv, dtype=torch.float32, device=flag.device)
                )
            except (RuntimeError, NotImplementedError):
                for g in group:
                    g.mul_(inv)
                    flag += (~torch.isfinite(g)).any()
            if is_fake(flag):
                # A dry run has no values: it steps as if the gradients were finite, which is
                # the memory path that matters (a skipped step allocates less).
                continue
            found = found or bool(flag.item())
        return found

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` good steps in a row."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def step(self, optimizer: Any, max_grad_norm: float | None = None) -> bool:
        """Unscale, check, clip and step ``optimizer``, then update the scale.

        Returns:
            Whether the optimizer stepped (``False``: gradients overflowed, step skipped).
        """
        params = optimizer_params(optimizer)
        found_inf = self.unscale_(params)
        if not found_inf:
            clip_gradients(params, max_grad_norm)
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """The parameters ``optimizer`` steps (through a per-parameter handle's ``optimizers``)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        # An optimizer-in-backward handle or similar: its optimizers' parameters.
        return [p for opt in getattr(optimizer, "optimizers", ()) for p in optimizer_params(opt)]
    return [p for g in groups for p in g["params"]]


def clip_gradients(params: list[torch.Tensor], max_grad_norm: float | None) -> None:
    """Clip the gradients of ``params`` to the global L2 norm ``max_grad_norm`` (``None``: no
    clipping), as ``torch.nn.utils.clip_grad_norm_``."""
    if max_grad_norm is None:
        return
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm)


def _clip_refusal(plan: Any, engine: str) -> str | None:
    exact_fused = plan.optimizer_in_backward and plan.grad_clip_mode == "exact"
    if engine == "hf" and exact_fused:
        return (
            "exact clipping with optimizer_in_backward needs a second, norm-only backward "
            "that the Hugging Face Trainer does not run; use grad_clip_mode 'approx'"
        )
    return None


def _check_clipping(plan: Any) -> None:
    """The clipping norm and mode (``Technique.check``)."""
    norm = plan.max_grad_norm
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                             or not norm > 0):
        raise ValueError(f"max_grad_norm must be > 0 or null, got {plan.max_grad_norm!r}")
    if plan.grad_clip_mode not in ("exact", "approx"):
        raise ValueError(
            f"grad_clip_mode {plan.grad_clip_mode!r} is not known; use 'exact' (an extra "
            "norm-only backward) or 'approx' (the previous step's norm)"
        )


#: Gradient clipping to a global norm, by the stepper (or the fused step's hooks). Swappable
#: unless the step is fused, where the optimizer-in-backward handle itself clips.
CLIPPING = Technique(
    name="clipping",
    plan_field=("max_grad_norm", "grad_clip_mode"),
    order=230,
    is_on=lambda plan: plan.max_grad_norm is not None,
    engines=frozenset({"single", "data", "hf", "lightning"}),
    refusal=_clip_refusal,
    label=lambda plan: "max_grad_norm",
    swappable=lambda old, new: not new.optimizer_in_backward,
    summary=lambda config: f"clip {config[0]} ({config[1]})",
    check=_check_clipping,
)
