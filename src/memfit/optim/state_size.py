"""How many bytes each optimizer's state takes: exact per optimizer, and the estimators' rules.

Two figures per optimizer, both read through :mod:`memfit.optim.registry`:

* the **exact** bytes ``optimizer.state`` holds after a step over given parameters, counted as
  :func:`memfit.optim.state_bytes` counts them (each storage once, Python numbers not at all),
  from the shapes and dtypes alone (meta tensors do); ``tests/optim/test_registry.py`` steps
  every registered optimizer and compares;
* the **per-parameter rule** the cost models use (:mod:`memfit.estimate.cost` for the disk
  tier, :mod:`memfit.estimate.layout_cost` for the ranks' state): the state's size in the limit
  of large tensors, without per-tensor scalars, quantisation block maxima or factored
  statistics.

Settings are the keyword arguments the optimizer is built with (its defaults where absent).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ExactBytes",
    "PerParameter",
    "StateSize",
    "adafactor",
    "adam",
    "adamw8bit",
    "bnb_adamw8bit",
    "lamb",
    "lars",
    "onebit_adam",
    "per_tensor",
    "sgd",
    "torchao_adamw8bit",
]

#: Exact state bytes of an optimizer over these parameters built with these settings.
ExactBytes = Callable[[Sequence[Tensor], Mapping[str, Any]], int]
#: State bytes per parameter of this dtype with these settings (an estimator's rule).
PerParameter = Callable[[Mapping[str, Any], torch.dtype], float]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: torch's optimizers keep their step count as a 0-d tensor of the default scalar dtype.
_STEP_BYTES = 4


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _compute_itemsize(dtype: torch.dtype) -> int:
    # memfit's optimizers keep 32-bit state in fp32 for bf16/fp16 parameters (_base.compute_dtype).
    return 4 if dtype in _LOW_PRECISION else _itemsize(dtype)


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


@dataclass(frozen=True)
class StateSize:
    """How much state one optimizer keeps."""

    exact: ExactBytes
    """``exact(params, settings)``: the bytes ``optimizer.state`` holds after a step over
    ``params`` (their shapes and dtypes are read: meta tensors do) when built with the keyword
    arguments ``settings``, as :func:`memfit.optim.state_bytes` measures them."""

    per_parameter: PerParameter
    """``per_parameter(settings, dtype)``: the estimators' bytes per parameter of ``dtype``,
    the state's size for large tensors (per-tensor scalars, block maxima and factored
    statistics left out)."""


def per_tensor(fn: Callable[[Tensor, Mapping[str, Any]], int]) -> ExactBytes:
    """An exact counter summing ``fn(param, settings)`` over the parameters (for optimizers
    whose state is all per tensor, nothing shared)."""

    def exact(params: Sequence[Tensor], settings: Mapping[str, Any]) -> int:
        return sum(fn(p, settings) for p in params)

    return exact


# --------------------------------------------------------------------------- torch's own
def _adam_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    # exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad) in the parameter's dtype.
    moments = 3 if settings.get("amsgrad") else 2
    return _STEP_BYTES + moments * p.numel() * p.element_size()


def _adam_rule(settings: Mapping[str, Any], dtype: torch.dtype) -> float:
    return (3 if settings.get("amsgrad") else 2) * _itemsize(dtype)


def _sgd_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    # One momentum buffer in the parameter's dtype, only with momentum (torch's default: none).
    return p.numel() * p.element_size() if settings.get("momentum", 0) else 0


def _sgd_rule(settings: Mapping[str, Any], dtype: torch.dtype) -> float:
    return float(_itemsize(dtype)) if settings.get("momentum", 0) else 0.0


adam = StateSize(per_tensor(_adam_tensor), _adam_rule)
"""torch's Adam and AdamW: two moments of the parameter's dtype and a 0-d step tensor."""

sgd = StateSize(per_tensor(_sgd_tensor), _sgd_rule)
"""torch's SGD: a momentum buffer with ``momentum > 0``, nothing without (its default)."""


# --------------------------------------------------------------------------- memfit's
def _adamw8bit_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    block = int(settings.get("block_size", 256))
    if p.numel() >= int(settings.get("min_8bit_size", 4096)) and p.is_floating_point():
        # Two moments of uint8 codes padded to whole blocks, an fp32 maximum per block each.
        # (Parameters named in keep_32bit stay fp32: names are not visible here.)
        blocks = _blocks(p.numel(), block)
        return 2 * (blocks * block + 4 * blocks)
    return 2 * p.numel() * _compute_itemsize(p.dtype)


