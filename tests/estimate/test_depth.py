"""Composition by block type: stacks of unlike blocks predicted from shallow prefixes."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.estimate.compose import block_pattern, predict_peak
from memfit.estimate.depth import compose_pattern, extrapolate, profile_depths


def test_profile_depths_cover_every_type_after_the_prefix():
    assert profile_depths([0] * 12) == [2, 3]
    assert profile_depths([0, 0, 0, 1, 1, 1, 1, 1]) == [2, 3, 4]  # 3 dense, then experts
    assert profile_depths([0, 1] * 4) == [2, 3, 4]  # alternating
    assert profile_depths([0, 1, 0, 2] * 2) == [2, 3, 4, 5, 6]
    assert profile_depths([0] * 9 + [1] * 3) is None  # a new type past the deepest profile


def test_compose_pattern_adds_each_later_block_by_its_type():
    pattern = [0, 1, 0, 1, 0, 1]
    at = {2: 10.0, 3: 13.0, 4: 20.0}  # a type-0 block adds 3, a type-1 block adds 7
    assert compose_pattern(at, pattern) == 20 + 3 + 7
    # One type: the same line as the uniform extrapolation.
    assert compose_pattern({2: 5.0, 3: 8.0}, [0] * 10) == extrapolate(5.0, 8.0, 10)


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)  # fmt: skip
UNLIKE = {
    # three dense layers, then mixture-of-experts layers
    "dense-then-moe": dict(BASE, model_type="deepseek_v3", moe_intermediate_size=32,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=3, kv_lora_rank=16, q_lora_rank=32,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                           topk_group=1),
    # experts every other layer
    "alternating-moe": dict(BASE, model_type="qwen2_moe", moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2,
                            shared_expert_intermediate_size=64, decoder_sparse_step=2),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(UNLIKE))
def test_unlike_blocks_compose_to_the_full_dry_run(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(UNLIKE[name]))
    workload = memfit.load_workload(str(path), 4, 32)
    pattern = block_pattern(workload)
    assert pattern is not None and len(set(pattern)) == 2
    composed = predict_peak(workload, memfit.Plan())
    full = predict_peak(workload, memfit.Plan(), compose=False)
    assert composed.method == "composed"
    # Equal to the byte on both (the uniform 2-and-3 line was off by -7.0% and -9.4%).
    assert composed.peak_bytes == full.peak_bytes
    assert composed.by_category == full.by_category
