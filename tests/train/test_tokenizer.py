"""Tokenizer folders saved by ``save_pretrained`` load through transformers with their chat
template (a bare ``tokenizer.json`` and the byte tokenizer are tested in test_data.py)."""

from __future__ import annotations

import json

import pytest

from memfit.train.chat import chat_tokenizer
from memfit.train.tokenizer import PretrainedTokenizer, load_tokenizer
from memfit.workload import WorkloadError

from ._helpers import CHAT_TEMPLATE, chat_tokenizer_dir


def test_a_saved_folder_keeps_its_chat_template_and_specials(tmp_path):
    folder = chat_tokenizer_dir(tmp_path / "tok")
    for where in (folder, folder / "tokenizer.json"):  # the folder, or the file inside it
        tok = load_tokenizer(where)
        assert isinstance(tok, PretrainedTokenizer)
        assert tok.chat_template == CHAT_TEMPLATE and chat_tokenizer(tok) is tok.inner
        assert tok.eos_token_id == tok.inner.convert_tokens_to_ids("<|endoftext|>")
        assert tok.pad_token_id == tok.inner.convert_tokens_to_ids("<pad>")
        assert tok.vocab_size == len(tok.inner)
        assert tok.decode(tok.encode("hello world")) == "hello world"
        assert "PretrainedTokenizer(" in repr(tok)


def test_a_folder_without_a_template_has_none(tmp_path):
    tok = load_tokenizer(chat_tokenizer_dir(tmp_path / "tok", chat_template=None))
    assert tok.chat_template is None and chat_tokenizer(tok) is None


def test_a_config_naming_an_unknown_class_still_loads_the_fast_tokenizer(tmp_path):
    folder = chat_tokenizer_dir(tmp_path / "tok")
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "NoSuchTokenizer"}))
    tok = load_tokenizer(folder)
    assert isinstance(tok, PretrainedTokenizer) and tok.chat_template == CHAT_TEMPLATE


def test_a_folder_transformers_cannot_load_is_one_sentence(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(WorkloadError, match="cannot be loaded by transformers") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value)
