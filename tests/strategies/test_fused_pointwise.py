"""apply_fused_pointwise on Hugging Face models: same gradients, fewer saved bytes, removable."""

from __future__ import annotations

import pytest
import torch
import transformers

import memfit
from memfit.strategies.fused_pointwise import apply_fused_pointwise

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)  # fmt: skip
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, 5, 2),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}, 5, 2),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {"head_dim": 8}, 9, 2),
}


def _pair(name):
    config_cls, model_cls, extra, _, _ = MODELS[name]
    config = config_cls(**SIZES, **extra)
    torch.manual_seed(0)
    plain = model_cls(config)
    torch.manual_seed(0)
    fused = model_cls(config)
    return plain, fused


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_loss_and_gradients_as_the_stock_model(name):
    plain, fused = _pair(name)
    handle = apply_fused_pointwise(fused)
    assert (len(handle.norms), len(handle.mlps)) == MODELS[name][3:]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    a = plain(input_ids=ids, labels=ids).loss
    b = fused(input_ids=ids, labels=ids).loss
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    for (n, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_the_tracker_measures_the_saving():
    plain, fused = _pair("llama")
    apply_fused_pointwise(fused)
    ids = torch.randint(0, 128, (4, 32))
    kept = {}
    for key, model in (("plain", plain), ("fused", fused)):
        with memfit.track(model) as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            kept[key] = tracker.snapshot()["activations"]
        del loss
    tokens, hidden, inner = 4 * 32, SIZES["hidden_size"], SIZES["intermediate_size"]
    # Per layer two norms keep no normalised rows, the MLP no act(gate); plus the final norm.
    claimed = 4 * tokens * ((2 * 2 + 1) * hidden + 2 * inner)
    assert kept["plain"] - kept["fused"] >= claimed, (kept, claimed)


def test_remove_restores_the_stock_forward():
    plain, fused = _pair("llama")
    handle = apply_fused_pointwise(fused)
    handle.remove()
    handle.remove()  # idempotent
    assert all("forward" not in m.__dict__ for m in fused.modules())
    ids = torch.randint(0, 128, (2, 8))
    assert fused(input_ids=ids).logits.equal(plain(input_ids=ids).logits)


def test_a_model_with_nothing_to_fuse_is_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="fused_pointwise found nothing to fuse in GPT2LMHeadModel"):
        apply_fused_pointwise(gpt2)


def test_plan_field_dry_run_equals_real_run_and_saves(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                **SIZES, "max_position_embeddings": 64}))  # fmt: skip
    plan = memfit.Plan(fused_pointwise=True)
    real = memfit.measure(str(path), plan, batch_size=2, seq_len=32)
    dry = memfit.dry_run(str(path), plan, batch_size=2, seq_len=32)
    plain = memfit.dry_run(str(path), memfit.Plan(), batch_size=2, seq_len=32)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.peak_by_category["activations"] < plain.peak_by_category["activations"]
    assert "fused pointwise" in plan.summary()
    assert memfit.Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(memfit.PlanError, match="fused_pointwise must be true or false"):
        memfit.Plan(fused_pointwise="yes")
