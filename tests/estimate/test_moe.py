"""Mixture-of-experts dry runs: the experts' grouped matmul in fp32 as the CPU kernel takes it."""

from __future__ import annotations

import json

import pytest

import memfit

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)  # fmt: skip
MOE = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", moe_intermediate_size=32, num_experts=4,
                      shared_expert_intermediate_size=64, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, head_dim=16),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    head_dim=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(model_type="deepseek_v3", moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_dry_run_equals_real_run(tmp_path, name):
    from torch._subclasses.fake_impls import op_implementations_checks

    rules = list(op_implementations_checks)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **MOE[name]}))
    real = memfit.measure(str(path), batch_size=2, seq_len=32, steps=2)
    dry = memfit.measure(str(path), batch_size=2, seq_len=32, steps=2, dry=True)
    # transformers' grouped-matmul experts allocate by total routed tokens, not per expert,
    # so the dry run is exact whatever the routing.
    assert dry.peak_by_category == real.peak_by_category
    assert dry.meta["num_parameters"] == real.meta["num_parameters"]
    assert op_implementations_checks == rules  # the dry run's fake kernels are gone after it


@pytest.mark.parametrize(
    ("spec", "billions"), [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5)]
)
def test_moe_presets_have_the_published_sizes_and_dry_run(spec, billions):
    report = memfit.dry_run(spec, batch_size=1, seq_len=32, steps=1)
    assert round(report.meta["num_parameters"] / 1e9, 1) == billions
    # fp32 weights, gradients and two AdamW moments at the step: 16 bytes per parameter.
    assert report.peak_bytes >= 16 * report.meta["num_parameters"]


def test_module_view_shows_router_and_experts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **MOE["mixtral"]}))
    dry = memfit.measure(str(path), batch_size=2, seq_len=32, steps=1, dry=True)
    modules = set(dry.by_module)
    assert "model.layers.0.mlp.gate" in modules and "model.layers.0.mlp.experts" in modules
    # The experts' step peaks above the router's: the permuted tokens and expert activations.
    experts = dry.by_module["model.layers.0.mlp.experts"]["forward"]
    assert experts > dry.by_module["model.layers.0.mlp.gate"]["forward"]
    assert [u["op"] for u in dry.meta["data_dependent"]] == ["routing", "routing"]


@pytest.mark.slow
def test_moe_preset_plans():
    from memfit.planner import plan

    workload = memfit.load_workload("qwen3-30b-a3b", 1, 256)
    result = plan(workload, "640GiB", device="cpu")
    assert result.fits and result.predicted_peak_bytes <= 640 * 2**30
    # 30.5B parameters with AdamW: at least the fp32 weights and two moments.
    assert result.predicted_peak_bytes >= 12 * 30.5e9
