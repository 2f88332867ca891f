"""The data's length distribution, and the batch the memory plan must hold: the longest.

A plan made for the mean length runs out of memory on the first batch that holds the longest
sample (activations grow with the batch's padded length, attention scores with its square).
So ``memfit plan``, ``memfit profile`` and ``memfit train`` plan for the **worst batch**: the
batch size times the longest sample after truncation, which any batch holding that sample
pads to. :func:`length_report` measures it, with the percentiles that show how far it is from
the typical batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .data import lengths_of

__all__ = ["LengthReport", "length_report"]


@dataclass(frozen=True, slots=True)
class LengthReport:
    """Sample lengths (tokens) and the worst batch they make.

    Attributes:
        samples: Samples measured.
        p50: Median length (nearest rank).
        p90: 90th percentile.
        p99: 99th percentile.
        max: The longest sample: the worst batch's length.
        mean: Mean length.
        batch_size: Samples per batch (one process's share).
        seq_len: The length samples were cut to.
        truncated: Samples (records) cut to ``seq_len``.
        dropped: Records dropped because the cut left none of their answer.
        longest: Index of the longest sample.
        longest_where: Where the longest sample came from (file and line), when known.
    """

    samples: int
    p50: int
    p90: int
    p99: int
    max: int
    mean: float
    batch_size: int
    seq_len: int
    truncated: int = 0
    dropped: int = 0
    longest: int = 0
    longest_where: str | None = None

    @property
    def worst_batch(self) -> tuple[int, int]:
        """``(batch size, length)`` of the largest batch the data can make."""
        return (min(self.batch_size, self.samples), self.max)

    def summary(self) -> str:
        """Two sentences: the percentiles (and what was truncated), then the worst batch."""
        cut = ""
        if self.truncated:
            cut = f"; {self.truncated:,} truncated to {self.seq_len} tokens"
        if self.dropped:
            cut += f"; {self.dropped:,} dropped (the cut left none of their answer)"
        rows, length = self.worst_batch
        source = f" (the longest sample: {self.longest_where})" if self.longest_where else ""
        return (
            f"sample lengths over {self.samples:,} samples: p50 {self.p50}, p90 {self.p90}, "
            f"p99 {self.p99}, max {self.max} tokens (mean {self.mean:.1f}){cut}. "
            f"Worst batch: {rows} x {length} tokens, any batch holding sample {self.longest}"
            f"{source}; memory is planned for it."
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON)."""
        data = asdict(self)
        data["worst_batch"] = list(self.worst_batch)
        return data


def length_report(dataset: Any, batch_size: int, *, seq_len: int | None = None) -> LengthReport:
    """The length distribution of ``dataset``'s samples and its worst batch.

    Args:
        dataset: A dataset with ``lengths`` (:class:`~memfit.train.data.TextDataset`,
            :class:`~memfit.train.chat.SupervisedDataset`) or samples with ``input_ids``.
        batch_size: Samples per batch (one process's share).
        seq_len: The length samples were cut to (default: the dataset's ``seq_len``).

    Raises:
        ValueError: for an empty dataset or a batch size below 1.
    """
    lengths = lengths_of(dataset)
    if not lengths:
        raise ValueError("the data has no samples to measure")
    if batch_size < 1:
        raise ValueError(f"batch size must be a whole number >= 1, got {batch_size!r}")
    ordered = sorted(lengths)
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    wheres = getattr(dataset, "wheres", None)
    return LengthReport(
        samples=len(lengths),
        p50=_rank(ordered, 50),
        p90=_rank(ordered, 90),
        p99=_rank(ordered, 99),
        max=ordered[-1],
        mean=sum(lengths) / len(lengths),
        batch_size=batch_size,
        seq_len=int(seq_len if seq_len is not None else getattr(dataset, "seq_len", ordered[-1])),
        truncated=int(getattr(dataset, "truncated", 0)),
        dropped=int(getattr(dataset, "dropped", 0)),
        longest=longest,
        longest_where=wheres[longest] if wheres else None,
    )


def _rank(ordered: Sequence[int], q: float) -> int:
    """The nearest-rank percentile: the smallest length at least ``q``% of samples reach."""
    return int(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])
