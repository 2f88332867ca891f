"""One step: every entry point runs the same loop and trains identically under every plan field.

Entry points: ``TrainingSetup.step``, ``Prepared.step``, the ``Prepared.accumulate`` +
``backward`` user loop, ``OOMFallback.step``. Plan fields: accumulation, token normalisation,
``max_seq_len``, checkpointing, bf16-mixed, fp16-mixed, bf16-pure (round to nearest and
stochastic), the fused step, clipping, freezing. After two steps on a tiny GPT-2:

* every entry point has exactly the parameters of ``TrainingSetup.step`` (bit for bit), except
  the user loop under token normalisation, which divides the summed gradient once where the
  step weighs each loss (rtol 2e-5, atol 2e-7: rounding of a different summation);
* where the plan is easy to write by hand with plain torch (a full-batch loss, micro-batches
  weighted by hand, slicing, ``clip_grad_norm_``, ``requires_grad_(False)``, ``torch.autocast``,
  ``torch.amp.GradScaler``), ``TrainingSetup.step`` equals that loop: bit for bit, or within
  rtol 1e-5 / atol 1e-7 for token weighting (the full batch's loss vs weighted micro-batches).
"""

from __future__ import annotations

import pytest
import torch

from memfit.apply.compose import apply_plan
from memfit.apply.stepper import FusedStepper, PlainStepper, Stepper
from memfit.plan import Plan
from memfit.train.oom import OOMFallback
from memfit.train.prepare import prepare
from memfit.workload import split_batch
from tests.train._helpers import tiny_gpt2

LR = 1e-2
OPT = {"name": "adamw", "lr": LR}
SGD = {"name": "sgd", "lr": 0.1}
FP16 = {"mode": "fp16-mixed", "init_scale": 2.0**20, "backoff_factor": 2.0**-8}
PLANS = {
    "plain": Plan(optimizer=OPT),
    "accumulation": Plan(optimizer=OPT, micro_batch_size=2, grad_accum_steps=2),
    # SGD: the update is linear in the gradient, so summation-order rounding stays rounding
    # (Adam divides by sqrt(v), which magnifies it for near-zero gradients).
    "tokens": Plan(optimizer=SGD, micro_batch_size=1, grad_accum_steps=4,
                   loss_normalization="tokens"),
    "max-seq-len": Plan(optimizer=OPT, max_seq_len=8),
    "checkpointing": Plan(optimizer=OPT, checkpointing="full"),
    "bf16-mixed": Plan(optimizer=OPT, precision="bf16-mixed"),
    # The first step overflows (skipped, the scale backs off 2**20 -> 2**12), the second steps.
    "fp16-mixed": Plan(optimizer=OPT, precision=FP16),
    "bf16-pure": Plan(optimizer=OPT, precision={"mode": "bf16-pure",
                                                "stochastic_rounding": False}),
    "bf16-pure-stochastic": Plan(optimizer=OPT, precision="bf16-pure"),
    "fused-step": Plan(optimizer=OPT, optimizer_in_backward=True),
    "clipping": Plan(optimizer=OPT, max_grad_norm=0.05),
    "freeze": Plan(optimizer=OPT, freeze=("embeddings",)),
}  # fmt: skip


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 259, (4, 12), generator=gen)
        labels = ids.clone()
        labels[0, 6:] = -100  # uneven label counts: token weighting differs from the mean
        labels[3, 2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


# ---------------------------------------------------------------------------------- entries
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
    "setup.step": _setup_step,
    "prepared.step": _prepared_step,
    "oom-fallback": _fallback_step,
    "accumulate-loop": _accumulate_loop,
}


@pytest.fixture(scope="module")
def reference():
    cache: dict[str, torch.nn.Module] = {}

    def get(name):
        if name not in cache:
            cache[name] = _setup_step(PLANS[name])
        return cache[name]

    return get


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_entry_point_trains_like_training_setup_step(entry, name, reference):
    model = ENTRY_POINTS[entry](PLANS[name])
    exact = not (entry == "accumulate-loop" and name == "tokens")
    rtol, atol = (0.0, 0.0) if exact else (2e-5, 2e-7)
    pairs = zip(model.named_parameters(), reference(name).named_parameters(), strict=True)
    for (n, p), (_, q) in pairs:
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=f"{entry} {name} {n}")


# ---------------------------------------------------------------------------------- by hand
def _by_hand(name):
    """The plan written out with plain torch, no memfit."""
    plan = PLANS[name]
    model = tiny_gpt2(seed=0)
    if plan.freeze:
        model.transformer.wte.weight.requires_grad_(False)  # tied to lm_head
        model.transformer.wpe.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(params, lr=0.1) if plan.optimizer.name == "sgd"
           else torch.optim.AdamW(params, lr=LR))  # fmt: skip
    scaler = None
    if name == "fp16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16["init_scale"],
                                      backoff_factor=FP16["backoff_factor"])  # fmt: skip
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(name)
    scales: list[float] = []
    for batch in _batches():
        if plan.max_seq_len:
            batch = {k: v[:, : plan.max_seq_len] for k, v in batch.items()}
        micro = split_batch(batch, 2) if name == "accumulation" else [batch]
        for part in micro:  # the mean of equal micro-batches' losses
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(**part).loss / len(micro)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            if plan.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, plan.max_grad_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)
    if scaler is not None:
        assert scales == [2.0**12, 2.0**12]  # one overflow, then a step
    return model


