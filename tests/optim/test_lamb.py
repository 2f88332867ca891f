"""Lamb against a hand-written reference of the paper's algorithm (and torch_optimizer)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from memfit.optim import Lamb
from tests.optim._helpers import assert_state_dict_roundtrip, loss_fn, regression_task, train

RTOL, ATOL = 1e-5, 1e-7


class ReferenceLamb:
    """LAMB written out per tensor, straight from You et al. (2020), Algorithm 2."""

    def __init__(self, params, lr, betas, eps, weight_decay, bias_correction, clamp_value):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.bias_correction, self.clamp_value = bias_correction, clamp_value
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
            v.copy_(b2 * v + (1 - b2) * g * g)
            if self.bias_correction:
                m_hat, v_hat = m / (1 - b1**self.t), v / (1 - b2**self.t)
            else:
                m_hat, v_hat = m, v
            r = m_hat / (v_hat.sqrt() + self.eps)
            u = r + self.wd * p
            w_norm = p.norm()
            if self.clamp_value is not None:
                w_norm = w_norm.clamp(max=self.clamp_value)
            u_norm = u.norm()
            trust = w_norm / u_norm if (w_norm > 0 and u_norm > 0) else 1.0
            p.sub_(self.lr * trust * u)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("clamp_value", [10.0, 0.5, None])
def test_matches_reference(bias_correction: bool, weight_decay: float, clamp_value) -> None:
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    ours = Lamb(
        model.parameters(), bias_correction=bias_correction, clamp_value=clamp_value, **kwargs
    )
    ref = ReferenceLamb(
        twin.parameters(), bias_correction=bias_correction, clamp_value=clamp_value, **kwargs
    )
    for _ in range(10):
        for m, opt in ((model, ours), (twin, ref)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            opt.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_matches_torch_optimizer_lamb() -> None:
    torch_optimizer = pytest.importorskip(
        "torch_optimizer", reason="torch-optimizer is not installed: no comparison with its Lamb"
    )
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    ours = Lamb(model.parameters(), lr=1e-2, weight_decay=0.01, bias_correction=False)
    theirs = torch_optimizer.Lamb(twin.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(10):
        for m, opt in ((model, ours), (twin, theirs)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_trust_ratio_is_one_for_zero_weights() -> None:
    p = nn.Parameter(torch.zeros(10))
    opt = Lamb([p], lr=0.1, bias_correction=True, eps=0.0)
    p.grad = torch.full((10,), 2.0)
    opt.step()
    # Adam's first bias-corrected step is sign(g); with ||w|| = 0 the ratio falls back to 1.
    torch.testing.assert_close(p.detach(), torch.full((10,), -0.1))
    assert float(opt.state[p]["trust_ratio"]) == 1.0


def test_step_length_is_relative_to_weight_norm() -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(100) * 3)
    before = p.detach().clone()
    opt = Lamb([p], lr=0.01, clamp_value=None)
    p.grad = torch.randn(100)
    opt.step()
    assert (p.detach() - before).norm().item() == pytest.approx(0.01 * before.norm().item(), rel=1e-5)


def test_bf16_and_grad_none_and_sparse() -> None:
    model, x, y = regression_task()
    model = model.to(torch.bfloat16)
    opt = Lamb(model.parameters(), lr=1e-2)
    losses = train(model, opt, x.bfloat16(), y, 10)
    assert losses[-1] < losses[0]
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    opt = Lamb([a, b])
    a.grad = torch.ones(3)
    opt.step()
    assert b not in opt.state
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Lamb(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_state_dict_roundtrip() -> None:
    model, x, y = regression_task()
    assert_state_dict_roundtrip(
        lambda m: Lamb(m.parameters(), lr=1e-2, weight_decay=0.01), model, x, y
    )
    assert math.isfinite(loss_fn(model, x, y).item())
