"""Chat records rendered with the tokenizer's chat template, the prompt masked exactly, and the
loss of a masked batch the loss of the answer tokens alone."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from memfit.train.chat import IGNORE_INDEX, SupervisedDataset, build_dataset, render
from memfit.train.data import TextDataset, collate
from memfit.train.records import Record, read_records
from memfit.train.tokenizer import ByteTokenizer, PretrainedTokenizer, load_tokenizer
from memfit.workload import WorkloadError

from ._helpers import chat_tokenizer_dir

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "what is two plus two"}
ANSWER = {"role": "assistant", "content": "it is four"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> PretrainedTokenizer:
    tokenizer = load_tokenizer(chat_tokenizer_dir(tmp_path_factory.mktemp("tok")))
    assert isinstance(tokenizer, PretrainedTokenizer) and tokenizer.chat_template
    return tokenizer


def _ids(tok, messages, **kwargs) -> list[int]:
    out = tok.inner.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _chat(*messages) -> Record:
    return Record("chat", "test line 1", messages=tuple(messages))


@pytest.mark.parametrize(
    "messages",
    [
        [USER, ANSWER],
        [SYSTEM, USER, ANSWER],
        # Only the last answer is learned: the earlier one is prompt.
        [USER, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "what is it"}, ANSWER],
    ],
)
def test_labels_are_the_input_ids_only_on_the_last_answer(tok, messages):
    ids, n_prompt = render(_chat(*messages), tok)
    assert ids == _ids(tok, messages)  # the template's own tokens, unchanged
    prompt = _ids(tok, messages[:-1], add_generation_prompt=True)
    assert n_prompt == len(prompt) and ids[:n_prompt] == prompt
    sample = SupervisedDataset([_chat(*messages)], tok, 256)[0]
    labels = sample["labels"].tolist()
    assert sample["input_ids"].tolist() == ids
    assert labels == [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    # The learned tokens are the answer and the template's end of turn, nothing else.
    assert tok.inner.decode(ids[n_prompt:]) == "it is four<|im_end|>\n"


def test_prompt_completion_renders_as_a_user_and_an_assistant_turn(tok):
    record = Record("prompt", "x", prompt=USER["content"], completion=ANSWER["content"])
    assert render(record, tok) == render(_chat(USER, ANSWER), tok)


def test_prompt_completion_without_a_template_joins_the_two(tmp_path):
    record = Record("prompt", "x", prompt="2+2=", completion="4")
    ids, n_prompt = render(record, ByteTokenizer())
    assert ids == [*b"2+2=", *b"4", ByteTokenizer.eos_token_id] and n_prompt == 4


def test_chat_without_a_template_is_one_sentence(tmp_path):
    bare = load_tokenizer(chat_tokenizer_dir(tmp_path / "bare", chat_template=None))
    for tokenizer in (ByteTokenizer(), bare):
        with pytest.raises(WorkloadError, match="has no chat template") as info:
            render(_chat(USER, ANSWER), tokenizer)
        assert "test line 1" in str(info.value) and "\n" not in str(info.value)


def test_a_template_that_refuses_the_chat_is_one_sentence(tmp_path):
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}"
    tokenizer = load_tokenizer(chat_tokenizer_dir(tmp_path / "strict", chat_template=strict))
    with pytest.raises(WorkloadError, match=r"test line 1 cannot be rendered .*needs a system turn"):
        render(_chat(USER, ANSWER), tokenizer)


def test_the_loss_of_a_masked_batch_is_the_answer_tokens_cross_entropy(tok):
    chats = [[USER, ANSWER], [SYSTEM, USER, {"role": "assistant", "content": "four"}]]
    data = SupervisedDataset([_chat(*m) for m in chats], tok, 256)
    batch = collate([data[0], data[1]], pad_token_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, max(data.lengths))
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    loss = model(**batch).loss
    # By hand: each position predicts the next token, counted only where that token is an
    # answer token (the prompt's boundary from the template itself, padding never).
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms = []
    for row, messages in enumerate(chats):
        ids = _ids(tok, messages)
        start = len(_ids(tok, messages[:-1], add_generation_prompt=True))
        for t in range(max(start, 1), len(ids)):
            terms.append(F.cross_entropy(logits[row, t - 1], torch.tensor(ids[t]), reduction="none"))
    assert len(terms) == data.answer_tokens
    torch.testing.assert_close(loss, torch.stack(terms).mean())


def test_truncation_is_counted_and_an_answer_cut_away_is_dropped(tok):
    long_prompt = {"role": "user", "content": " ".join(["two plus two"] * 30)}
    records = [_chat(USER, ANSWER), _chat(USER, {"role": "assistant", "content": "four " * 40}),
               _chat(long_prompt, ANSWER)]  # fmt: skip
    data = SupervisedDataset(records, tok, 24)
    assert data.truncated == 2 and data.dropped == 1 and len(data) == 2
    assert max(data.lengths) == 24
    assert data.wheres == ["test line 1", "test line 1"]
    with pytest.raises(WorkloadError, match="keeps a token of its answer"):
        SupervisedDataset(records[2:], tok, 24)


def test_build_dataset_packs_text_and_keeps_chats_apart(tmp_path, tok):
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"text": "hello world " * 20}) + "\n")
    chat = tmp_path / "c.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": m}) for m in ([USER, ANSWER], [SYSTEM, USER, ANSWER])))
    assert isinstance(build_dataset([text], tok, 16), TextDataset)
    mixed = build_dataset([chat, text], tok, 512)
    assert isinstance(mixed, SupervisedDataset) and len(mixed) == 3
    # The text record is learned whole (with its end-of-text token).
    assert (mixed[2]["labels"] == mixed[2]["input_ids"]).all()
    assert mixed[2]["input_ids"][-1].item() == tok.eos_token_id
    assert mixed.wheres[1] == f"data file {str(chat)!r} line 2"
    assert len(read_records([chat])) == 2
