"""The analytic layout model's pipeline terms: a norm's saved bytes, extended from short runs;
the receive buffers as the installed torch holds them."""

from __future__ import annotations

import pytest
import torch

from memfit.distributed.pipeline_plan import PipelineConfig
from memfit.estimate import pipeline_terms
from memfit.estimate.pipeline_terms import (
    _norm_saved,
    gradient_buffer_bytes,
    norm_kept_bytes,
    receive_buffer_bytes,
    receive_buffers_kept,
    stage_outputs_kept,
    stage_outputs_released,
)


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


def test_the_receive_buffers_are_read_off_the_installed_torch():
    # A second reading of torch: up to 2.14 its _RecvInfo is made with its buffer; from 2.15
    # the buffer is allocated at each receive (allocate_buffer) and taken by the compute.
    import inspect

    from torch.distributed.pipelining.stage import _RecvInfo

    made_with_buffer = "buffer" in inspect.signature(_RecvInfo.__init__).parameters
    assert receive_buffers_kept() is made_with_buffer
    assert receive_buffers_kept() is not hasattr(_RecvInfo, "take_buffer")


ENDS = {"first": (True, False), "middle": (False, False), "last": (False, True)}


def test_torch_2_15_changed_both_at_once():
    # Within the window, the buffers made per receive and the sent outputs let go of came
    # together (torch 2.15).
    assert stage_outputs_released() is not receive_buffers_kept()


@pytest.mark.parametrize("kept", [True, False], ids=["torch-2.14", "torch-2.15"])
def test_the_receive_buffers_by_torch_s_behaviour(kept, monkeypatch):
    monkeypatch.setattr(pipeline_terms, "receive_buffers_kept", lambda: kept)
    monkeypatch.setattr(pipeline_terms, "stage_outputs_released", lambda: not kept)
    config = PipelineConfig(degree=3, microbatches=4)
    stage_input = 1000
    buffers = [receive_buffer_bytes(config, r, 4, stage_input) for r in range(3)]
    outputs = {k: stage_outputs_kept(e) for k, e in ENDS.items()}
    grads = {k: gradient_buffer_bytes(e, stage_input) for k, e in ENDS.items()}
    if kept:
        # Every micro-batch's input (not on the first) and output gradient (not on the last),
        # kept for the run; the first block's saved input is the buffer.
        assert buffers == [4 * 1000, 2 * 4 * 1000, 4 * 1000]
        assert outputs == {"first": 1, "middle": 0, "last": -1}
        assert grads == {"first": 0, "middle": 0, "last": 0}
    else:
        # Made per receive: the input's is the micro-batch's own (its first block's saved
        # input), the output gradient's lives through its backward.
        assert buffers == [0, 0, 0]
        # The sent outputs let go of: nothing beyond the blocks' saved tensors; under DDP,
        # whose reducer needs them, each output cached until its backward.
        assert outputs == {"first": 0, "middle": 0, "last": 0}
        assert {k: stage_outputs_kept(e, ddp=True) for k, e in ENDS.items()} == {
            "first": 1, "middle": 1, "last": 0}
        assert grads == {"first": 1000, "middle": 1000, "last": 0}
