"""Optimizer offload: the same parameters as the on-device optimizer; state and gradients on
the host, as the tracker measures."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

import memfit
from memfit.apply.compose import apply_plan
from memfit.strategies.optimizer_offload import HostOffloadOptimizer, _buckets


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x))))
        return ((self.c(h) - y) ** 2).mean()


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor"])
@pytest.mark.parametrize("accum", [1, 4])
def test_parameters_equal_the_on_device_optimizer(optimizer, accum):
    torch.manual_seed(0)
    device_model = Net()
    host_model = copy.deepcopy(device_model)
    common = dict(optimizer=optimizer, grad_accum_steps=accum, max_grad_norm=1.0)
    on_device = apply_plan(device_model, memfit.Plan(**common))
    offloaded = apply_plan(host_model, memfit.Plan(**common, offload="host"))
    assert type(offloaded.optimizer) is HostOffloadOptimizer
    for step in range(4):
        on_device.step(_batch(step))
        offloaded.step(_batch(step))
    for p, q in zip(device_model.parameters(), host_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_gradients_accumulated_on_the_host_and_bf16_autocast():
    torch.manual_seed(0)
    device_model = Net()
    host_model = copy.deepcopy(device_model)
    on_device = apply_plan(device_model, memfit.Plan(grad_accum_steps=4, precision="bf16-mixed"))
    offloaded = apply_plan(host_model, memfit.Plan(
        grad_accum_steps=4, precision="bf16-mixed",
        offload={"optimizer": "host", "gradients_on_host": True}))  # fmt: skip
    for step in range(3):
        on_device.step(_batch(step))
        offloaded.step(_batch(step))
    # Every micro-batch's gradients left the device: 4 micro-batches x 3 steps x 1 bucket.
    assert offloaded.optimizer.transfers == 12
    for p, q in zip(device_model.parameters(), host_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_bf16_device_weights_with_fp32_host_masters():
    torch.manual_seed(0)
    model = Net()
    setup = apply_plan(model, memfit.Plan(precision="bf16-pure", offload="host"))
    for step in range(3):
        setup.step(_batch(step))
    opt = setup.optimizer
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in opt.masters)
    for p, m in zip(model.parameters(), opt.masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))
    # The masters keep what bf16 rounds away: they moved by less than one bf16 step somewhere.
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in opt.masters)


def test_buckets_are_a_constant_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 100, 1)]
    # From the last parameter (backward's order): 4 bytes, 400, 20, 120, then 40 + 40.
    assert _buckets(params, 80) == [[5], [4], [3], [2], [0, 1]]
    assert _buckets(params, 10**6) == [[0, 1, 2, 3, 4, 5]]


def _gpt2():
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _tracked(plan: memfit.Plan):
    model = _gpt2()
    setup = apply_plan(model, plan)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with memfit.track(model, setup.optimizer) as tracker:
        for _ in range(2):
            setup.step({"input_ids": ids, "labels": ids})
    return model, tracker.report()


def test_the_tracker_measures_state_and_gradients_leaving_the_device():
    model, plain = _tracked(memfit.Plan())
    _, offloaded = _tracked(memfit.Plan(offload={"optimizer": "host", "bucket_bytes": 1 << 16}))
    params = sum(p.numel() * 4 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))  # AdamW's fp32 step counter per tensor
    # On the device: no optimizer state at all, and the peak falls by at least the state.
    assert offloaded.peak_by_category["optimizer_state"] == 0
    assert plain.peak_by_category["optimizer_state"] == 2 * params + steps
    assert plain.peak_bytes - offloaded.peak_bytes >= 2 * params
    # On the host: the fp32 masters and AdamW's two moments (and the gradients).
    host = offloaded.peak_by_tier_category["host"]
    assert host["optimizer_state"] == 3 * params + steps
    assert offloaded.peak_by_tier["host"] >= 4 * params
    assert plain.peak_by_tier["host"] == 0


def test_dry_run_equals_real_run_with_the_host_tier(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256,
                                "n_positions": 64}))  # fmt: skip
    plan = memfit.Plan(offload="host")
    real = memfit.measure(str(path), plan, batch_size=2, seq_len=16)
    dry = memfit.dry_run(str(path), plan, batch_size=2, seq_len=16)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.peak_by_tier == real.peak_by_tier and real.peak_by_tier["host"] > 0


def test_state_dict_round_trip_and_remove():
    torch.manual_seed(0)
    model = Net()
    setup = apply_plan(model, memfit.Plan(offload="host"))
    setup.step(_batch(0))
    saved = copy.deepcopy(setup.stepper.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    setup.step(_batch(1))
    setup.stepper.load_state_dict(saved)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # the device parameters take the restored masters
    setup.remove()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="pass no optimizer"):
        model = Net()
        apply_plan(model, memfit.Plan(offload="host"),
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    with pytest.raises(memfit.PlanError, match="grad_clip_mode 'approx'"):
        memfit.Plan(offload="host", optimizer_in_backward=True, max_grad_norm=1.0)
