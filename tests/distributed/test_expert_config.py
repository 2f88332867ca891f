"""Plan.parallel.expert without processes: its validation, the plan JSON, what it refuses, and
the per-rank dry run's worst rank under ``expert_load``."""

from __future__ import annotations

import json

import pytest

from memfit import Plan
from memfit.distributed.config import ParallelConfig
from memfit.plan import PlanError


def test_expert_degree_round_trips_through_plan_json():
    plan = Plan(parallel={"data": 8, "expert": 4, "zero_stage": 2})
    assert plan.parallel.expert == 4
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.parallel.expert == 4
    assert Plan().to_dict()["parallel"]["expert"] == 1


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"data": 4, "expert": 0}, "whole number >= 1"),
        ({"data": 4, "expert": 2.0}, "whole number >= 1"),
        ({"data": 4, "expert": True}, "whole number >= 1"),
        ({"data": 6, "expert": 4}, "must divide data 6"),
        ({"data": 4, "expert": 2, "zero_stage": 1}, "zero_stage 1"),
        ({"data": 2, "tensor": 2, "expert": 2}, "tensor parallelism"),
        ({"data": 2, "pipeline": 2, "expert": 2, "zero_stage": 2}, "zero_stage 0 only"),
    ],
)
def test_bad_expert_settings_are_one_sentence(fields, words):
    with pytest.raises(PlanError, match=words) as err:
        Plan(parallel=fields)
    assert "\n" not in str(err.value)


def test_expert_problems_are_listed_by_the_config():
    assert ParallelConfig(data=8, expert=8).problems() == []
    assert ParallelConfig(data=8, expert=3).problems() == [
        "parallel expert 3 must divide data 8 (the expert ranks are carved out of the "
        "data-parallel ranks); use an expert degree that divides 8"]


def test_a_dense_model_is_refused_with_a_sentence():
    from memfit.distributed.expert import apply_expert_parallel
    from memfit.estimate.distributed import fake_process_group

    from ..models import Stack

    with fake_process_group(2), pytest.raises(ValueError, match="mixture-of-experts"):
        apply_expert_parallel(Stack(), 2, 2)


MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=16,
               num_local_experts=4, num_experts_per_tok=2)  # fmt: skip


@pytest.mark.slow
def test_expert_load_makes_the_first_rank_of_a_group_the_largest(tmp_path):
    """Balanced routing gives both expert ranks the same peak and a smaller one than the
    unsplit experts; with expert_load 3, expert 0's rank receives three times its share of
    expert 0's tokens and its peak grows above the other rank's."""
    from memfit.estimate.distributed import predict_ranks

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    split = Plan(parallel={"data": 2, "expert": 2})
    whole = predict_ranks(str(path), Plan(parallel={"data": 2}), batch_size=4, seq_len=16)
    even = predict_ranks(str(path), split, batch_size=4, seq_len=16)
    loaded = predict_ranks(str(path), split, batch_size=4, seq_len=16, expert_load=3)
    assert even.peak_bytes[0] == even.peak_bytes[1] < whole.peak_bytes[0]
    assert loaded.peak_bytes[0] > loaded.peak_bytes[1]
    assert loaded.peak_bytes[0] > even.peak_bytes[0]


def test_dry_run_counts_fall_back_to_balanced_without_known_values():
    """A fake tensor whose values no policy gave (more routed tokens than a shadow holds)
    stands for the balanced split; real counts are read as they are."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.distributed.expert import _counts

    assert _counts(torch.tensor([3, 1, 0, 6]), 10, 4) == [3, 1, 0, 6]
    with FakeTensorMode():
        fake = torch.empty(4, dtype=torch.long)
        assert _counts(fake, 10, 4) == [3, 3, 2, 2]
