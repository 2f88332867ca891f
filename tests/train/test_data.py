"""Tokenizers, corpus, text files, datasets, batches and the train/eval split."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from memfit.train.data import (
    BatchStream,
    TextDataset,
    collate,
    lengths_of,
    stdlib_corpus,
    train_eval_split,
)
from memfit.train.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer
from memfit.workload import WorkloadError

from ._helpers import TEXT


# ---------------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld 🙂\n\tdef f(): pass"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 259
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    framed = tok.encode("a", add_special_tokens=True)
    assert framed == [257, 97, 258]
    assert tok.decode(framed) == "a"  # specials are dropped


def test_load_tokenizer_none_is_bytes():
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_load_tokenizer_json_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the cat sat on the mat", "the dog sat"],
        trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "</s>"]),
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    for where in (path, tmp_path):  # the file, or the folder holding it
        loaded = load_tokenizer(where)
        assert isinstance(loaded, FileTokenizer)
        assert loaded.vocab_size == tok.get_vocab_size()
        assert loaded.pad_token_id == tok.token_to_id("[PAD]")
        assert loaded.eos_token_id == tok.token_to_id("</s>")
        assert loaded.decode(loaded.encode("the cat sat")) == "the cat sat"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(WorkloadError, match="cannot be read"):
        load_tokenizer(bad)


# ---------------------------------------------------------------------------------- corpus
def test_stdlib_corpus_is_deterministic_and_bounded():
    a = stdlib_corpus(50_000)
    assert a == stdlib_corpus(50_000)
    assert 40_000 < len(a.encode("utf-8")) <= 50_000
    assert "def " in a and "import " in a
    assert stdlib_corpus(10_000) == a[: len(stdlib_corpus(10_000))]


def test_packed_windows_predict_every_transition_once():
    tok = ByteTokenizer()
    ds = TextDataset(["abcdefghij", "klmnop"], tok, seq_len=4)
    stream = [*tok.encode("abcdefghij"), 258, *tok.encode("klmnop"), 258]
    pairs = collections.Counter()
    for i in range(len(ds)):
        s = ds[i]
        assert torch.equal(s["input_ids"], s["labels"])  # the model shifts (Hugging Face)
        assert len(s["input_ids"]) <= 4
        ids = s["input_ids"].tolist()
        pairs.update(itertools.pairwise(ids))
    assert pairs == collections.Counter(itertools.pairwise(stream))


def test_data_shift_windows_are_seq_len_plus_one():
    ds = TextDataset("0123456789", ByteTokenizer(), seq_len=4, label_shift="data")
    s = ds[0]
    assert s["input_ids"].tolist() == list(b"0123")
    assert s["labels"].tolist() == list(b"1234")
    assert ds[1]["input_ids"].tolist()[0] == ord("4")  # the next window starts where labels end


def test_unpacked_documents_vary_in_length_and_collate_pads():
    ds = TextDataset(["short", "a much longer document"], ByteTokenizer(), seq_len=64, pack=False)
    assert lengths_of(ds) == [6, 23]  # each with its end-of-text token
    batch = collate([ds[0], ds[1]], pad_token_id=256)
    assert batch["input_ids"].shape == (2, 23)
    assert batch["input_ids"][0, 6:].eq(256).all()
    assert batch["labels"][0, 6:].eq(-100).all()
    assert batch["attention_mask"].sum(1).tolist() == [6, 23]


def test_dataset_errors():
    with pytest.raises(WorkloadError, match="seq_len"):
        TextDataset("abc", ByteTokenizer(), seq_len=1)
    with pytest.raises(WorkloadError, match="label_shift"):
        TextDataset("abc", ByteTokenizer(), seq_len=4, label_shift="left")


def test_train_eval_split_holds_out_the_tail():
    ds = TextDataset(TEXT, ByteTokenizer(), seq_len=32)
    train, held = train_eval_split(ds, 0.1)
    assert len(train) + len(held) == len(ds)
    assert len(held) == len(ds) // 10
    assert torch.equal(held[0]["input_ids"], ds[len(train)]["input_ids"])
    assert lengths_of(held) == ds.lengths[len(train) :]
    assert train_eval_split(ds, 0)[1] is None
    with pytest.raises(WorkloadError, match="eval_fraction"):
        train_eval_split(ds, 1.5)


# ---------------------------------------------------------------------------------- batches
def test_batch_stream_epochs_are_permutations_and_resumable():
    ds = TextDataset(TEXT, ByteTokenizer(), seq_len=32)
    stream = BatchStream(ds, 8, seed=3)
    per_epoch = stream.batches_per_epoch
    seen = [i for _ in range(per_epoch) for i in stream.next_batch()[0]]
    assert len(set(seen)) == len(seen) == per_epoch * 8  # no sample twice within an epoch
    state = stream.state_dict()
    ahead = [stream.next_batch() for _ in range(3)]
    assert stream.epoch == 1  # crossed into the next epoch
    again = BatchStream(ds, 8, seed=3)
    again.load_state_dict(state)
    for (idx_a, batch_a), (idx_b, batch_b) in zip(ahead, [again.next_batch() for _ in range(3)], strict=True):
        assert idx_a == idx_b
        assert torch.equal(batch_a["input_ids"], batch_b["input_ids"])
    assert BatchStream(ds, 8, seed=4).next_batch()[0] != BatchStream(ds, 8, seed=3).next_batch()[0]


def test_batch_stream_groups_by_length():
    docs = ["x" * n for n in (3, 40, 5, 38, 4, 39, 6, 37)]
    ds = TextDataset(docs, ByteTokenizer(), seq_len=64, pack=False)
    stream = BatchStream(ds, 4, group_by_length=True)
    batch_lengths = [sorted(ds.lengths[i] for i in stream.next_batch()[0]) for _ in range(2)]
    assert sorted(batch_lengths) == [[4, 5, 6, 7], [38, 39, 40, 41]]


def test_batch_stream_needs_one_batch():
    with pytest.raises(WorkloadError, match="fewer than one batch"):
        BatchStream(TextDataset("abcdef", ByteTokenizer(), seq_len=4), 8)
