"""Mixed and reduced precision: autocast, loss scaling, bf16 weights with stochastic rounding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PrecisionConfig"]

PrecisionMode = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision of weights, activations and optimizer math.

    Attributes:
        mode: ``fp32`` everything in float32. ``bf16-mixed`` / ``fp16-mixed``: fp32 weights,
            matmuls under autocast; activations saved for backward are half-size (roughly
            halves activation memory, no saving on weights, gradients or state).
            ``bf16-pure``: weights, gradients and optimizer math in bf16: halves parameters,
            gradients and (for Adam-like state) state, with stochastic rounding so small
            updates are not lost.
        stochastic_rounding: For ``bf16-pure``: round updated weights stochastically (unbiased)
            instead of to nearest; costs one random draw per element per step.
        init_scale: For ``fp16-mixed``: the initial dynamic loss scale.
        growth_interval: For ``fp16-mixed``: steps without overflow before the scale doubles.
        backoff_factor: For ``fp16-mixed``: scale multiplier after an overflow (step skipped).
        growth_factor: For ``fp16-mixed``: scale multiplier after ``growth_interval`` good steps.
    """

    mode: PrecisionMode = "fp32"
    stochastic_rounding: bool = True
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    backoff_factor: float = 0.5
    growth_factor: float = 2.0
