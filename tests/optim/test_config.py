"""The optimizer config: which optimizer a plan builds, and what foreach costs in memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.optim import OneBitAdam
from memfit.optim.config import OptimizerConfig


def test_builds_each_optimizer():
    model = nn.Linear(8, 8)
    for name in ("adamw", "adam", "sgd", "adamw8bit", "adafactor", "lamb", "lars"):
        opt = OptimizerConfig(name=name, lr=1e-3).build(model.parameters())
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups[0]["lr"] == 1e-3
    opt = OptimizerConfig(name="onebit-adam", kwargs={"warmup_steps": 7}).build(model.parameters())
    assert isinstance(opt, OneBitAdam)
    assert opt.param_groups[0]["warmup_steps"] == 7


def test_unknown_name():
    with pytest.raises(ValueError, match="use one of"):
        OptimizerConfig(name="adamax")


def _step_peak(foreach: bool):
    """Peak of one AdamW step (no forward): params, grads, state and the step's temporaries."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = OptimizerConfig(name="adamw", foreach=foreach).build(model.parameters())
    opt.step()  # state exists from now on
    with memfit.track(model, opt) as tr:
        opt.step()
    return tr.report(), sum(p.numel() * 4 for p in model.parameters())


def test_foreach_costs_about_one_copy_of_the_parameters():
    on, param_bytes = _step_peak(True)
    off, _ = _step_peak(False)
    for rep in (on, off):
        assert rep.peak_by_category["parameters"] == param_bytes
        assert rep.peak_by_category["gradients"] == param_bytes
    # foreach materialises intermediates for all tensors at once (PyTorch's docs: about one
    # extra copy of the parameters); the per-tensor loop holds only the largest tensor's
    # (its sqrt(v) and that divided by the bias correction) and a bias-sized scratch.
    largest, bias = 64 * 64 * 4, 64 * 4
    assert off.peak_by_category["temporaries"] <= 2 * largest + bias
    assert on.peak_by_category["temporaries"] >= param_bytes
    assert on.peak_bytes - off.peak_bytes >= param_bytes - 2 * largest - bias


def test_adafactor_in_a_plan_uses_the_plans_learning_rate():
    opt = OptimizerConfig(name="adafactor", lr=5e-3).build(nn.Linear(4, 4).parameters())
    assert opt.param_groups[0]["lr"] == 5e-3
    assert opt.param_groups[0]["relative_step"] is False