BY_HAND = ["plain", "accumulation", "tokens", "max-seq-len", "checkpointing", "bf16-mixed",
           "fp16-mixed", "fused-step", "clipping", "freeze"]  # fmt: skip


@pytest.mark.parametrize("name", BY_HAND)
def test_training_setup_step_equals_the_plan_written_by_hand(name, reference):
    model = _by_hand(name)
    # Token weighting: the full batch's token mean against micro-batch means weighted t_i / T.
    rtol, atol = (1e-5, 1e-7) if name == "tokens" else (0.0, 0.0)
    pairs = zip(reference(name).named_parameters(), model.named_parameters(), strict=True)
    for (n, p), (_, q) in pairs:
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=f"{name} {n}")


def test_plan_fields_change_training(reference):
    # The comparisons above are not vacuous: each field trains differently from the plain plan
    # (and token weighting from mean weighting).
    plain = reference("plain")
    for name in PLANS:
        if name in ("plain", "accumulation", "checkpointing", "fused-step", "tokens"):
            continue  # same gradient as plain by design, or another optimizer
        assert any(
            not torch.equal(p, q)
            for p, q in zip(reference(name).parameters(), plain.parameters(), strict=True)
        ), name
    mean = _setup_step(PLANS["tokens"].replace(loss_normalization="mean"))
    assert any(
        not torch.equal(p, q)
        for p, q in zip(reference("tokens").parameters(), mean.parameters(), strict=True)
    )


# ---------------------------------------------------------------------------------- steppers
def test_steppers():
    plain = apply_plan(tiny_gpt2(), Plan())
    fused = apply_plan(tiny_gpt2(), Plan(optimizer_in_backward=True))
    assert type(plain.stepper) is PlainStepper and type(fused.stepper) is FusedStepper
    assert isinstance(plain.stepper, Stepper) and isinstance(fused.stepper, Stepper)
    assert plain.stepper is plain.stepper  # one stepper per setup (it may hold state)
    state = plain.stepper.state_dict()
    plain.stepper.load_state_dict(state)
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3
    fp16 = apply_plan(tiny_gpt2(), Plan(precision="fp16-mixed"))
    assert fp16.stepper.state_dict()["scaler"] == {
        "scale": 2.0**16, "good_steps": 0, "skipped_steps": 0
    }  # fmt: skip


def test_a_micro_batch_without_labels_is_skipped_not_nan():
    # Token weighting gives a micro-batch whose labels are all ignored weight 0; its own mean
    # loss is NaN, and 0 * NaN would poison every gradient.
    plan = Plan(optimizer=SGD, micro_batch_size=2, grad_accum_steps=2, loss_normalization="tokens")
    batch = _batches()[0]
    batch["labels"][2:] = -100
    setup = apply_plan(tiny_gpt2(seed=0), plan)
    loss = setup.step(batch)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())
    # Same as the first micro-batch alone (its weight is 1).
    alone = apply_plan(tiny_gpt2(seed=0), plan.replace(micro_batch_size=None, grad_accum_steps=1))
    alone.step(split_batch(batch, 2)[0])
    for p, q in zip(setup.model.parameters(), alone.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_user_loop_token_weighting_needs_the_batch_and_no_fused_step():
    prepared = prepare(tiny_gpt2(), PLANS["tokens"])
    micro = split_batch(_batches()[0], 1)[0]
    with pytest.raises(ValueError, match="pass the micro-batch"):
        prepared.backward(prepared.loss(micro))
    fused = prepare(tiny_gpt2(), Plan(optimizer_in_backward=True, loss_normalization="tokens"))
    with pytest.raises(ValueError, match=r"use prepared\.step"):
        fused.backward(fused.loss(micro), batch=micro)


def test_a_stepper_that_owns_the_forward_gets_its_share_whole():
    """``run_step`` with a stepper that runs its own schedule (``owns_forward``, as the
    tensor/pipeline layout's does): the stepper's share of the batch, prepared, goes to its
    ``forward_backward`` whole (no micro-batch split by the loop), then ``step`` and
    ``zero_grad``, and the loss reported is ``reduce_loss`` of what it returned."""
    from memfit.apply.stepper import BaseStepper, run_step

    calls: list[str] = []

    class Scheduled(BaseStepper):
        owns_forward = True

        def local_batch(self, batch):
            calls.append("local")
            return batch[:2]

        def forward_backward(self, batch, *, autocast):
            calls.append(f"schedule {tuple(batch.shape)}")
            return torch.tensor(3.0)

        def backward(self, loss, *, last):
            raise AssertionError("the loop must not run backwards for a scheduled stepper")

        def step(self):
            calls.append("step")

        def zero_grad(self):
            calls.append("zero_grad")

        def reduce_loss(self, loss):
            return loss / 3

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    stepper = Scheduled()
    assert isinstance(stepper, Stepper)
    loss = run_step(torch.nn.Identity(), torch.zeros(4, 5), stepper=stepper,
                    autocast=torch.autocast, loss_fn=None, micro_batch_size=1,
                    normalization="mean", max_seq_len=None)
    assert calls == ["local", "schedule (2, 5)", "step", "zero_grad"]
    assert float(loss) == 1.0
