"""Depth composition: a quantity measured at two shallow depths, extrapolated to the full one.

Every per-block quantity of a training step (parameters, gradients, optimizer state, kept
activations, FLOPs, dispatched operations) grows linearly with the number of identical blocks,
so two shallow measurements fix it at any depth. Depths 2 and 3 are used rather than 1 and 2:
with one block the embeddings often dominate and the peak falls at another point of the step.
Both the memory predictor (:mod:`memfit.estimate.compose`) and the cost model
(:mod:`memfit.estimate.cost`) compose through this one function.

Stacks of unlike blocks (dense then mixture-of-experts layers, Mamba and attention
interleaved, ...) are composed per block type instead (:func:`layer_pattern`,
:func:`profile_depths`, :func:`compose_pattern`): each distinct type's cost is measured as the
step it adds to a shallow prefix of the real stack, and the full depth is the deepest prefix
plus the measured step of every block beyond it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = [
    "MAX_PATTERN_DEPTH",
    "SHALLOW_DEPTHS",
    "compose_pattern",
    "extrapolate",
    "layer_pattern",
    "profile_depths",
]

#: The depths profiled for composition.
SHALLOW_DEPTHS: tuple[int, int] = (2, 3)


def extrapolate(at_two: float, at_three: float, depth: int) -> float:
    """``m(depth) = m(2) + (depth - 2) * (m(3) - m(2))``."""
    return at_two + (depth - 2) * (at_three - at_two)


#: Most shallow depths profiled for a stack of unlike blocks; a pattern that needs more is
#: dry-run at full size instead.
MAX_PATTERN_DEPTH = 8


def layer_pattern(model: nn.Module, depth: int) -> list[int] | None:
    """The type of each of ``model``'s ``depth`` blocks, as small integers in order of first use.

    Blocks are the children of the module list holding ``depth`` modules (the layers). Two
    blocks have the same type when their module classes, parameter names, shapes and dtypes
    match. ``None`` when no such list is found.
    """
    stacks = [
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == depth
    ]
    if not stacks:
        return None
    types: dict[tuple[Any, ...], int] = {}
    pattern = []
    for block in stacks[0]:
        signature = tuple(
            (name, type(m).__name__) for name, m in block.named_modules()
        ) + tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
        pattern.append(types.setdefault(signature, len(types)))
    return pattern


def profile_depths(pattern: Sequence[int]) -> list[int] | None:
    """The shallow depths to profile so that every block type past them has a measured cost.

    A block's cost is the step from depth ``i - 1`` to ``i``, measured at ``i >= 3`` (the
    first blocks share the peak with the embeddings). The depths are ``2 .. m`` for the least
    ``m >= 3`` such that every type among blocks ``m + 1 ..`` is block ``i`` for some
    ``3 <= i <= m``. ``None`` when that needs more than :data:`MAX_PATTERN_DEPTH`.
    """
    n = len(pattern)
    for m in range(3, min(n, MAX_PATTERN_DEPTH) + 1):
        measured = set(pattern[2:m])
        if set(pattern[m:]) <= measured:
            return list(range(2, m + 1))
    return None


def compose_pattern(at: Mapping[int, float], pattern: Sequence[int]) -> float:
    """A quantity at the full depth from its values ``at`` shallow depths ``2 .. m``:
    ``m(m) + sum over blocks i > m of the measured step of block i's type``."""
    depths = sorted(at)
    last = depths[-1]
    step: dict[int, float] = {}
    for i in depths[1:]:
        step[pattern[i - 1]] = at[i] - at[i - 1]  # the latest measurement of each type
    return at[last] + sum(step[t] for t in pattern[last:])
