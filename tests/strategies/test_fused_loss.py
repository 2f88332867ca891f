"""apply_fused_loss: a Hugging Face causal LM's loss and gradients, without its logits' bytes.

Tolerance: fp32 loss and every parameter gradient equal the stock model's to 1e-5 (relative and
absolute); under bf16 autocast within 2e-2 of the largest entry (both paths round to bf16).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import memfit
from memfit.strategies.fused_loss import FusedLossConfig, FusedLossHandle, apply_fused_loss
from tests.train._helpers import tiny_gpt2

TOL = {"rtol": 1e-5, "atol": 1e-5}


def tiny_llama(vocab: int = 300, hidden: int = 32) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def tiny_gemma2() -> nn.Module:
    """Gemma 2 soft-caps its final logits (at 5.0 here): the fused loss must too."""
    config = transformers.Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        final_logit_softcapping=5.0,
    )
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).train()


MODELS = {"gpt2-tied": tiny_gpt2, "llama": tiny_llama, "gemma2-softcap": tiny_gemma2}


def _batch(batch: int = 2, length: int = 16, vocab: int = 259) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # padding-like ignored positions
    return {"input_ids": ids, "labels": labels}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model: nn.Module, batch: dict, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    return out, _grads(model)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_items", [None, 23])
def test_same_loss_and_gradients_as_stock(name, num_items):
    stock = MODELS[name]()
    fused = copy.deepcopy(stock)
    handle = apply_fused_loss(fused, FusedLossConfig(chunk_size=5))
    assert callable(handle.remove)  # the Removable protocol of every apply_*
    assert handle.softcap == (5.0 if name == "gemma2-softcap" else None)
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want, want_grads = _step(stock, _batch(), **kwargs)
    got, got_grads = _step(fused, _batch(), **kwargs)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got.logits.shape == (2, 16, 0)  # no logits were made
    assert set(got_grads) == set(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, **TOL, msg=key)


def test_labels_given_positionally():
    stock = tiny_llama()
    fused = copy.deepcopy(stock)
    apply_fused_loss(fused)
    batch = _batch()
    # LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, past_key_values,
    # inputs_embeds, labels, ...)
    got = fused(batch["input_ids"], None, None, None, None, batch["labels"])
    want = stock(batch["input_ids"], None, None, None, None, batch["labels"])
    assert got.logits.shape[-1] == 0
    torch.testing.assert_close(got.loss, want.loss, **TOL)


def test_autocast_bf16_matches_stock_autocast():
    stock = tiny_llama()
    fused = copy.deepcopy(stock)
    apply_fused_loss(fused, FusedLossConfig(chunk_size=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _step(stock, _batch())
        got, got_grads = _step(fused, _batch())
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-3, atol=1e-3)
    for key, grad in want_grads.items():
        assert got_grads[key].dtype == torch.float32
        scale = grad.abs().max().item()
        torch.testing.assert_close(got_grads[key], grad, rtol=2e-2, atol=2e-2 * scale, msg=key)


def test_eval_no_grad_and_no_labels_keep_their_logits():
    model = tiny_llama()
    apply_fused_loss(model)
    batch = _batch()
    assert model(input_ids=batch["input_ids"]).logits.shape == (2, 16, 300)  # no labels
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (2, 16, 300) and out.loss is not None
    model.eval()
    assert model(**batch).logits.shape == (2, 16, 300)
    model.train()
    assert model(**batch).logits.shape == (2, 16, 0)


def test_training_only_false_fuses_evaluation_too():
    stock = tiny_llama().eval()
    fused = copy.deepcopy(stock)
    apply_fused_loss(fused, FusedLossConfig(training_only=False))
    with torch.no_grad():
        got, want = fused(**_batch()), stock(**_batch())
    assert got.logits.shape == (2, 16, 0)
    torch.testing.assert_close(got.loss, want.loss, **TOL)


def test_a_raising_forward_leaves_nothing_behind():
    model = tiny_llama()
    handle = apply_fused_loss(model)
    batch = _batch()
    # The fused loss checks the labels' shape itself, before any state is left half set.
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 16\).*got \(2, 3\)"):
        model(input_ids=batch["input_ids"], labels=batch["labels"][:, :3])
    assert handle._state.hidden is None and not handle._state.fuse
    assert model(input_ids=batch["input_ids"]).logits.shape == (2, 16, 300)


# ---------------------------------------------------------------------------------- memory
def _peak(model: nn.Module, batch: dict) -> int:
    with memfit.track(model) as tracker:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.report().peak_bytes


def test_tracker_shows_the_logits_gone():
    """Large vocabulary, small hidden size: the logits dominate the stock peak."""
    vocab, chunk = 4096, 16
    batch = _batch(batch=2, length=64, vocab=vocab)
    tokens = batch["input_ids"].numel()
    stock = tiny_llama(vocab=vocab)
    fused = copy.deepcopy(stock)
    apply_fused_loss(fused, FusedLossConfig(chunk_size=chunk))
    saved = _peak(stock, batch) - _peak(fused, batch)
    logits32 = tokens * vocab * 4
    # At least the fp32 logits and their gradient, less the one chunk the fused loss holds.
    assert saved >= 2 * logits32 - chunk * vocab * 4


# ---------------------------------------------------------------------------------- remove
def _snapshot(model: nn.Module) -> list:
    """Module types, instance attributes (hooks as the functions they hold), parameters."""
    shot = []
    for name, m in model.named_modules(remove_duplicate=False):
        attrs = {}
        for key, value in m.__dict__.items():
            if isinstance(value, dict) and "hook" in key:
                value = [getattr(h, "__qualname__", type(h).__qualname__) for h in value.values()]
            elif key in ("_parameters", "_buffers", "_modules"):
                value = sorted(value)
            else:
                value = type(value).__qualname__
            attrs[key] = value
        shot.append((name, type(m), attrs))
    ties = [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    return [shot, [n for n, _ in ties], len({i for _, i in ties})]


@pytest.mark.parametrize("name", list(MODELS))
def test_remove_restores_the_model_exactly(name):
    model = MODELS[name]()
    fresh = copy.deepcopy(model)
    before = _snapshot(model)
    handle = apply_fused_loss(model)
    assert _snapshot(model) != before
    _step(model, _batch())
    handle.remove()
    handle.remove()  # idempotent
    assert _snapshot(model) == before
    assert "forward" not in model.get_output_embeddings().__dict__
    assert "_loss_function" not in model.__dict__
    out, grads = _step(model, _batch())
    assert out.logits.shape == (2, 16, model.config.vocab_size)
    fresh_out, fresh_grads = _step(fresh, _batch())
    # The parameters were never touched: the restored model computes the fresh model's step.
    assert torch.equal(out.loss, fresh_out.loss)
    assert all(torch.equal(grads[k], fresh_grads[k]) for k in fresh_grads)


def test_remove_keeps_an_existing_loss_function_and_head_forward():
    model = tiny_llama()
    head = model.get_output_embeddings()
    own_forward = head.forward  # a bound method stored as an instance attribute
    head.forward = own_forward
    original = model.loss_function
    model.loss_function = original
    handle = apply_fused_loss(model)
    handle.remove()
    assert head.__dict__["forward"] is own_forward
    assert model.__dict__["_loss_function"] is original


def test_deepcopy_of_a_fused_model_is_independent():
    model = tiny_llama()
    handle = apply_fused_loss(model)
    twin = copy.deepcopy(model)
    handle.remove()
    assert model(**_batch()).logits.shape == (2, 16, 300)
    out = twin(**_batch())
    assert out.logits.shape == (2, 16, 0)
    torch.testing.assert_close(out.loss, model(**_batch()).loss, **TOL)


# ---------------------------------------------------------------------------------- refusals
def test_refuses_what_it_cannot_fuse():
    with pytest.raises(ValueError, match="fused_linear_loss"):
        apply_fused_loss(nn.Sequential(nn.Linear(4, 4)))
    model = tiny_llama()
    apply_fused_loss(model)
    with pytest.raises(ValueError, match="already has"):
        apply_fused_loss(model)
    scaled = tiny_llama()
    scaled.config.logits_scaling = 2.0  # as Granite divides its logits
    with pytest.raises(ValueError, match=r"logits_scaling"):
        apply_fused_loss(scaled)
    other = tiny_llama()
    other.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match="causal-LM loss"):
        apply_fused_loss(other)
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLossConfig(chunk_size=0)
    assert isinstance(apply_fused_loss(tiny_llama()), FusedLossHandle)
