"""Dry runs on fake tensors give the real run's peak; bad workloads fail clearly."""

from __future__ import annotations

import pytest

import memfit
from memfit.estimate import ModelError
from memfit.workload import WorkloadError


@pytest.mark.parametrize(
    ("spec", "batch", "seq"),
    [
        ("gpt2-tiny", 4, 32),
        ("bert-tiny", 4, 32),
        ("llama-tiny", 4, 32),
        ("tests.models:conv_workload", 4, 16),
        ("tests.models:mlp_workload", 8, 1),
    ],
)
def test_dry_run_peak_equals_real_run(spec, batch, seq):
    real = memfit.measure(spec, batch_size=batch, seq_len=seq, steps=2)
    dry = memfit.dry_run(spec, batch_size=batch, seq_len=seq, steps=2)
    assert abs(dry.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    # In fact the dispatch-level count is identical, category by category.
    assert dry.peak_by_category == real.peak_by_category
    assert dry.meta["dry_run"] and not real.meta["dry_run"]
    assert dry.meta["num_parameters"] == real.meta["num_parameters"]


def test_dry_run_counts_all_steps_and_categories():
    rep = memfit.dry_run("gpt2-tiny", batch_size=2, seq_len=16, steps=3)
    assert len(rep.step_peaks) == 3
    assert rep.peak_by_category["optimizer_state"] > 0
    assert rep.peak_by_category["parameters"] == 4 * rep.meta["num_parameters"]


@pytest.mark.slow
def test_bert_large_dry_run_at_full_scale():
    rep = memfit.dry_run("bert-large", batch_size=32, seq_len=128)
    n = rep.meta["num_parameters"]
    assert 320e6 < n < 330e6
    # fp32 weights, AdamW: 4 + 4 + 8 bytes per parameter are alive at the optimizer step.
    assert rep.phase_peaks["optimizer"] >= 16 * n
    assert rep.peak_by_category["parameters"] == 4 * n


def test_model_errors_and_missing_loss():
    with pytest.raises(ModelError, match=r"custom failure inside Broken\.forward"):
        memfit.dry_run("tests.models:broken_forward_workload", batch_size=2, seq_len=1)
    with pytest.raises(WorkloadError, match="has no loss"):
        memfit.measure("tests.models:no_loss_workload", batch_size=2, seq_len=1)


def test_plan_is_applied_in_dry_run():
    plan = memfit.Plan(grad_accum_steps=4)
    plain = memfit.dry_run("gpt2-tiny", batch_size=8, seq_len=32, steps=1)
    accum = memfit.dry_run("gpt2-tiny", plan, steps=1, batch_size=8, seq_len=32)
    assert accum.meta["plan"]["grad_accum_steps"] == 4
    assert accum.peak_by_category["activations"] < plain.peak_by_category["activations"]


HF_CONFIGS = {
    "vit": {
        "model_type": "vit",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "image_size": 32,
        "patch_size": 8,
        "architectures": ["ViTForImageClassification"],
    },
    "distilbert": {
        "model_type": "distilbert",
        "dim": 64,
        "n_layers": 2,
        "n_heads": 2,
        "hidden_dim": 128,
        "vocab_size": 300,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_configs_dry_run_equals_real_run(tmp_path, name):
    """Vision and text configs: weights tied as in the real model, and the same peak."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    real = memfit.measure(str(path), batch_size=2, seq_len=16)
    dry = memfit.dry_run(str(path), batch_size=2, seq_len=16)
    assert dry.meta["num_parameters"] == real.meta["num_parameters"]
    assert dry.peak_by_category == real.peak_by_category


def test_dry_run_limitations_blame_the_dry_run_and_name_the_operator():
    from memfit.estimate.dryrun import DryRunLimitation

    # The real run reads a value computed from activations...
    memfit.measure("tests.models:value_read_workload", batch_size=2, seq_len=1)
    # ...the dry run cannot, and says so: the operator, the module, what to do instead.
    with pytest.raises(DryRunLimitation) as info:
        memfit.dry_run("tests.models:value_read_workload", batch_size=2, seq_len=1)
    message = str(info.value)
    assert message.startswith("dry-run limitation: operator aten._local_scalar_dense")
    assert "inside module 'reader'" in message and "without --dry-run" in message
    assert "the model raised" not in message


def test_a_data_dependent_shape_of_activations_takes_its_upper_bound():
    real = memfit.measure("tests.models:data_dependent_workload", batch_size=2, seq_len=1)
    dry = memfit.dry_run("tests.models:data_dependent_workload", batch_size=2, seq_len=1)
    assert dry.meta["data_dependent"] == [
        {"op": "aten.nonzero", "module": "gate", "policy": "upper bound: every element kept",
         "count": 2}
    ]  # fmt: skip
    # Every element kept: at least what the real run kept, and the index tensors in full.
    assert dry.peak_bytes >= real.peak_bytes
    assert real.meta.get("data_dependent") is None


def test_constants_are_computed_for_real():
    real = memfit.measure("tests.models:constant_schedule_workload", batch_size=2, seq_len=1)
    dry = memfit.dry_run("tests.models:constant_schedule_workload", batch_size=2, seq_len=1)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.meta["data_dependent"] == []


def test_dry_run_limitation_while_the_model_is_built():
    from memfit.estimate.dryrun import DryRunLimitation

    with pytest.raises(DryRunLimitation, match="while the model was built"):
        memfit.dry_run("tests.models:value_read_in_constructor_workload", batch_size=2, seq_len=1)




def test_should_stop_stops_a_dry_run_in_backward_too():
    # A dry run asks should_stop every few operators: a condition that holds only inside the
    # autograd engine (no checkpointing, so no module forward runs there) stops it there,
    # and the report covers the run up to that point. A real run asks at each forward's end.
    import torch

    workload = memfit.load_workload("gpt2-tiny", 2, 16)
    seen = []

    def in_backward() -> bool:
        seen.append(torch._C._current_graph_task_id() != -1)
        return seen[-1]

    full = memfit.dry_run(workload, memfit.Plan())
    stopped = memfit.dry_run(workload, memfit.Plan(), should_stop=in_backward)
    assert seen[-1] and not seen[0]
    assert stopped.meta["stopped"] == "should_stop" and "stopped" not in full.meta
    assert 0 < stopped.peak_bytes <= full.peak_bytes
    assert not stopped.phase_peaks.get("optimizer")  # (it stopped before the first step)
    asked = []
    real = memfit.measure(workload, memfit.Plan(), should_stop=lambda: asked.append(1) or True)
    assert real.meta["stopped"] == "should_stop" and len(asked) == 1
