"""Sequence length: truncation, dynamic padding and length-grouped batching.

Activation memory is linear in the padded sequence length (quadratic for eager attention), so
tokens that are padding cost as much as real ones. Three tools keep the padded length close to
the real one:

* :func:`truncate` cuts a batch to ``max_seq_len`` tokens;
* :func:`pad_collate` pads each batch only to its own longest sequence (dynamic padding);
* :class:`LengthGroupedSampler` batches sequences of similar length together, so dynamic
  padding has little left to pad.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from ..techniques import Technique

__all__ = ["LengthGroupedSampler", "SequenceConfig", "pad_collate", "truncate"]


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


#: Keys that carry the sequence dimension, in the order used to find the batch's length.
_SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids", "labels")


# ---------------------------------------------------------------------------------- truncate
def truncate(batch: Any, max_seq_len: int) -> Any:
    """Cut a batch to at most ``max_seq_len`` tokens (dimension 1 is the sequence).

    For a dict, the sequence length is dimension 1 of ``input_ids`` (else ``inputs_embeds``,
    ``attention_mask``, ``token_type_ids``, ``labels``, else the first tensor of two or more
    dimensions); every tensor of two or more dimensions whose dimension 1 has that length is
    cut (ids, masks, token types, per-token labels, embeddings). Per-sample labels (1-D) and
    anything else are left alone. A tuple or list is treated the same way; a lone tensor of
    two or more dimensions is cut along dimension 1.

    Args:
        batch: A dict of tensors (or a tuple, list or tensor).
        max_seq_len: The most tokens to keep (>= 1).

    Returns:
        The batch, cut (contiguous copies of the kept tokens, so later ``view`` calls work),
        or the very same object when nothing is longer than ``max_seq_len``.

    Raises:
        ValueError: when ``max_seq_len`` is not a whole number >= 1.
    """
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a whole number >= 1, got {max_seq_len!r}")
    if isinstance(batch, torch.Tensor):
        if batch.dim() >= 2 and batch.shape[1] > max_seq_len:
            return batch[:, :max_seq_len].contiguous()
        return batch
    if isinstance(batch, Mapping):
        values = list(batch.values())
        ordered = [batch[k] for k in _SEQUENCE_KEYS if k in batch] + values
    elif isinstance(batch, (tuple, list)):
        values = ordered = list(batch)
    else:
        return batch
    seq_len = next(
        (int(v.shape[1]) for v in ordered if isinstance(v, torch.Tensor) and v.dim() >= 2), None
    )
    if seq_len is None or seq_len <= max_seq_len:
        return batch

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq_len:
            return v[:, :max_seq_len].contiguous()
        return v

    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    return type(batch)(cut(v) for v in values)


# ---------------------------------------------------------------------------------- padding
def pad_collate(
    samples: Sequence[Mapping[str, Any]],
    *,
    pad_id: int = 0,
    label_pad: int = -100,
    max_seq_len: int | None = None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Collate samples into a batch padded to its own longest sequence (right padding).

    Each sample is a dict; a value that is a list or a tensor of one or more dimensions is a
    sequence (dimension 0 is the token), anything else (an int label, a 0-d tensor) is a
    per-sample value and is stacked. Sequences are cut to ``max_seq_len`` and padded to the
    longest in the batch, rounded up to ``pad_to_multiple_of`` (never beyond ``max_seq_len``).
    Padding values: ``input_ids`` ``pad_id``, ``labels`` ``label_pad`` (ignored by the
    loss), everything else 0. An ``attention_mask`` (1 for real tokens, 0 for padding) is
    built unless the samples bring their own, which is padded with 0.

    Args:
        samples: The samples (all with the same keys).
        pad_id: Padding token id for ``input_ids``.
        label_pad: Padding for per-token ``labels`` (``-100`` is ignored by PyTorch losses).
        max_seq_len: Cut sequences to this many tokens first (``None``: no cut).
        pad_to_multiple_of: Round the padded length up to a multiple of this.

    Returns:
        A dict of batched tensors: sequences ``(batch, length, ...)``, per-sample values
        ``(batch, ...)``.

    Raises:
        ValueError: on no samples, samples with different keys, or bad sizes.
    """
    if not samples:
        raise ValueError("pad_collate needs at least one sample")
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a whole number >= 1, got {pad_to_multiple_of!r}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"max_seq_len must be a whole number >= 1 or None, got {max_seq_len!r}")
    keys = list(samples[0])
    for i, s in enumerate(samples):
        if set(s) != set(keys):
            raise ValueError(
                f"sample {i} has keys {sorted(s)} but sample 0 has {sorted(keys)}; every "
                "sample must have the same keys"
            )
    columns = {k: [_as_tensor(s[k]) for s in samples] for k in keys}
    seq_keys = [k for k, col in columns.items() if col[0].dim() >= 1]
    for k in seq_keys:
        if any(t.dim() == 0 for t in columns[k]):
            raise ValueError(f"{k!r} is a sequence in some samples and a single value in others")
        if max_seq_len is not None:
            columns[k] = [t[:max_seq_len] for t in columns[k]]
    if not seq_keys:
        return {k: torch.stack(col) for k, col in columns.items()}

    main = next((k for k in _SEQUENCE_KEYS if k in seq_keys), seq_keys[0])
    lengths = [int(t.shape[0]) for t in columns[main]]
    longest = max(max(int(t.shape[0]) for t in columns[k]) for k in seq_keys)
    length = math.ceil(longest / pad_to_multiple_of) * pad_to_multiple_of
    if max_seq_len is not None:
        length = min(length, max_seq_len)

    out: dict[str, torch.Tensor] = {}
    for k, col in columns.items():
        if k not in seq_keys:
            out[k] = torch.stack(col)
            continue
        value = pad_id if k == "input_ids" else label_pad if k == "labels" else 0
        out[k] = _pad_stack(col, length, value)
    if "attention_mask" not in out:
        positions = torch.arange(length)
        out["attention_mask"] = (positions < torch.tensor(lengths)[:, None]).long()
    return out


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value)


