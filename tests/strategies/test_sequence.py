"""Sequence shaping: truncation, dynamic padding, length-grouped batches, and their memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

import memfit
from memfit.strategies.sequence import LengthGroupedSampler, pad_collate, truncate
from memfit.workload import load_workload


# ---------------------------------------------------------------------------------- truncate
def test_truncate_cuts_every_sequence_tensor_and_keeps_per_sample_labels():
    ids = torch.arange(24).reshape(2, 12)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
        "token_type_ids": torch.zeros(2, 12, dtype=torch.long),
        "labels": ids.clone(),
        "inputs_embeds": torch.randn(2, 12, 4),
        "class_labels": torch.tensor([0, 1]),
        "other": torch.randn(2, 5),  # a 2-D tensor of another length: not a sequence
    }
    out = truncate(batch, 5)
    for key in ("input_ids", "attention_mask", "token_type_ids", "labels"):
        assert out[key].shape == (2, 5)
        assert out[key].is_contiguous()
    assert torch.equal(out["input_ids"], ids[:, :5])
    assert out["inputs_embeds"].shape == (2, 5, 4)
    assert out["class_labels"] is batch["class_labels"]
    assert out["other"] is batch["other"]


def test_truncate_leaves_short_batches_alone_and_handles_tensors_and_tuples():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.tensor([1, 0])}
    assert truncate(batch, 4) is batch
    assert truncate(batch, 100) is batch
    assert truncate(torch.zeros(3, 10), 4).shape == (3, 4)
    x, y = truncate((torch.zeros(3, 10), torch.zeros(3)), 4)
    assert x.shape == (3, 4) and y.shape == (3,)
    with pytest.raises(ValueError, match="max_seq_len"):
        truncate(batch, 0)


# ---------------------------------------------------------------------------------- padding
def test_pad_collate_pads_to_the_longest_and_builds_the_mask():
    samples = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
        {"input_ids": [8], "labels": [8]},
        {"input_ids": torch.tensor([1, 2, 3, 4, 9]), "labels": torch.tensor([1, 2, 3, 4, 9])},
    ]
    out = pad_collate(samples, pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out["labels"].tolist() == [
        [5, 6, 7, -100, -100],
        [8, -100, -100, -100, -100],
        [1, 2, 3, 4, 9],
    ]
    assert out["input_ids"].dtype == out["attention_mask"].dtype == torch.long


def test_pad_collate_multiple_max_len_classification_and_own_mask():
    samples = [{"input_ids": list(range(1, n + 1)), "label": n % 2} for n in (3, 9, 6)]
    out = pad_collate(samples, pad_id=99, pad_to_multiple_of=4)
    assert out["input_ids"].shape == (3, 12)  # 9 rounded up to a multiple of 4
    assert out["label"].tolist() == [1, 1, 0]  # per-sample labels are stacked, not padded
    assert out["attention_mask"].sum(1).tolist() == [3, 9, 6]
    assert (out["input_ids"][out["attention_mask"] == 0] == 99).all()
    cut = pad_collate(samples, max_seq_len=5, pad_to_multiple_of=4)
    assert cut["input_ids"].shape == (3, 5)  # never beyond max_seq_len
    assert cut["attention_mask"].sum(1).tolist() == [3, 5, 5]
    own = pad_collate(
        [{"input_ids": [1, 2], "attention_mask": [1, 0]}, {"input_ids": [3], "attention_mask": [1]}]
    )
    assert own["attention_mask"].tolist() == [[1, 0], [1, 0]]
    embeds = pad_collate([{"inputs_embeds": torch.ones(2, 3)}, {"inputs_embeds": torch.ones(4, 3)}])
    assert embeds["inputs_embeds"].shape == (2, 4, 3)
    assert embeds["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="same keys"):
        pad_collate([{"input_ids": [1]}, {"labels": [1]}])
    with pytest.raises(ValueError, match="at least one"):
        pad_collate([])


# ---------------------------------------------------------------------------------- sampler
def _lengths(n: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _padded_tokens(batches: list[list[int]], lengths: torch.Tensor) -> int:
    return sum(len(b) * int(lengths[b].max()) for b in batches)


@pytest.mark.parametrize("n", [1000, 997])
def test_sampler_yields_every_index_once_per_epoch(n):
    lengths = _lengths(n)
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=3)
    assert len(sampler) == n
    first = list(sampler)
    assert sorted(first) == list(range(n))
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(n))
    assert first != second  # another epoch, another order
    sampler.set_epoch(0)
    assert list(sampler) == first  # reproducible
    batches = sampler.batches()
    assert all(len(b) == 8 for b in batches[:-1])
    assert len(batches[-1]) == (n % 8 or 8)  # the partial batch is last: DataLoader aligns


def test_sampler_groups_similar_lengths():
    lengths = _lengths()
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=0, mega_batch_mult=50)
    grouped = sampler.batches()
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    random_batches = [perm[i : i + 8] for i in range(0, len(perm), 8)]
    real = int(lengths.sum())
    waste_grouped = _padded_tokens(grouped, lengths) - real
    waste_random = _padded_tokens(random_batches, lengths) - real
    # Random batches of uniform lengths pad ~78% of a batch's max; sorted mega-batches of 400
    # leave gaps of ~1/400 of the range per batch.
    assert waste_grouped < 0.05 * waste_random
    # The batch holding the longest sequence comes first (an out-of-memory error shows at once).
    assert int(lengths[grouped[0]].max()) == int(lengths.max())
    # Without shuffling: sorted by length, longest first.
    ordered = list(LengthGroupedSampler(lengths, 8, shuffle=False))
    assert [int(lengths[i]) for i in ordered] == sorted(lengths.tolist(), reverse=True)


def test_sampler_with_dataloader_and_pad_collate():
    lengths = _lengths(64, seed=1)
    data = [{"input_ids": list(range(int(n)))} for n in lengths]
    sampler = LengthGroupedSampler(lengths, batch_size=4, seed=0, mega_batch_mult=4)
    loader = DataLoader(data, batch_size=4, sampler=sampler, collate_fn=pad_collate)
    seen = 0
    for batch, indices in zip(loader, sampler.batches(), strict=True):
        assert batch["input_ids"].shape[1] == int(lengths[indices].max())
        seen += batch["input_ids"].shape[0]
    assert seen == 64


# ---------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("spec", ["gpt2-tiny", "bert-tiny"])
def test_activation_memory_follows_the_sequence_length(spec):
    model, batch = load_workload(spec, 2, 64).build()
    kept = {}
    for seq in (64, 32):
        part = truncate(batch, seq)
        m = copy.deepcopy(model)
        with memfit.track(m) as tracker:
            out = m(**part)
            now = tracker.snapshot()
            out.loss.backward()
        kept[seq] = now["activations"]
    # Activations are linear in the length, plus a quadratic part where attention keeps its
    # (batch, heads, seq, seq) probabilities (the CPU attention path with a mask): half the
    # tokens keep between a quarter and a half of the activations (2% for constants).
    assert kept[64] / 4 <= kept[32] <= 1.02 * kept[64] / 2


def test_dynamic_padding_keeps_activations_of_the_real_lengths():
    model, _ = load_workload("gpt2-tiny", 4, 64).build()
    samples = [{"input_ids": list(range(1, 17)), "labels": list(range(1, 17))} for _ in range(4)]
    dynamic = pad_collate(samples)  # 16 tokens: the longest in the batch
    fixed = pad_collate(samples, pad_to_multiple_of=64)  # padded to 64 as a fixed length would
    assert dynamic["input_ids"].shape == (4, 16) and fixed["input_ids"].shape == (4, 64)
    kept = []
    for batch in (dynamic, fixed):
        m = copy.deepcopy(model)
        with memfit.track(m) as tracker:
            out = m(**batch)
            kept.append(tracker.snapshot()["activations"])
            out.loss.backward()
    # A quarter of the tokens: a quarter of the linear part, a sixteenth of the quadratic.
    assert kept[1] / 16 <= kept[0] <= 1.02 * kept[1] / 4
