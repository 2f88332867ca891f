"""Where a trainer's batches come from, resumably: a dataset, an iterable, or a workload.

:func:`make_stream` turns what a :class:`~memfit.train.Trainer` is given into an object with
``next_batch() -> (indices, batch)``, ``state_dict()`` and ``load_state_dict()`` (the data
position a checkpoint keeps):

* a map-style dataset of samples: a seeded :class:`~memfit.train.data.BatchStream`;
* an iterable of ready batches (a ``DataLoader``): :class:`IterableStream`, re-iterated at its
  end and resumed by skipping;
* nothing, with a :class:`~memfit.workload.Workload`: :class:`WorkloadStream`, fresh batches
  from its batch maker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..workload import Batch, Workload, WorkloadError, batch_size_of

__all__ = [
    "IterableStream",
    "WorkloadStream",
    "count_tokens",
    "is_map_style",
    "map_style_batches",
    "to_device",
]


class WorkloadStream:
    """Fresh batches from a workload's batch maker (random tokens for the presets)."""

    def __init__(self, workload: Workload, model: nn.Module, batch_size: int) -> None:
        self.workload, self.model, self.batch_size = workload, model, batch_size

    def next_batch(self) -> tuple[list[int], Batch]:
        """The next batch (no dataset indices)."""
        return [], self.workload.make_batch(self.model, self.batch_size, self.workload.seq_len)

    def state_dict(self) -> dict[str, Any]:
        """Nothing: batches depend only on the RNG state, which checkpoints restore."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore."""


class IterableStream:
    """Batches of an iterable (a DataLoader), re-iterated at its end; resumable by skipping."""

    def __init__(self, batches: Iterable[Batch]) -> None:
        self.batches = batches
        self.position = 0
        self._it: Iterator[Batch] | None = None

    def next_batch(self) -> tuple[list[int], Batch]:
        """The next batch (no dataset indices).

        Raises:
            WorkloadError: when the iterable gives no batch at all.
        """
        if self._it is None:
            self._it = iter(self.batches)
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.batches)
            try:
                batch = next(self._it)
            except StopIteration:
                raise WorkloadError("the training data gave no batch at all; give some data") from None
        self.position += 1
        return [], batch

    def state_dict(self) -> dict[str, Any]:
        """The number of batches taken."""
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Skip to the saved position."""
        self._it = None
        target, self.position = int(state.get("position", 0)), 0
        for _ in range(target):
            self.next_batch()


def is_map_style(data: Any) -> bool:
    """Whether ``data`` is a dataset of samples (indexable, sized) rather than of batches."""
    if isinstance(data, torch.utils.data.DataLoader):
        return False
    return hasattr(data, "__getitem__") and hasattr(data, "__len__")


def map_style_batches(
    data: Any, batch_size: int, collate_fn: Callable[[list[Any]], Batch]
) -> Iterator[Batch]:
    """``data``'s samples in order, collated ``batch_size`` at a time (the last may be short)."""
    for lo in range(0, len(data), batch_size):
        yield collate_fn([data[i] for i in range(lo, min(lo + batch_size, len(data)))])


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every tensor on ``device`` (torch's pytree walks the containers; a
    mapping it does not know, such as transformers' ``BatchEncoding``, becomes a dict)."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    return tree_map_only(
        torch.Tensor, lambda t: t if t.device == device else t.to(device), batch
    )


def count_tokens(batch: Batch) -> int:
    """Input tokens in a batch: real tokens by its attention mask, else its input ids, else
    its samples."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return int(ids.numel())
    return batch_size_of(batch)