def _two_bytes(settings: Mapping[str, Any], dtype: torch.dtype) -> float:
    # Two 1-byte codes per element; block maxima and small fp32 tensors left out.
    return 2.0


def _adafactor_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    c = _compute_itemsize(p.dtype)
    total = 4  # the parameter RMS of the latest step, a 0-d fp32 tensor
    if settings.get("beta1") is not None:
        total += p.numel() * c
    if p.dim() >= 2:
        # Factored second moment: a row and a column statistic per matrix.
        shape = tuple(p.shape)
        total += (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * c
    else:
        total += p.numel() * c
    return total


def _adafactor_rule(settings: Mapping[str, Any], dtype: torch.dtype) -> float:
    # The factored statistics are O(n + m) per n x m matrix: about nothing per parameter (the
    # cost model's figure); the first moment, when asked for, is a full copy.
    return 0.0 if settings.get("beta1") is None else float(_compute_itemsize(dtype))


def _lamb_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    c = _compute_itemsize(p.dtype)
    return 2 * p.numel() * c + c  # two moments and the last trust ratio (0-d)


def _moments_rule(settings: Mapping[str, Any], dtype: torch.dtype) -> float:
    return 2.0 * _compute_itemsize(dtype)


def _lars_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    # One momentum buffer with momentum (LARS's default 0.9), none without.
    return p.numel() * _compute_itemsize(p.dtype) if settings.get("momentum", 0.9) else 0


def _lars_rule(settings: Mapping[str, Any], dtype: torch.dtype) -> float:
    return float(_compute_itemsize(dtype)) if settings.get("momentum", 0.9) else 0.0


def _onebit_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    return 2 * p.numel() * _compute_itemsize(p.dtype)


adamw8bit = StateSize(per_tensor(_adamw8bit_tensor), _two_bytes)
"""memfit's AdamW8bit: block-wise 8-bit moments from ``min_8bit_size`` elements, fp32 below."""

adafactor = StateSize(per_tensor(_adafactor_tensor), _adafactor_rule)
"""memfit's Adafactor: factored second moment for matrices, full for vectors, RMS, optional
first moment."""

lamb = StateSize(per_tensor(_lamb_tensor), _moments_rule)
"""memfit's Lamb: two moments and a 0-d trust ratio."""

lars = StateSize(per_tensor(_lars_tensor), _lars_rule)
"""memfit's Lars: one momentum buffer (momentum 0.9 by default)."""

onebit_adam = StateSize(per_tensor(_onebit_tensor), _moments_rule)
"""memfit's OneBitAdam: two moments (its DDP hook's error buffers are the hook's, not state)."""


# --------------------------------------------------------------------------- peers'
def _bnb_exact(params: Sequence[Tensor], settings: Mapping[str, Any]) -> int:
    min_8bit = int(settings.get("min_8bit_size", 4096))
    unorm = 4 if settings.get("max_unorm", 0.0) > 0 else 0
    total, quantised = 0, False
    for p in params:
        n = p.numel()
        if n >= min_8bit:
            # uint8 codes (not padded) and an fp32 maximum per 256-element block, each moment.
            total += 2 * (n + 4 * _blocks(n, 256)) + unorm
            quantised = True
        else:
            total += 2 * 4 * n + unorm  # fp32 state, whatever the parameter's dtype
    # The two 256-entry fp32 code maps are one pair per optimizer, shared by every tensor.
    return total + (2 * 256 * 4 if quantised else 0)


def _torchao_tensor(p: Tensor, settings: Mapping[str, Any]) -> int:
    block = int(settings.get("block_size", 256))
    n = p.numel()
    moments = 3 if settings.get("amsgrad") else 2
    quantised = n >= 4096 and n % block == 0
    # Each moment: uint8 codes, an fp32 scale per block and its own 256-entry fp32 code map;
    # or, not quantised, zeros_like the parameter.
    each = n + 4 * (n // block) + 256 * 4 if quantised else n * p.element_size()
    return _STEP_BYTES + moments * each


bnb_adamw8bit = StateSize(_bnb_exact, _two_bytes)
"""bitsandbytes' AdamW8bit and PagedAdamW8bit."""

torchao_adamw8bit = StateSize(per_tensor(_torchao_tensor), _two_bytes)
"""torchao's AdamW8bit: 8-bit only for tensors of 4096 elements or more in whole blocks."""
