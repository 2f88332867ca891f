"""Offload to host or disk memory (placeholder config; the technique is future work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["OffloadConfig"]


@dataclass(frozen=True)
class OffloadConfig:
    """What moves off the device, and where to.

    Attributes:
        optimizer_state: Keep optimizer state in host memory and step there: removes the state
            from device memory at the cost of moving gradients down and weights up each step.
        activations: Move saved activations to host memory during forward, back in backward.
        tier: ``host`` (pinned CPU memory) or ``disk``.
    """

    optimizer_state: bool = True
    activations: bool = False
    tier: Literal["host", "disk"] = "host"
