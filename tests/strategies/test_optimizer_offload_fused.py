"""Optimizer offload with the step in backward: each bucket steps on the host as soon as its
gradients land, the same parameters as the on-device optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit.apply.compose import apply_plan
from memfit.strategies.offload import host_copy_of
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


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_with_parameter_offload_the_buckets_step_the_host_copies(precision):
    """Streamed parameters have no device storage between uses: a bucket stepped in backward
    updates their host copies (the next fetch reads them), never the released storage, and
    trains like the same offload stepping after backward."""
    from .test_parameter_offload import N_LAYER, _gpt2
    from .test_parameter_offload import _batch as _tokens

    reference, model = _gpt2(), _gpt2()
    off = {"optimizer": "host", "parameters": "host", "bucket_bytes": 1 << 14}
    ref = apply_plan(reference, memfit.Plan(precision=precision, offload=off))
    got = apply_plan(model, memfit.Plan(precision=precision, optimizer_in_backward=True,
                                        offload=off))  # fmt: skip
    assert got.optimizer.step_in_backward and len(got.optimizer.buckets) > N_LAYER
    weight = model.transformer.h[1].mlp.c_fc.weight
    before = host_copy_of(weight).clone()
    for step in range(3):
        torch.testing.assert_close(got.step(_tokens(step)), ref.step(_tokens(step)),
                                   rtol=0, atol=1e-6)  # fmt: skip
        assert weight.untyped_storage().nbytes() == 0  # released: nothing was written there
    assert not torch.equal(host_copy_of(weight), before)
    for a, b in zip(got.optimizer.masters, ref.optimizer.masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    got.remove()
    ref.remove()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_buckets_in_flight_step_in_order_once_landed(monkeypatch):
    """The CUDA path's logic, run on the CPU with stand-in events (the copies themselves are
    synchronous here): a gradient hook steps only buckets whose copies are done, the end of
    backward waits for the others one by one and steps each after its wait, and the
    parameters are the on-device optimizer's."""
    from memfit import device

    log: list[tuple[str, int]] = []

    class Event:
        def __init__(self) -> None:
            self.id = len(events)
            self.done = self.id % 2 == 0  # some have landed by the next hook, others not
            events.append(self)

    events: list[Event] = []

    def wait(event: Event) -> None:
        log.append(("wait", event.id))
        event.done = True

    monkeypatch.setattr(device, "current_event", lambda d: Event())
    monkeypatch.setattr(device, "event_done", lambda e: e is None or e.done)
    monkeypatch.setattr(device, "wait_event", wait)
    ref_model, model, ref, got = _pair({}, {})
    opt = got.optimizer
    step_bucket, move = opt._step_bucket, opt._move

    def logged_step(b: int) -> None:
        log.append(("step", b))
        step_bucket(b)

    def logged_move(b: int) -> None:
        log.append(("fill", b))
        move(b)

    monkeypatch.setattr(opt, "_step_bucket", logged_step)
    monkeypatch.setattr(opt, "_move", logged_move)
    ref.step(_batch(0))
    got.step(_batch(0))
    filled = [b for what, b in log if what == "fill"]
    assert len(events) == len(filled) == len(opt.buckets) >= 3
    # Buckets step in the order they filled, each once: one whose copies were in flight right
    # after its wait; one that had landed without a wait (the third only after the second,
    # in flight before it, was waited for).
    assert [b for what, b in log if what == "step"] == filled
    for k, b in enumerate(filled):
        at = log.index(("step", b))
        if events[k].id % 2:
            assert log[at - 1] == ("wait", k)
        else:
            assert ("wait", k) not in log
    # The first bucket had landed: it stepped in its own hook, before the next one filled.
    assert log.index(("step", filled[0])) < log.index(("fill", filled[1]))
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
