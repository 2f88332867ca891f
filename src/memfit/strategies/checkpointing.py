"""Activation checkpointing: recompute activations in backward instead of keeping them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CheckpointConfig"]

CheckpointMode = Literal["none", "full", "selective", "sqrt", "budget"]


@dataclass(frozen=True)
class CheckpointConfig:
    """Which blocks keep their activations and which recompute them in backward.

    Attributes:
        mode: ``none`` keeps every activation (most memory, no recompute). ``full`` wraps every
            repeated block: only each block's input is kept, and the whole block's forward is
            recomputed in backward (about one extra forward: ~+33% compute). ``selective``
            wraps every block but keeps matmul outputs and recomputes only cheap pointwise ops
            (most of the saving of ``full`` at a few percent of compute). ``sqrt`` checkpoints
            segments of ~sqrt(n) blocks (Chen et al. 2016): O(sqrt(n)) activation memory for
            one extra forward. ``budget`` checkpoints just as many blocks as needed to keep
            activations under ``budget_bytes``.
        blocks: Qualified-name pattern(s) of the repeated blocks (``fnmatch`` style, e.g.
            ``"bert.encoder.layer.*"``); ``None`` finds the largest list of identical blocks.
        budget_bytes: For ``budget``: the activation bytes the model may keep.
    """

    mode: CheckpointMode = "none"
    blocks: tuple[str, ...] | None = None
    budget_bytes: int | None = None
