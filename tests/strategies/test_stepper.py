"""One step: every entry point runs the same loop and trains identically under every plan field."""

from __future__ import annotations

import pytest
import torch

from memfit.plan import Plan
from memfit.strategies.compose import apply_plan
from memfit.strategies.stepper import FusedStepper, PlainStepper, Stepper
from memfit.train.oom import OOMFallback
from memfit.train.prepare import prepare
from memfit.workload import split_batch
from tests.train._helpers import tiny_gpt2

OPT = {"name": "adamw", "lr": 1e-2}
PLANS = {
    "plain": Plan(optimizer=OPT),
    "accumulation": Plan(optimizer=OPT, micro_batch_size=2, grad_accum_steps=2),
    # SGD: the user loop divides the summed gradients once, the step divides each loss; Adam
    # would magnify that rounding difference for near-zero gradients (it normalises them).
    "tokens": Plan(optimizer={"name": "sgd", "lr": 0.1}, micro_batch_size=1, grad_accum_steps=4,
                   loss_normalization="tokens"),
    "max-seq-len": Plan(optimizer=OPT, max_seq_len=8),
    "checkpointing": Plan(optimizer=OPT, checkpointing="full"),
    "bf16-mixed": Plan(optimizer=OPT, precision="bf16-mixed"),
    "fp16-mixed": Plan(optimizer=OPT, precision="fp16-mixed"),
    "bf16-pure": Plan(optimizer=OPT, precision={"mode": "bf16-pure",
                                                "stochastic_rounding": False}),
    "fused-step": Plan(optimizer=OPT, optimizer_in_backward=True),
    "clipping": Plan(optimizer=OPT, max_grad_norm=0.05),
    "freeze": Plan(optimizer=OPT, freeze=("embeddings",)),
}  # fmt: skip


def _batches():
    torch.manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 259, (4, 12))
        labels = ids.clone()
        labels[0, 6:] = -100  # uneven label counts: token weighting differs from the mean
        labels[3, 2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _setup_step(plan):
    setup = apply_plan(tiny_gpt2(seed=0), plan)
    for b in _batches():
        setup.step(b)
    return setup.model


def _prepared_step(plan):
    prepared = prepare(tiny_gpt2(seed=0), plan)
    for b in _batches():
        prepared.step(b)
    return prepared.model


def _fallback_step(plan):
    runner = OOMFallback(apply_plan(tiny_gpt2(seed=0), plan), batch_size=4)
    for b in _batches():
        runner.step(b)
    return runner.setup.model


def _accumulate_loop(plan):
    prepared = prepare(tiny_gpt2(seed=0), plan)
    for b in _batches():
        for micro in split_batch(b, plan.micro_batch_for(4)):
            with prepared.accumulate():
                prepared.backward(prepared.loss(micro), batch=micro)
    return prepared.model


ENTRY_POINTS = {
    "prepared.step": _prepared_step,
    "oom-fallback": _fallback_step,
    "accumulate-loop": _accumulate_loop,
}
# The one combination a user loop cannot do exactly (and says so, tested below).
_CANNOT = {("accumulate-loop", "fused-step+tokens")}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_entry_point_trains_like_training_setup_step(entry, name):
    plan = PLANS[name]
    reference = _setup_step(plan)
    model = ENTRY_POINTS[entry](plan)
    # fp32 (and bf16 through identical ops): equal up to the summation order of the
    # token-weighted user loop, which divides the gradients once instead of each loss.
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6, msg=f"{entry} {name} {n}")


def test_plan_fields_change_training():
    # The comparison above is not vacuous: each field trains differently from the plain plan.
    plain = _setup_step(PLANS["plain"])
    pairs = [(PLANS[n], plain) for n in ("max-seq-len", "bf16-pure", "clipping", "freeze")]
    pairs.append((PLANS["tokens"], _setup_step(PLANS["tokens"].replace(loss_normalization="mean"))))
    for plan, other in pairs:
        model = _setup_step(plan)
        assert any(
            not torch.equal(p, q)
            for p, q in zip(model.parameters(), other.parameters(), strict=True)
        ), plan.summary()


def test_steppers():
    plain = apply_plan(tiny_gpt2(), Plan())
    fused = apply_plan(tiny_gpt2(), Plan(optimizer_in_backward=True))
    assert type(plain.stepper) is PlainStepper and type(fused.stepper) is FusedStepper
    assert isinstance(plain.stepper, Stepper) and isinstance(fused.stepper, Stepper)
    state = plain.stepper.state_dict()
    plain.stepper.load_state_dict(state)
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3


def test_user_loop_token_weighting_needs_the_batch_and_no_fused_step():
    prepared = prepare(tiny_gpt2(), PLANS["tokens"])
    micro = split_batch(_batches()[0], 1)[0]
    with pytest.raises(ValueError, match="pass the micro-batch"):
        prepared.backward(prepared.loss(micro))
    fused = prepare(tiny_gpt2(), Plan(optimizer_in_backward=True, loss_normalization="tokens"))
    with pytest.raises(ValueError, match=r"use prepared\.step"):
        fused.backward(fused.loss(micro), batch=micro)
