"""``Plan.fused_loss``: applied by ``apply_plan``, removed with the plan, honoured by dry runs.

Numerics: a step under the plan equals a step without it (same loss and parameters, 1e-5).
Memory: a dry run equals the real run byte for byte, and on a model whose logits dominate, the
measured peak drops by at least the fp32 logits and their gradient, less one chunk of them.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import memfit
from memfit.apply.compose import apply_plan
from memfit.plan import Plan
from memfit.strategies.fused_loss import FusedLossConfig
from memfit.train.oom import switch_plan
from tests.strategies.test_remove import assert_like_fresh
from tests.train._helpers import params, tiny_gpt2

IDS = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))


def _batch() -> dict[str, torch.Tensor]:
    return {"input_ids": IDS, "labels": IDS}


def test_plan_applies_the_fused_loss_and_steps_like_the_plain_plan():
    plain, fused = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    opt = {"name": "sgd", "lr": 0.5}
    a = apply_plan(plain, Plan(optimizer=opt))
    b = apply_plan(fused, Plan(optimizer=opt, fused_loss={"chunk_size": 7}))
    assert b.info["fused_loss"] == "lm_head"
    # The head makes no logits during a training forward with labels.
    assert fused(**_batch()).logits.shape == (2, 16, 0)
    for _ in range(2):
        loss_a, loss_b = a.step(_batch()), b.step(_batch())
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(params(plain).items(), params(fused).values(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)


def test_remove_takes_the_fused_loss_off_with_the_plan():
    model, fresh = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    setup = apply_plan(model, Plan(fused_loss=True, checkpointing="full", precision="bf16-pure"),
                       keep_original_weights=True)  # fmt: skip
    assert "forward" in model.lm_head.__dict__ and "_loss_function" in model.__dict__
    setup.remove()
    assert_like_fresh(model, fresh)
    assert model(**_batch()).logits.shape == (2, 16, 259)


def test_switch_plan_turns_the_fused_loss_on_and_off_keeping_the_optimizer():
    model = tiny_gpt2(seed=0)
    setup = apply_plan(model, Plan(optimizer={"name": "adamw", "lr": 1e-3}))
    setup.step(_batch())
    on, rebuilt = switch_plan(setup, setup.plan.replace(fused_loss=True))
    assert not rebuilt and on.optimizer is setup.optimizer
    assert [n for n, _ in on.handles] == ["kv_cache_off", "fused_loss", "precision"]
    assert model(**_batch()).logits.shape == (2, 16, 0)
    on.step(_batch())
    off, rebuilt = switch_plan(on, on.plan.replace(fused_loss=None))
    assert not rebuilt and [n for n, _ in off.handles] == ["kv_cache_off", "precision"]
    assert model(**_batch()).logits.shape == (2, 16, 259)
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__


class _NotHF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).sum()


def test_a_model_the_fused_loss_cannot_take_is_refused_when_the_plan_is_applied():
    model = _NotHF()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as info:
        apply_plan(model, Plan(fused_loss=True, precision="bf16-pure"))
    message = str(info.value)
    assert "_NotHF is not one" in message
    assert "Hugging Face causal LMs whose output head is an nn.Linear" in message
    assert "memfit.ops.fused_linear_loss" in message and "\n" not in message
    # Refused before any technique changed the model.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not model._forward_pre_hooks and "forward" not in model.head.__dict__


# ---------------------------------------------------------------------------------- plan field
def test_plan_field_forms_and_serialisation(tmp_path):
    assert Plan().fused_loss is None and Plan(fused_loss=False).fused_loss is None
    assert Plan(fused_loss=True).fused_loss == FusedLossConfig()
    plan = Plan(fused_loss={"chunk_size": 512})
    assert plan.fused_loss == FusedLossConfig(chunk_size=512)
    assert plan.to_dict()["fused_loss"] == {"chunk_size": 512, "training_only": True}
    assert Plan().to_dict()["fused_loss"] is None
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    plan.to_yaml(tmp_path / "p.yaml")
    assert Plan.load(tmp_path / "p.yaml") == plan
    assert plan.summary() == "adamw, fused loss (chunks of 512 tokens)"
    assert Plan(fused_loss=True).summary() == "adamw, fused loss"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", "fused_loss must be true, false, null or a mapping with chunk_size"),
        (3, "fused_loss must be true, false, null or a mapping"),
        ({"chunk": 8}, "fused_loss must be true, false, null or a mapping"),
        ({"chunk_size": 0}, "fused_loss chunk_size must be a positive integer or None, got 0"),
        ({"training_only": "no"}, "fused_loss training_only must be true or false, got 'no'"),
    ],
)
def test_bad_fused_loss_values_are_one_sentence(value, message):
    with pytest.raises(memfit.PlanError, match=message) as info:
        Plan.from_dict({"fused_loss": value})
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------- memory
def _logits_heavy(tmp_path) -> str:
    """A GPT-2 whose logits dwarf everything else: vocabulary 8192, width 32, one block."""
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 8192,
        "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "use_cache": False,
        "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_dry_run_equals_real_run_with_the_fused_loss():
    plan = Plan(fused_loss={"chunk_size": 24})
    real = memfit.measure("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=2)
    dry = memfit.dry_run("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=2)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.phase_peaks == real.phase_peaks
    assert dry.peak_bytes == real.peak_bytes


def test_peak_drops_by_the_fp32_logits_and_their_gradient_less_one_chunk(tmp_path):
    spec = _logits_heavy(tmp_path)
    batch, seq, vocab, chunk = 4, 64, 8192, 32
    plain = memfit.measure(spec, Plan(), batch_size=batch, seq_len=seq, steps=1)
    fused = memfit.measure(
        spec, Plan(fused_loss={"chunk_size": chunk}), batch_size=batch, seq_len=seq, steps=1
    )
    logits32 = batch * seq * vocab * 4  # 8 MiB: the fp32 logits (their gradient as much)
    chunk32 = chunk * vocab * 4  # one chunk of them
    saved = plain.peak_bytes - fused.peak_bytes
    assert saved >= 2 * logits32 - chunk32, (saved, 2 * logits32 - chunk32)
    # The dry run sees the same saving.
    dry = memfit.dry_run(
        spec, Plan(fused_loss={"chunk_size": chunk}), batch_size=batch, seq_len=seq, steps=1
    )
    assert dry.peak_bytes == fused.peak_bytes
