"""Depth composition: a quantity measured at two shallow depths, extrapolated to the full one.

Every per-block quantity of a training step (parameters, gradients, optimizer state, kept
activations, FLOPs, dispatched operations) grows linearly with the number of identical blocks,
so two shallow measurements fix it at any depth. Depths 2 and 3 are used rather than 1 and 2:
with one block the embeddings often dominate and the peak falls at another point of the step.
Both the memory predictor (:mod:`memfit.estimate.compose`) and the cost model
(:mod:`memfit.estimate.cost`) compose through this one function.
"""

from __future__ import annotations

__all__ = ["SHALLOW_DEPTHS", "extrapolate"]

#: The depths profiled for composition.
SHALLOW_DEPTHS: tuple[int, int] = (2, 3)


def extrapolate(at_two: float, at_three: float, depth: int) -> float:
    """``m(depth) = m(2) + (depth - 2) * (m(3) - m(2))``."""
    return at_two + (depth - 2) * (at_three - at_two)
