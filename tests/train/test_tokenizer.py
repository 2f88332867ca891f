"""Tokenizer folders read by transformers' AutoTokenizer (a model folder's own tokenizer)."""

from __future__ import annotations

import pytest

from memfit.train.tokenizer import FileTokenizer, PretrainedTokenizer, load_tokenizer
from memfit.workload import WorkloadError
from tests.models import save_tiny_llama


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
