"""Lars against a hand-written reference of the paper's algorithm."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memfit.optim import Lars
from tests.optim._helpers import assert_state_dict_roundtrip, loss_fn, regression_task, train

RTOL, ATOL = 1e-5, 1e-7


class ReferenceLars:
    """LARS written out per tensor (You, Gitman & Ginsburg 2017, Algorithm 1, with SGD-style
    dampening/Nesterov options and the usual exemption of 1-D tensors)."""

    def __init__(self, params, lr, momentum, weight_decay, eta, eps, nesterov, exclude_1d):
        self.params = list(params)
        self.lr, self.momentum, self.wd, self.eta, self.eps = lr, momentum, weight_decay, eta, eps
        self.nesterov, self.exclude_1d = nesterov, exclude_1d
        self.bufs: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            g = p.grad.clone()
            if not (self.exclude_1d and p.ndim <= 1):
                w_norm, g_norm = p.norm(), g.norm()
                if w_norm > 0 and g_norm > 0:
                    local_lr = self.eta * w_norm / (g_norm + self.wd * w_norm + self.eps)
                else:
                    local_lr = 1.0
                g = local_lr * (g + self.wd * p)
            if self.momentum:
                buf = g.clone() if self.bufs[i] is None else self.momentum * self.bufs[i] + g
                self.bufs[i] = buf
                g = g + self.momentum * buf if self.nesterov else buf
            p.sub_(self.lr * g)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-3])
@pytest.mark.parametrize("exclude_1d", [True, False])
def test_matches_reference(nesterov: bool, weight_decay: float, exclude_1d: bool) -> None:
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    kwargs = {"lr": 1.0, "momentum": 0.9, "weight_decay": weight_decay}
    extra = {"eta": 0.02, "eps": 1e-8, "nesterov": nesterov, "exclude_1d": exclude_1d}
    ours = Lars(model.parameters(), **kwargs, **extra)
    ref = ReferenceLars(twin.parameters(), **kwargs, **extra)
    losses = []
    for _ in range(10):
        for m, opt in ((model, ours), (twin, ref)):
            m.zero_grad()
            loss = loss_fn(m, x, y)
            loss.backward()
            opt.step()
        losses.append(loss.item())
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]


def test_excluded_vectors_take_plain_sgd_momentum_steps() -> None:
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    ours = Lars(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    sgd = torch.optim.SGD([p for p in twin.parameters() if p.ndim == 1], lr=0.1, momentum=0.9)
    for _ in range(3):
        for m, opt in ((model, ours), (twin, sgd)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            opt.step()
        twin[0].weight.data.copy_(model[0].weight)  # keep the matrices in sync
        twin[2].weight.data.copy_(model[2].weight)
    torch.testing.assert_close(model[0].bias, twin[0].bias, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(model[2].bias, twin[2].bias, rtol=RTOL, atol=ATOL)


def test_zero_weights_fall_back_to_trust_one_and_no_momentum() -> None:
    w = nn.Parameter(torch.zeros(3, 3))
    opt = Lars([w], lr=0.5, momentum=0.0)
    w.grad = torch.ones(3, 3)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3, 3), -0.5))
    assert opt.state[w] == {}


def test_step_length_follows_trust_coefficient() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(20, 20))
    before = w.detach().clone()
    opt = Lars([w], lr=1.0, momentum=0.0, eta=1e-3, eps=0.0)
    w.grad = torch.randn(20, 20) * 1e3  # the gradient scale cancels out
    opt.step()
    assert (w.detach() - before).norm().item() == pytest.approx(1e-3 * before.norm().item(), rel=1e-5)


def test_validation_bf16_grad_none_sparse() -> None:
    with pytest.raises(ValueError, match="Nesterov"):
        Lars([nn.Parameter(torch.zeros(2))], momentum=0.0, nesterov=True)
    model, x, y = regression_task()
    model = model.to(torch.bfloat16)
    opt = Lars(model.parameters(), lr=1.0, eta=0.02)
    losses = train(model, opt, x.bfloat16(), y, 10)
    assert losses[-1] < losses[0]
    assert opt.state[model[0].weight]["momentum_buffer"].dtype == torch.float32
    a, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    opt = Lars([a, b])
    a.grad = torch.ones(3, 3)
    opt.step()
    assert b not in opt.state
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Lars(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_state_dict_roundtrip() -> None:
    model, x, y = regression_task()
    assert_state_dict_roundtrip(
        lambda m: Lars(m.parameters(), lr=1.0, eta=0.02, weight_decay=1e-4), model, x, y
    )
