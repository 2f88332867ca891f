"""Optimizer offload with the step in backward: each bucket steps on the host as soon as its
gradients land, the same parameters as the on-device optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit.strategies.compose import apply_plan
from memfit.strategies.optimizer_offload import HostOffloadOptimizer

from .test_optimizer_offload import Net, _batch

BUCKET = 64 * 64 * 4  # one weight of ``b``: several buckets, stepped one by one


def _pair(common: dict, offload: dict) -> tuple[Net, Net, object, object]:
    torch.manual_seed(0)
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    ref = apply_plan(ref_model, memfit.Plan(**common))
    off = {"optimizer": "host", "bucket_bytes": BUCKET, **offload}
    got = apply_plan(model, memfit.Plan(**common, optimizer_in_backward=True, offload=off))
    return ref_model, model, ref, got


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor"])
@pytest.mark.parametrize(("accum", "on_host"), [(1, False), (4, False), (4, True)])
def test_parameters_equal_the_on_device_optimizer(optimizer, accum, on_host):
    ref_model, model, ref, got = _pair(
        dict(optimizer=optimizer, grad_accum_steps=accum), {"gradients_on_host": on_host}
    )
    assert type(got.optimizer) is HostOffloadOptimizer and got.optimizer.step_in_backward
    assert len(got.optimizer.buckets) > 1
    for step in range(4):
        ref.step(_batch(step))
        got.step(_batch(step))
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_approx_clipping_uses_the_previous_steps_norm():
    """Each step's gradients are scaled by ``clip_grad_norm_``'s coefficient for the previous
    step's global norm (the first step is not clipped): a hand-written reference."""
    max_norm = 0.05
    torch.manual_seed(0)
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    off = {"optimizer": "host", "bucket_bytes": BUCKET}
    got = apply_plan(model, memfit.Plan(optimizer_in_backward=True, max_grad_norm=max_norm,
                                        grad_clip_mode="approx", offload=off))  # fmt: skip
    coef, norms = 1.0, []
    for step in range(4):
        ref_model(*_batch(step)).backward()
        grads = [p.grad for p in ref_model.parameters()]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        for g in grads:
            g.mul_(coef)
        opt.step()
        opt.zero_grad()
        coef = min(1.0, max_norm / (norm + 1e-6))
        got.step(_batch(step))
        norms.append((norm, float(got.optimizer.last_norm)))
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    for want, seen in norms:
        assert seen == pytest.approx(want, rel=1e-5)
    assert min(n for n, _ in norms) > max_norm  # clipping was active after the first step


def test_the_device_weights_change_during_backward():
    torch.manual_seed(0)
    model = Net()
    setup = apply_plan(model, memfit.Plan(optimizer_in_backward=True,
                                          offload={"optimizer": "host", "bucket_bytes": BUCKET}))  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(*_batch(0))
    setup.stepper.backward(loss, last=True)
    # Every bucket stepped before backward returned: no gradient waits anywhere.
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in setup.optimizer.masters)


def test_device_gradients_stay_within_a_bucket():
    torch.manual_seed(0)
    model = Net()
    plan = memfit.Plan(optimizer_in_backward=True, offload={"optimizer": "host", "bucket_bytes": BUCKET})
    setup = apply_plan(model, plan)
    with memfit.track(model, setup.optimizer) as tracker:
        for step in range(2):
            setup.step(_batch(step))
    report = tracker.report()
    device = report.peak_by_tier_category["device"]
    sizes = sorted(
        sum(setup.optimizer.params[i].numel() * 4 for i in members)
        for members in setup.optimizer.buckets
    )
    # One bucket leaving plus the one filling (a node produces a weight's and a bias's
    # gradients together, and they may fall in neighbouring buckets).
    largest = sizes[-1] + sizes[-2]
    assert device["optimizer_state"] == 0
    assert device["gradients"] <= largest


def test_exact_clipping_is_refused():
    with pytest.raises(memfit.PlanError, match="grad_clip_mode 'approx'"):
        memfit.Plan(optimizer_in_backward=True, max_grad_norm=1.0, offload="host")


def test_dry_run_equals_real_run_with_the_step_in_backward(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256,
                                "n_positions": 64}))  # fmt: skip
    plan = memfit.Plan(optimizer_in_backward=True, max_grad_norm=1.0, grad_clip_mode="approx",
                       offload={"optimizer": "host", "bucket_bytes": 1 << 16})  # fmt: skip
    real = memfit.measure(str(path), plan, batch_size=2, seq_len=16)
    dry = memfit.dry_run(str(path), plan, batch_size=2, seq_len=16)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.peak_by_tier == real.peak_by_tier
