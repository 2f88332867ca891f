"""Sequence length: truncation, dynamic padding and length-grouped batching."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SequenceConfig"]


@dataclass(frozen=True)
class SequenceConfig:
    """How sequences are shaped into batches (``max_seq_len`` itself lives on the Plan).

    Attributes:
        dynamic_padding: Pad each batch to its longest sequence instead of ``max_seq_len``:
            activation memory and compute follow the real lengths (no cost).
        group_by_length: Batch sequences of similar length together (a length-grouped
            sampler), so dynamic padding wastes little; batches are shuffled in groups.
        pad_to_multiple_of: Round padded lengths up to a multiple of this (kernel friendliness).
    """

    dynamic_padding: bool = True
    group_by_length: bool = False
    pad_to_multiple_of: int = 1
