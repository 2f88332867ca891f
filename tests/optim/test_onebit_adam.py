"""OneBitAdam on one process: Adam/AdamW during the warm-up, a hand-written frozen-variance
reference after it, and what it tells a communication hook."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from memfit.optim import OneBitAdam, build_optimizer, state_bytes
from tests.optim._helpers import loss_fn, regression_task, train

RTOL, ATOL = 1e-6, 1e-7  # against torch's Adam: the same operations in the same order
# Against the reference: the same maths in another order, so rounding differs, and after
# the warm-up m / sqrt(v) with a frozen small v magnifies it: 1e-4 of a step of lr = 1e-2.
REF_RTOL, REF_ATOL = 1e-5, 1e-6


class ReferenceOneBitAdam:
    """Tang et al. (2021), Algorithm 1 without communication, written out per tensor: Adam
    (bias-corrected, decoupled weight decay) for `warmup` steps, then v and its bias
    correction frozen and only the momentum updated."""

    def __init__(self, params, lr, betas, eps, weight_decay, warmup):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd, self.warmup = lr, betas, eps, weight_decay, warmup
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            m.copy_(b1 * m + (1 - b1) * g)
            if self.t <= self.warmup:
                v.copy_(b2 * v + (1 - b2) * g * g)
            v_hat = v / (1 - b2 ** min(self.t, self.warmup))
            m_hat = m / (1 - b1**self.t)
            p.mul_(1 - self.lr * self.wd)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_warmup_is_torch_adam_or_adamw(weight_decay: float) -> None:
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    ours = OneBitAdam(model.parameters(), lr=1e-2, weight_decay=weight_decay, warmup_steps=12)
    cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    theirs = cls(twin.parameters(), lr=1e-2, weight_decay=weight_decay, foreach=False)
    for _ in range(12):
        for m, opt in ((model, ours), (twin, theirs)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            opt.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_after_warmup_matches_frozen_variance_reference(weight_decay: float) -> None:
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    ours = OneBitAdam(model.parameters(), warmup_steps=4, **kwargs)
    ref = ReferenceOneBitAdam(twin.parameters(), warmup=4, **kwargs)
    for _ in range(15):
        for m, opt in ((model, ours), (twin, ref)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            opt.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=REF_RTOL, atol=REF_ATOL)


def test_variance_is_frozen_after_warmup_and_the_step_stays_continuous() -> None:
    model, x, y = regression_task()
    opt = OneBitAdam(model.parameters(), lr=1e-2, warmup_steps=5)
    weight = model[0].weight
    train(model, opt, x, y, 5)
    frozen = opt.state[weight]["exp_avg_sq"].clone()
    momentum = opt.state[weight]["exp_avg"].clone()
    train(model, opt, x, y, 3)
    assert torch.equal(opt.state[weight]["exp_avg_sq"], frozen)
    assert not torch.equal(opt.state[weight]["exp_avg"], momentum)  # the momentum moves on
    # Unlike plain Adam, which keeps updating v (here: the first step past the warm-up is not
    # Adam's, but both take a step of the same size, the bias correction being frozen too).
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opt_a = OneBitAdam(a.parameters(), lr=1e-2, warmup_steps=5)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2, foreach=False)
    train(a, opt_a, x, y, 5)
    train(b, opt_b, x, y, 5)
    before = [p.detach().clone() for p in a.parameters()]
    train(a, opt_a, x, y, 1)
    train(b, opt_b, x, y, 1)
    step_a, step_b = (
        math.sqrt(
            sum(
                float(((p.detach() - q) ** 2).sum())
                for p, q in zip(m.parameters(), before, strict=True)
            )
        )
        for m in (a, b)
    )
    assert step_a == pytest.approx(step_b, rel=0.1)
    assert step_a != step_b


def test_compressible_momentum_only_past_the_warmup() -> None:
    model, x, y = regression_task()
    opt = OneBitAdam(model.parameters(), lr=1e-2, betas=(0.8, 0.99), warmup_steps=3)
    weight = model[0].weight
    assert opt.compressible_momentum(weight) is None  # no state yet
    train(model, opt, x, y, 2)
    assert opt.compressible_momentum(weight) is None  # the next step is the last warm-up step
    train(model, opt, x, y, 1)
    beta1, momentum = opt.compressible_momentum(weight)
    assert beta1 == 0.8
    assert momentum is opt.state[weight]["exp_avg"]
    assert opt.compressible_momentum(nn.Parameter(torch.zeros(3))) is None  # not stepped here

    # A parameter added later has its own warm-up; a loaded state_dict's groups are used.
    extra = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra], "betas": (0.5, 0.9)})
    assert opt.compressible_momentum(extra) is None
    saved = opt.state_dict()
    saved["param_groups"][0]["betas"] = (0.7, 0.99)
    opt.load_state_dict(saved)
    assert opt.compressible_momentum(weight)[0] == 0.7


def test_single_process_trains_through_both_stages() -> None:
    model, x, y = regression_task()
    opt = build_optimizer("onebit-adam", model.parameters(), lr=1e-2, warmup_steps=20)
    assert isinstance(opt, OneBitAdam)
    losses = train(model, opt, x, y, 80)
    assert losses[79] < 0.5 * losses[19] < losses[0]


def test_state_is_adams_eight_bytes_per_parameter() -> None:
    model, x, y = regression_task()
    opt = OneBitAdam(model.parameters(), warmup_steps=2)
    train(model, opt, x, y, 4)  # through the warm-up: v is kept (frozen), not dropped
    assert state_bytes(opt) == 8 * sum(p.numel() for p in model.parameters())


def test_low_precision_parameters_keep_fp32_state() -> None:
    model, x, y = regression_task()
    model = model.to(torch.bfloat16)
    opt = OneBitAdam(model.parameters(), lr=1e-2, warmup_steps=5)
    losses = train(model, opt, x.bfloat16(), y, 15)
    assert losses[-1] < losses[0]
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
    assert opt.state[model[0].weight]["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"lr": -1.0}, "learning rate"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"eps": -1.0}, "epsilon"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_rejects_invalid_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        OneBitAdam(nn.Linear(2, 2).parameters(), **kwargs)
