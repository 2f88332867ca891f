"""Stochastic rounding of fp32 values to bfloat16."""

from __future__ import annotations

import torch

__all__ = ["stochastic_round_to_bf16"]

_LOW16 = (1 << 16) - 1
_HIGH16_MASK = -(1 << 16)  # 0xFFFF0000 as a signed int32


def stochastic_round_to_bf16(
    x: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 stochastically: unbiased, ``E[round(x)] == x``.

    bf16 is fp32 without the low 16 bits of the mantissa. Adding a uniform random integer in
    ``[0, 2**16)`` to those bits and truncating rounds up with probability equal to the
    dropped fraction of an ulp, the same for negative numbers (the sign is a separate bit).
    NaN stays NaN; infinities stay infinite.

    Args:
        x: A float32 tensor (other float dtypes are converted to float32 first).
        generator: The random generator (default: the global one of ``x``'s device).

    Returns:
        A bfloat16 tensor of ``x``'s shape.
    """
    if x.dtype != torch.float32:
        x = x.float()
    x = x.contiguous()
    bits = x.view(torch.int32)
    noise = torch.randint(
        0, _LOW16 + 1, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    rounded = (bits + noise).bitwise_and_(_HIGH16_MASK)
    # The low 16 bits are now zero, so this conversion is exact (no second rounding).
    out = rounded.view(torch.float32).to(torch.bfloat16)
    # A NaN whose payload is near the top of the int range could wrap around: keep NaNs.
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)
