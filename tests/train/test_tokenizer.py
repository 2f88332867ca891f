"""Tokenizer folders saved by ``save_pretrained`` load through transformers' AutoTokenizer,
with their chat template and their leading specials (a bare ``tokenizer.json`` and the byte
tokenizer are tested in test_data.py)."""

from __future__ import annotations

import json

import pytest

from memfit.train.chat import chat_tokenizer
from memfit.train.tokenizer import FileTokenizer, PretrainedTokenizer, load_tokenizer
from memfit.workload import WorkloadError
from tests.models import save_tiny_llama

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
    with pytest.raises(WorkloadError, match="cannot be read by transformers") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value)


def test_a_tokenizer_folder_is_read_by_autotokenizer(tmp_path):
    save_tiny_llama(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, PretrainedTokenizer)
    assert (tok.vocab_size, tok.pad_token_id, tok.eos_token_id) == (21, 0, 2)
    assert tok.encode("the quick fox") == [4, 5, 7] and tok.prefix == []
    assert tok.decode([1, 4, 5, 2]) == "the quick"
    # A tokenizer.json alone is still read by the tokenizers library.
    (tmp_path / "tokenizer_config.json").unlink()
    assert isinstance(load_tokenizer(tmp_path), FileTokenizer)


def test_a_tokenizer_that_frames_texts_keeps_its_leading_token_only(tmp_path):
    import transformers
    from tokenizers import processors

    save_tiny_llama(tmp_path)
    inner = transformers.AutoTokenizer.from_pretrained(tmp_path)
    # A Llama-style post-processor: <s> before, </s> after. The dataset ends every document
    # with the end-of-text id itself, so only the leading <s> is kept.
    inner.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tok = PretrainedTokenizer(inner, tmp_path)
    assert tok.prefix == [1] and tok.encode("the dog") == [1, 4, 11]


def test_an_unreadable_tokenizer_folder_is_one_sentence(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(WorkloadError, match="cannot be read by transformers' AutoTokenizer") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
