"""The analytic layout model's pipeline terms: a norm's saved bytes, extended from short runs."""

from __future__ import annotations

import pytest
import torch

from memfit.estimate.pipeline_terms import _norm_saved, norm_kept_bytes


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2))


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=512, n_embd=96, n_layer=1,
                                      n_head=4))


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["rmsnorm", "layernorm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_norm_s_saved_bytes_extend_from_one_and_two_tokens_to_any_length(build, dtype):
    """Measured at one and two tokens and extended, the saved bytes equal a run at 37 and at
    300 tokens to the byte (at 128k tokens a run would allocate gigabytes)."""
    model = build()
    norm = getattr(getattr(model, "model", None), "norm", None) or model.transformer.ln_f
    for tokens in (37, 300):
        assert norm_kept_bytes(model, tokens, dtype) == _norm_saved(norm, tokens, dtype) > 0


def test_a_model_without_a_norm_where_memfit_looks_saves_nothing():
    assert norm_kept_bytes(torch.nn.Linear(4, 4), 128, "float32") == 0