def _pad_stack(tensors: list[torch.Tensor], length: int, value: int | float) -> torch.Tensor:
    first = tensors[0]
    out = torch.full(
        (len(tensors), length, *first.shape[1:]), value, dtype=first.dtype, device=first.device
    )
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


# ---------------------------------------------------------------------------------- sampler
class LengthGroupedSampler(Sampler[int]):
    """Yield sample indices so that each batch holds sequences of similar length.

    Indices are shuffled, cut into mega-batches of ``batch_size * mega_batch_mult`` and each
    mega-batch is sorted by length (longest first), so consecutive ``batch_size`` indices form
    batches of similar length while the epoch stays random. The full batches are then
    shuffled among themselves and the one holding the longest sequence goes first (an
    out-of-memory error shows on the first step, not hours in). The last, partial batch stays
    last, so ``DataLoader(..., batch_size=batch_size, sampler=sampler)`` cuts exactly these
    batches. Every index appears exactly once per epoch. Without ``shuffle`` the order is
    all indices sorted by length, longest first.

    Why not transformers' ``LengthGroupedSampler`` (transformers 5.23,
    ``trainer_pt_utils.get_length_grouped_indices``): the grouping is the same idea
    (mega-batches sorted by length, the longest first), but its batches keep their sorted order
    inside each mega-batch (long batches then short ones, every mega-batch), where this one
    shuffles whole batches; it moves only the longest *sample* to the front (the sample it
    displaces lands in another mega-batch's sorted run); and it reseeds through a
    ``generator`` object, where this one has ``set_epoch`` as torch's ``DistributedSampler``
    does. What this one lacks: reading lengths from a dataset of dicts (``model_input_name``;
    pass ``lengths`` here) and transformers' default mega-batch size for small datasets
    (``min(n // (4 * batch_size), 50)``; here always ``mega_batch_mult``).

    Args:
        lengths: Length of every sample.
        batch_size: Samples per batch (the DataLoader's batch size).
        shuffle: Randomise (per epoch, see :meth:`set_epoch`).
        seed: Base seed of the shuffling.
        mega_batch_mult: Mega-batch size in batches: larger groups more tightly, smaller
            keeps more randomness.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        mega_batch_mult: int = 50,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        if not isinstance(mega_batch_mult, int) or mega_batch_mult < 1:
            raise ValueError(f"mega_batch_mult must be a whole number >= 1, got {mega_batch_mult!r}")
        self.lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.mega_batch_mult = mega_batch_mult
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use another shuffle for ``epoch`` (call before each epoch, like DistributedSampler)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def batches(self) -> list[list[int]]:
        """This epoch's batches (what ``__iter__`` yields, cut into ``batch_size``)."""
        n = len(self.lengths)
        bs = self.batch_size
        if not self.shuffle:
            # Stable sort, longest first: equal lengths keep their index order.
            order = sorted(range(n), key=lambda i: -int(self.lengths[i]))
            return [order[i : i + bs] for i in range(0, n, bs)]
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=gen).tolist()
        mega = bs * self.mega_batch_mult
        order: list[int] = []
        for start in range(0, n, mega):
            group = perm[start : start + mega]
            order.extend(sorted(group, key=lambda i: -int(self.lengths[i])))
        batches = [order[i : i + bs] for i in range(0, n, bs)]
        full = batches if n % bs == 0 else batches[:-1]
        partial = [] if n % bs == 0 else batches[-1:]
        shuffled = [full[i] for i in torch.randperm(len(full), generator=gen).tolist()]
        if shuffled:
            longest = max(range(len(shuffled)), key=lambda b: int(self.lengths[shuffled[b]].max()))
            shuffled[0], shuffled[longest] = shuffled[longest], shuffled[0]
        return shuffled + partial

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch


def _max_seq_len_refusal(plan: Any, engine: str) -> str | None:
    if engine == "hf":
        return (
            "max_seq_len is not applied inside the Hugging Face Trainer; truncate in the "
            "tokenizer (max_length=...) and set max_seq_len null"
        )
    if engine == "lightning":
        return (
            "max_seq_len is not applied by the Lightning callback; truncate in the DataLoader "
            "or set max_seq_len null"
        )
    return None


def _check_max_seq_len(plan: Any) -> None:
    """The truncation length (``Technique.check``)."""
    if plan.max_seq_len is not None and (
        not isinstance(plan.max_seq_len, int) or plan.max_seq_len < 1
    ):
        raise ValueError(
            f"max_seq_len must be a whole number >= 1 or null, got {plan.max_seq_len!r}"
        )


#: Truncation of every micro-batch's sequences, by the step (``run_step``).
MAX_SEQ_LEN = Technique(
    name="max_seq_len",
    plan_field="max_seq_len",
    order=210,
    engines=frozenset({"single", "data"}),
    refusal=_max_seq_len_refusal,
    swappable=True,
    allow={"shorter-seq": "truncate sequences to 1/2 or 1/4 of their length"},
    summary=lambda length: f"max length {length}",
    check=_check_max_seq_len,
)


def _sequence_refusal(plan: Any, engine: str) -> str | None:
    if engine == "lightning":
        return (
            "sequence settings are not applied by the Lightning callback; shape batches in "
            "the DataLoader or use the default sequence config"
        )
    return None


#: Padding and batching of sequences, by the data loader of memfit's Trainer.
SEQUENCE = Technique(
    name="sequence",
    plan_field="sequence",
    order=220,
    is_on=lambda plan: plan.sequence != SequenceConfig(),
    engines=frozenset({"single", "data", "hf", "layout"}),
    refusal=_sequence_refusal,
    swappable=True,
)
