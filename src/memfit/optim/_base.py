"""Shared plumbing for the memfit optimizers (private)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class MemfitOptimizer(Optimizer):
    """Base class: exact state restoration and common gradient checks.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating-point state tensor to the dtype
    of its parameter.  That is right for torch's own optimizers, but here state deliberately has
    its own dtypes (uint8 codes, fp32 block maxima, fp32 moments for bf16/fp16 parameters), and
    the cast would silently lose precision.  :meth:`load_state_dict` therefore restores state
    tensors with their saved dtype, only moving them to the parameter's device.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state, keeping each state tensor's saved dtype.

        Tensors are copied (not aliased), so later in-place updates never write into
        ``state_dict`` or into the optimizer it came from.

        Args:
            state_dict: A dict returned by :meth:`state_dict`.
        """
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        saved_state = state_dict["state"]
        for saved_id, param in zip(saved_ids, params, strict=True):
            if saved_id not in saved_state:
                continue
            self.state[param] = {
                key: _copy_to(value, param.device) for key, value in saved_state[saved_id].items()
            }

    def _run_closure(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def _copy_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: _copy_to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_to(v, device) for v in value)
    return value


def dense_grad(param: Tensor, optimizer_name: str) -> Tensor:
    """Return ``param.grad``, refusing sparse gradients with a clear message."""
    grad = param.grad
    if grad is None:  # pragma: no cover - callers skip these
        raise RuntimeError("parameter has no gradient")
    if grad.is_sparse:
        raise RuntimeError(
            f"{optimizer_name} does not support sparse gradients; use a dense embedding "
            "(sparse=False) or torch.optim.SparseAdam for sparse parameters"
        )
    return grad


def compute_dtype(param: Tensor) -> torch.dtype:
    """Dtype for update math and 32-bit state: fp32 for bf16/fp16 parameters, else their own."""
    return torch.float32 if param.dtype in _LOW_PRECISION else param.dtype


def work_copy(param: Tensor) -> Tensor:
    """The tensor the update math writes to: ``param`` itself, or an fp32 copy for bf16/fp16.

    Low-precision parameters are updated in fp32 and rounded once at the end (via
    :func:`write_back`), so the several small terms of an update are not each rounded to bf16.
    """
    if param.dtype in _LOW_PRECISION:
        return param.detach().float()
    return param


def write_back(param: Tensor, work: Tensor) -> None:
    """Copy a working copy back into ``param`` unless ``work`` already is ``param``."""
    if work is not param:
        param.copy_(work)
