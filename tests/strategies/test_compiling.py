"""torch.compile as a plan technique: same training, removable, its saving measured."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import memfit
from memfit.apply.compose import apply_plan
from memfit.strategies.compiling import apply_compile, compiled_saved_ratio, saved_bytes

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)  # fmt: skip


def _llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))


def _batch():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_training_equals_eager():
    eager, compiled = _llama(), _llama()
    a = apply_plan(eager, memfit.Plan())
    b = apply_plan(compiled, memfit.Plan(compile="aot_eager_decomp_partition"))
    assert b.info["compiled"] == "aot_eager_decomp_partition"
    for _ in range(2):
        la, lb = a.step(_batch()), b.step(_batch())
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    # Decompositions round differently; Adam's first steps (update about lr * sign(g)) turn a
    # rounding difference in a near-zero gradient into up to ~1e-6 in a parameter.
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=5e-6)


def test_remove_makes_the_model_eager_again():
    model = _llama()
    handle = apply_compile(model, "aot_eager")
    assert model._compiled_call_impl is not None
    handle.remove()
    handle.remove()
    assert model._compiled_call_impl is None
    with pytest.raises(ValueError, match="compile backend 'tvm' is not known"):
        apply_compile(model, "tvm")


def test_the_partitioner_keeps_fewer_activations():
    def build():
        model = _llama()
        batch = _batch()
        return model, lambda: model(**batch).loss

    eager, compiled = compiled_saved_ratio(build)
    model, run = build()
    assert eager == saved_bytes(run, model)  # the eager figure is the plain model's
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert saved_bytes(build()[1]) > eager  # counting the weights would add them (in part)
    assert 0 < compiled < eager and eager < weights * 10


@pytest.mark.subprocess  # inductor compiles: its workers and the C++ compiler
def test_plan_field_and_the_dry_run_applies_the_measured_saving(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                **SIZES, "num_hidden_layers": 4, "max_position_embeddings": 64}))  # fmt: skip
    plain = memfit.dry_run(str(path), memfit.Plan(), batch_size=4, seq_len=32)
    plan = memfit.Plan(compile=True)
    dry = memfit.dry_run(str(path), plan, batch_size=4, seq_len=32)
    measured = dry.meta["compile"]
    assert measured["backend"] == "inductor" and 0 < measured["scale"] < 1
    # Each phase's kept activations scaled; the peak is the highest phase after that.
    for phase, cats in plain.phase_peak_by_category.items():
        kept = cats["activations"]
        assert dry.phase_peak_by_category[phase]["activations"] == round(kept * measured["scale"])
    assert dry.peak_bytes == max(dry.phase_peaks.values())
    assert dry.peak_bytes == plain.peak_bytes - measured["activation_bytes_saved"]
    assert dry.peak_by_tier["device"] == dry.peak_bytes
    assert plan.summary().endswith("compiled") and plan.compile_backend == "inductor"
    assert memfit.Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(memfit.PlanError, match="compile must be true, false or a backend"):
        memfit.Plan(compile="fast")


@pytest.mark.subprocess
@pytest.mark.slow
def test_inductor_trains_like_eager():
    eager, compiled = _llama(), _llama()
    a = apply_plan(eager, memfit.Plan())
    b = apply_plan(compiled, memfit.Plan(compile=True))
    for _ in range(2):
        torch.testing.assert_close(b.step(_batch()), a.step(_batch()), rtol=1e-4, atol=1e-5)
